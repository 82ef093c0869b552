//! The ends of attempts and the commits of jobs, counted in one place
//! (`docs/design.md` §12, "Metrics"): `idemgate_attempts_ended_total` and
//! `idemgate_commits_total` are recorded here and nowhere else, by every
//! path that ends an attempt (its task, a lookup or resend, an operator,
//! the sweeper), each once, when the store took the change.
//!
//! The rule: an attempt adds one to `idemgate_attempts_ended_total` when
//! the gateway stops waiting for it (a final state, or `unknown`), and an
//! attempt that ended `unknown` adds one more when it is settled later (its
//! late answer, a lookup, a resend, an operator). So `state="unknown"`
//! counts the unknown outcomes made, and every other state counts the
//! attempts that reached it. Every `succeeded` end is a commit, counted in
//! `idemgate_commits_total` with the same labels.

/// How an attempt's end came about: the `by` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// Its upstream's answer, or its upstream's failure (a refused or
    /// broken connection, a cut stream); also an attempt cancelled or
    /// superseded because another attempt's answer won.
    Upstream,
    /// A lookup of an unknown attempt on its upstream.
    Lookup,
    /// A resend of an unknown attempt that its upstream deduplicated.
    Resend,
    /// An operator's resolution (the admin API, the console, the CLI).
    Operator,
    /// The gateway stopped waiting: the upstream was silent past
    /// `first_byte_timeout` or `stream_idle_timeout`, the attempt deadline
    /// passed, the gateway shut down with it in flight, or the sweeper
    /// found its lease lapsed (its gateway died).
    Deadline,
}

impl By {
    /// The label's value.
    pub fn as_str(self) -> &'static str {
        match self {
            By::Upstream => "upstream",
            By::Lookup => "lookup",
            By::Resend => "resend",
            By::Operator => "operator",
            By::Deadline => "deadline",
        }
    }
}

/// What one route's attempts can end by, beyond their upstream's answers
/// and the gateway's deadlines: the series set at zero for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settles {
    /// Only by an operator (the route does not reconcile).
    ByOperator,
    /// Also by lookups (`[routes.reconcile] path`).
    ByLookup,
    /// Also by resends (`reconcile = "resend"`).
    ByResend,
}

/// Counts one end of an attempt of `route` on `upstream`, in `state` (an
/// attempt state's name), by `by`; a `succeeded` end is also a commit.
/// Call it once the store took the change, and only then.
pub fn ended(route: &str, upstream: &str, state: &'static str, by: By) {
    metrics::counter!(
        "idemgate_attempts_ended_total",
        "route" => route.to_owned(),
        "upstream" => upstream.to_owned(),
        "state" => state,
        "by" => by.as_str(),
    )
    .increment(1);
    if state == "succeeded" {
        metrics::counter!(
            "idemgate_commits_total",
            "route" => route.to_owned(),
            "upstream" => upstream.to_owned(),
            "by" => by.as_str(),
        )
        .increment(1);
    }
}

/// Every (state, by) an attempt can end in: the series set at zero.
fn pairs(settles: Settles) -> Vec<(&'static str, By)> {
    let mut pairs = vec![
        ("succeeded", By::Upstream),
        ("failed", By::Upstream),
        ("rejected", By::Upstream),
        ("superseded", By::Upstream),
        ("unknown", By::Upstream),
        ("unknown", By::Deadline),
        ("succeeded", By::Operator),
        ("failed", By::Operator),
        ("cancelled", By::Operator),
    ];
    match settles {
        Settles::ByOperator => {}
        Settles::ByLookup => pairs.extend([("succeeded", By::Lookup), ("failed", By::Lookup)]),
        // A resend never proves "no effect" (docs/design.md §5).
        Settles::ByResend => pairs.push(("succeeded", By::Resend)),
    }
    pairs
}

/// Sets the ends and commits of `route` on each of `upstreams` at zero, so
/// that a rate or a panel over them reads 0 before the first, not "no
/// data" (the labels are bounded: the configured routes and upstreams).
pub fn zero<'a>(route: &str, upstreams: impl IntoIterator<Item = &'a str>, settles: Settles) {
    for upstream in upstreams {
        for (state, by) in pairs(settles) {
            metrics::counter!(
                "idemgate_attempts_ended_total",
                "route" => route.to_owned(),
                "upstream" => upstream.to_owned(),
                "state" => state,
                "by" => by.as_str(),
            )
            .increment(0);
            if state == "succeeded" {
                metrics::counter!(
                    "idemgate_commits_total",
                    "route" => route.to_owned(),
                    "upstream" => upstream.to_owned(),
                    "by" => by.as_str(),
                )
                .increment(0);
            }
        }
    }
}
