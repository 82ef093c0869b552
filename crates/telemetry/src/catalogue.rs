//! Every series the gateway exports, with the `# HELP` text a scraper and
//! a dashboard author read (what it means to an operator, not how the code
//! records it), and `idemgate_build_info`. A test reads `src/` and fails when a series is
//! recorded that is not listed here.

/// What kind of series it is.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// Seconds, in buckets.
    Histogram,
}

/// Every series, its kind and what it means.
pub const SERIES: &[(&str, Kind, &str)] = &[
    ("idemgate_build_info", Kind::Gauge, "Always 1; its version label is the running gateway's version."),
    ("idemgate_requests_total", Kind::Counter, "Requests answered, by outcome (replayed, executed, problem, passed_through) and status class."),
    ("idemgate_request_duration_seconds", Kind::Histogram, "Time from a request's arrival to its answer's head, by outcome (replayed, executed, problem, passed_through)."),
    ("idemgate_upstream_response_seconds", Kind::Histogram, "Time from sending a request upstream to its answer's head, by upstream and outcome: answered (the head came), error (the connection failed first), timeout (the gateway stopped waiting, at first_byte_timeout or the attempt deadline; a head that comes later is not timed again). Attempts and passed-through requests; lookups and resends are in idemgate_reconcile_seconds."),
    ("idemgate_connections_accepted_total", Kind::Counter, "Connections the proxy listener accepted, by worker: with worker_runtime = \"per_thread\" each worker thread accepts its own and serves them (worker 0 is the main thread); with a shared runtime, all count as worker 0."),
    ("idemgate_requests_in_flight", Kind::Gauge, "Requests being served now (max_in_flight bounds it)."),
    ("idemgate_requests_shed_total", Kind::Counter, "Requests answered 503 overloaded at once because max_in_flight was reached."),
    ("idemgate_requests_refused_total", Kind::Counter, "Keyed requests answered with a problem, by problem type: clients' mistakes, overload, and unknown outcomes (attempt-outcome-unknown)."),
    ("idemgate_requests_held_total", Kind::Counter, "Duplicates held on a running job until its outcome."),
    ("idemgate_held_requests", Kind::Gauge, "Duplicates held on a running job now."),
    ("idemgate_jobs_created_total", Kind::Counter, "Jobs created: first requests of a new (owner, key)."),
    ("idemgate_jobs_unknown", Kind::Gauge, "Jobs whose outcome is unknown, awaiting reconciliation or an operator (the console's inbox)."),
    ("idemgate_jobs_purged_total", Kind::Counter, "Jobs removed after key_ttl."),
    ("idemgate_attempts_ended_total", Kind::Counter, "Ends of attempts, by route, upstream, state (succeeded, failed, rejected, superseded, cancelled, unknown) and by (upstream, lookup, resend, operator, deadline), each counted once, when it is recorded. An attempt adds one when the gateway stops waiting for it; one that ended unknown adds one more when it is settled (by its late answer, a lookup, a resend or an operator). So state=unknown counts the unknown outcomes made; by=deadline is the gateway giving up (silence past first_byte_timeout or stream_idle_timeout, the attempt deadline, a shutdown) or a lapsed lease (its gateway died)."),
    ("idemgate_attempts_rejected_total", Kind::Counter, "2xx answers that broke their route's contract, by what the attempt became (outcome: rejected on a side_effect_free route, unknown on any other)."),
    ("idemgate_commits_total", Kind::Counter, "Results committed as their job's outcome, by route, upstream and by: the upstream's answer, a lookup, a resend, or an operator (each succeeded end of idemgate_attempts_ended_total)."),
    ("idemgate_commits_superseded_total", Kind::Counter, "Commits that lost the compare-and-set to another attempt of the same job (a race, settled safely)."),
    ("idemgate_record_retries_total", Kind::Counter, "Writes of what the gateway learned of an attempt (its end, its commit, a lookup's finding) retried after a store error (never dropped)."),
    ("idemgate_failovers_total", Kind::Counter, "Attempts started on a fallback upstream after a safe failure."),
    ("idemgate_hedges_total", Kind::Counter, "Hedged attempts started on a side-effect-free route."),
    ("idemgate_replays_total", Kind::Counter, "Recorded answers replayed, by where they came from (memory, redis, store)."),
    ("idemgate_store_seconds", Kind::Histogram, "Time a store call took, by operation."),
    ("idemgate_store_errors_total", Kind::Counter, "Store calls that failed, by operation and kind."),
    ("idemgate_database_read_only_total", Kind::Counter, "Writes refused by a PostgreSQL that had become a standby (a failover under way)."),
    ("idemgate_wakeups_total", Kind::Counter, "Held duplicates woken by another replica's announcement, by source (postgres, redis)."),
    ("idemgate_dependency_up", Kind::Gauge, "1 while the dependency (store, redis) answers its health check, 0 while it does not; readiness does not depend on it."),
    ("idemgate_fastpath_lookups_total", Kind::Counter, "Redis replay lookups, by result (hit, miss, invalid, error; skipped: not asked while replays are rare)."),
    ("idemgate_fastpath_writes_total", Kind::Counter, "Replay entries written to Redis."),
    ("idemgate_fastpath_errors_total", Kind::Counter, "Redis calls that failed or timed out (the store answered instead)."),
    ("idemgate_fastpath_seconds", Kind::Histogram, "Time a Redis call took."),
    ("idemgate_replay_entries_rejected_total", Kind::Counter, "Redis replay entries that failed authentication or validation and were not served, by reason."),
    ("idemgate_streams_in_flight", Kind::Gauge, "Streamed answers being relayed and recorded now."),
    ("idemgate_streamed_bytes_total", Kind::Counter, "Bytes of streamed answers relayed."),
    ("idemgate_streams_cut_total", Kind::Counter, "Streams whose upstream stopped before the end (the attempt is unknown)."),
    ("idemgate_stream_errors_total", Kind::Counter, "Errors streams reported in band after their head, by route, upstream, type and whether the route retries it (retryable: the attempt failed, nothing committed). The type is the upstream's text, so each series appears at its first error, not at start-up."),
    ("idemgate_polls_total", Kind::Counter, "Polls of jobs answered 202 (Prefer: respond-async), by what they found: running, answered, unsettled (unknown, or nothing runs), not_found, unproven."),
    ("idemgate_stream_joiners_total", Kind::Counter, "Duplicates that joined a stream in progress."),
    ("idemgate_stream_resumes_total", Kind::Counter, "Retries that named a resume point (Last-Event-ID, Idempotency-Events-Received), by result (resumed, refused)."),
    ("idemgate_memory_budget_bytes", Kind::Gauge, "The memory budget: bytes keyed requests may make the gateway hold."),
    ("idemgate_memory_budget_in_use_bytes", Kind::Gauge, "Bytes of the memory budget held now."),
    ("idemgate_memory_budget_refusals_total", Kind::Counter, "Keyed requests answered 503 overloaded because the memory budget was spent."),
    ("idemgate_reconcile_seconds", Kind::Histogram, "Time a lookup or resend of an unknown attempt took to its answer's head, by upstream, by (lookup, resend) and outcome (answered, error, timeout): apart from the attempts' idemgate_upstream_response_seconds."),
    ("idemgate_reconcile_lookups_total", Kind::Counter, "Lookups and resends of an unknown attempt on its upstream, by route, by (lookup, resend) and result (settled_succeeded, settled_no_effect, still_unknown, error)."),
    ("idemgate_upstream_probes_passing", Kind::Gauge, "1 while the upstream's last verification passed its contract's probes, 0 while it did not (eligibility also needs recover_after passes after a failure: see idemgate_upstream_eligible)."),
    ("idemgate_upstream_eligible", Kind::Gauge, "1 while the upstream may be a failover or hedge target under the contract (proven by its probes), 0 while it may not."),
    ("idemgate_probe_runs_total", Kind::Counter, "Probe verifications, by upstream, contract, probe and result (pass, fail, unstable): one per probe per verification, however many runs it sends."),
    ("idemgate_mcp_store_timeouts_total", Kind::Counter, "Store questions about MCP calls at their server that had no answer within 2 s, by question: mark (a keyed call sent with its mark for other replicas still on its way: a cancel reaching another replica meanwhile passes), ask (a cancel or session DELETE let through because the store did not say whether another replica has the call). Errors, and the store's own timeouts at database_timeout (also 2 s by default: whichever comes first counts), are in idemgate_store_errors_total."),
    ("idemgate_task_restarts_total", Kind::Counter, "Background tasks restarted after a failure or panic, by task."),
];

/// Describes every series to the recorder (the `# HELP` lines) and sets
/// `idemgate_build_info`.
pub fn describe() {
    for &(name, kind, help) in SERIES {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, metrics::Unit::Seconds, help),
        }
    }
    metrics::gauge!("idemgate_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `idemgate_…` name a `counter!`, `gauge!` or `histogram!` in
    /// `src/` records.
    fn recorded() -> std::collections::BTreeSet<String> {
        fn walk(dir: &std::path::Path, found: &mut std::collections::BTreeSet<String>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for macro_ in ["counter!(", "gauge!(", "histogram!("] {
                        for piece in text.split(macro_).skip(1) {
                            let piece = piece.trim_start();
                            if let Some(rest) = piece.strip_prefix("\"idemgate_") {
                                let name = rest.split('"').next().unwrap();
                                found.insert(format!("idemgate_{name}"));
                            }
                        }
                    }
                }
            }
        }
        // Every crate of the workspace records series: the binary's and
        // the layers' under crates/.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut found = std::collections::BTreeSet::new();
        walk(&root.join("src"), &mut found);
        walk(&root.join("crates"), &mut found);
        found
    }

    #[test]
    fn every_series_recorded_is_described_once() {
        let described: Vec<&str> = SERIES.iter().map(|(name, _, _)| *name).collect();
        let recorded = recorded();
        assert!(
            recorded.len() > 30,
            "the scan found the series: {recorded:?}"
        );
        for name in &recorded {
            assert!(
                described.contains(&name.as_str()),
                "{name} has no # HELP text here"
            );
        }
        let mut unique = described.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), described.len(), "a series described twice");
        for (name, _, help) in SERIES {
            assert!(help.ends_with('.') && help.len() > 20, "{name}: {help}");
        }
    }
}
