//! What each listener allows its clients, and the memory budget of the bytes
//! requests make the gateway hold (`docs/design.md` §18), sized from the
//! container's memory limit unless configured.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idemgate_proxy::server::Limits;

use super::bounds::{at_most, count_at_most, DAY, MAX_CONNECTIONS};
use super::{at_least_one, bad, positive, size, ConfigError, FileConfig, Flags, Route};

/// What each listener allows its clients.
pub(super) fn limits(file: &FileConfig) -> Result<Limits, ConfigError> {
    let max_header_size = size("max_header_size", file.max_header_size, 64 * 1024)?;
    if max_header_size < 8192 {
        return Err(bad(
            "max_header_size",
            "must be at least 8KiB (the smallest header buffer the HTTP server takes)",
        ));
    }
    // Zero turns pings and the idle close off.
    let off_when_zero = |d: Duration| (!d.is_zero()).then_some(d);
    Ok(Limits {
        max_connections: count_at_most(
            "max_connections",
            at_least_one("max_connections", file.max_connections.unwrap_or(10_000))?,
            MAX_CONNECTIONS,
            "each is a file descriptor, and the listener counts them in a semaphore",
        )?,
        header_read_timeout: positive(
            "header_read_timeout",
            file.header_read_timeout.unwrap_or(Duration::from_secs(10)),
        )?,
        keepalive_timeout: positive(
            "keepalive_timeout",
            file.keepalive_timeout.unwrap_or(Duration::from_secs(75)),
        )?,
        max_header_size,
        body_read_timeout: positive(
            "body_read_timeout",
            file.body_read_timeout.unwrap_or(Duration::from_secs(30)),
        )?,
        // Zero: any rate (only the pause timeout applies).
        body_min_rate: file.body_min_rate.map_or(1024, |b| b.as_u64()),
        http2_keepalive_interval: off_when_zero(
            file.http2_keepalive_interval
                .unwrap_or(Duration::from_secs(20)),
        ),
        http2_keepalive_timeout: positive(
            "http2_keepalive_timeout",
            file.http2_keepalive_timeout
                .unwrap_or(Duration::from_secs(20)),
        )?,
        http2_idle_timeout: off_when_zero(
            file.http2_idle_timeout.unwrap_or(Duration::from_secs(60)),
        ),
        send_timeout: send_timeout(file)?,
    })
}

/// How long what a connection has to send may wait on a client that reads
/// none of it: 60 s, as nginx's `send_timeout`. Never off: a client that
/// stops reading would otherwise hold its connection, its answer and a
/// pass-through's upstream connection for ever (`docs/design.md` §18).
fn send_timeout(file: &FileConfig) -> Result<Duration, ConfigError> {
    let key = "send_timeout";
    let d = positive(key, file.send_timeout.unwrap_or(Duration::from_secs(60)))?;
    at_most(
        key,
        d,
        &DAY,
        "a client that reads nothing for a day is gone, not slow",
    )
}

/// The memory budget's size, and where it came from (logged at start-up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes.
    pub bytes: usize,
    /// The most one owner may hold, in bytes (`memory_budget_owner_share`
    /// of `bytes`).
    pub per_owner: usize,
    /// Where the number came from.
    pub from: BudgetSource,
}

/// Where the memory budget's size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSource {
    /// `memory_budget`, `--memory-budget` or `IDEMGATE_MEMORY_BUDGET`.
    Configured,
    /// Half the container's memory limit, of this many bytes.
    Container(u64),
    /// No limit found: [`DEFAULT_BUDGET`].
    Default,
}

/// The budget of a gateway with no memory limit to size it from.
pub const DEFAULT_BUDGET: usize = 256 << 20;

/// The budget: configured, or half the container's memory limit (the other
/// half is the process's own: the replay cache, connections, the runtime,
/// and answers past the budget), or [`DEFAULT_BUDGET`] without one. Every
/// route's body must fit in it, or its large requests could never be taken.
pub(super) fn memory_budget(
    file: &FileConfig,
    flags: &Flags,
    routes: &[Arc<Route>],
    container_limit: Option<u64>,
) -> Result<MemoryBudget, ConfigError> {
    let configured = flags.memory_budget.or(file.memory_budget);
    let (bytes, from) = match (configured, container_limit) {
        (Some(bytes), _) => (
            size("memory_budget", Some(bytes), 0)?,
            BudgetSource::Configured,
        ),
        (None, Some(limit)) => (
            usize::try_from(limit / 2).unwrap_or(usize::MAX),
            BudgetSource::Container(limit),
        ),
        (None, None) => (DEFAULT_BUDGET, BudgetSource::Default),
    };
    let share = file.memory_budget_owner_share.unwrap_or(0.5);
    if !(share > 0.0 && share <= 1.0) {
        return Err(bad(
            "memory_budget_owner_share",
            format!("{share} is not a share of the budget: give a number above 0 and at most 1 (0.5: one owner may hold half the budget; 1: no cap)"),
        ));
    }
    let budget = MemoryBudget {
        bytes,
        per_owner: (bytes as f64 * share) as usize,
        from,
    };
    if let Some(route) = routes.iter().find(|r| r.body_limit > budget.bytes) {
        let why = match budget.from {
            BudgetSource::Configured => "it".to_owned(),
            BudgetSource::Container(limit) => format!(
                "the budget sized from the container's memory limit ({}, halved)",
                bytesize::ByteSize(limit).to_string_as(true)
            ),
            BudgetSource::Default => "the default budget".to_owned(),
        };
        return Err(bad(
            "memory_budget",
            format!(
                "{why} ({}) is smaller than the body_limit of route {:?} ({}): such a request could never be taken; \
                 set memory_budget at least that large (or give the container more memory), or lower the route's body_limit",
                bytesize::ByteSize(budget.bytes as u64).to_string_as(true),
                route.name,
                bytesize::ByteSize(route.body_limit as u64).to_string_as(true),
            ),
        ));
    }
    Ok(budget)
}

/// The smallest `max_response_size` a budget may leave when it lowers it.
const MIN_ANSWERS: usize = 64 << 10;

/// The largest answer recorded whole (`max_response_size`, 10 MiB by
/// default). One that large must fit an owner's share of the budget as it
/// is held while read, its head and body `ANSWER_WEIGHT` times over
/// (`docs/design.md` §18), or every such answer would be paid for and
/// never recorded. Written, one that cannot fit stops start-up; left out,
/// the default is lowered to what fits.
pub(super) fn max_response_size(
    file: &FileConfig,
    budget: &MemoryBudget,
) -> Result<usize, ConfigError> {
    use idemgate_idempotency::ANSWER_WEIGHT;
    use idemgate_proxy::upstream::MAX_ANSWER_HEAD;
    let fits = (budget.per_owner / ANSWER_WEIGHT).saturating_sub(MAX_ANSWER_HEAD);
    let mib = |b: usize| bytesize::ByteSize(b as u64).to_string_as(true);
    let Some(written) = file.max_response_size else {
        if fits < MIN_ANSWERS {
            return Err(bad(
                "memory_budget",
                format!(
                    "one owner's share of it ({} of {}) holds no answer of {} (its head and body, held {ANSWER_WEIGHT} times over), so hardly any keyed answer could be recorded: raise memory_budget, or memory_budget_owner_share",
                    mib(budget.per_owner),
                    mib(budget.bytes),
                    mib(MIN_ANSWERS),
                ),
            ));
        }
        return Ok(fits.min(10 << 20));
    };
    let wanted = size("max_response_size", Some(written), 0)?;
    if wanted > fits {
        let needed = (wanted + MAX_ANSWER_HEAD) * ANSWER_WEIGHT;
        return Err(bad(
            "max_response_size",
            format!(
                "an answer of {} is held {ANSWER_WEIGHT} times over while it is read and committed ({} with its head), more than one owner may hold of the memory budget ({} of {}): such answers would be paid for and never recorded; lower max_response_size to at most {}, or raise memory_budget (or memory_budget_owner_share)",
                mib(wanted),
                mib(needed),
                mib(budget.per_owner),
                mib(budget.bytes),
                mib(fits),
            ),
        ));
    }
    Ok(wanted)
}

/// The memory limit of the container (the cgroup) this process runs in,
/// if it has one: cgroup v2's `memory.max`, or v1's
/// `memory.limit_in_bytes`, the smallest along the process's cgroup and its
/// ancestors.
pub fn container_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_memory_limit(&own, Path::new("/sys/fs/cgroup"))
}

/// A v1 "no limit" is the largest page-aligned `i64`; anything this large
/// means none.
const UNLIMITED: u64 = 1 << 60;

/// The memory limit for a process whose `/proc/self/cgroup` reads `own`,
/// with cgroup filesystems mounted under `root`.
fn cgroup_memory_limit(own: &str, root: &Path) -> Option<u64> {
    let mut limits = Vec::new();
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            // cgroup v2: one hierarchy, at the root (or, on hybrid hosts,
            // under `unified`, which has no memory controller).
            limits.extend(along(root, path, "memory.max"));
        } else if controllers.split(',').any(|c| c == "memory") {
            limits.extend(along(&root.join("memory"), path, "memory.limit_in_bytes"));
        }
    }
    limits.into_iter().min()
}

/// The limits `file` sets in the cgroup at `path` under `root` and in each
/// of its ancestors. Inside a container's own cgroup namespace the path is
/// `/` and the container's limit is at the root.
fn along<'a>(root: &'a Path, path: &'a str, file: &'a str) -> impl Iterator<Item = u64> + 'a {
    let mut dir = Some(root.join(path));
    std::iter::from_fn(move || {
        let here = dir.take()?;
        if here != root {
            dir = here.parent().map(Path::to_path_buf);
        }
        Some(here.join(file))
    })
    .filter_map(|file| std::fs::read_to_string(file).ok())
    .filter_map(|text| text.trim().parse::<u64>().ok())
    .filter(|&limit| limit < UNLIMITED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn settings(toml: &str) -> Result<Settings, ConfigError> {
        let flags = Flags {
            upstreams: vec!["http://127.0.0.1:8000".into()],
            ..Flags::default()
        };
        Settings::from_sources(Settings::parse_file(toml)?, flags)
    }

    #[test]
    fn the_budget_is_as_configured_else_half_the_container_else_the_default() {
        let s = settings("memory_budget = \"64 MiB\"").unwrap();
        assert_eq!(s.memory_budget.bytes, 64 << 20);
        assert_eq!(s.memory_budget.from, BudgetSource::Configured);
        let (file, flags) = (FileConfig::default(), Flags::default());
        let sized = memory_budget(&file, &flags, &[], Some(512 << 20)).unwrap();
        assert_eq!(sized.bytes, 256 << 20);
        assert_eq!(sized.from, BudgetSource::Container(512 << 20));
        let default = memory_budget(&file, &flags, &[], None).unwrap();
        assert_eq!(
            (default.bytes, default.from),
            (DEFAULT_BUDGET, BudgetSource::Default)
        );
        use clap::Parser;
        let flag =
            crate::config::Cli::try_parse_from(["idemgate", "serve", "--memory-budget", "300MiB"]);
        let crate::config::Command::Serve(flags) = flag.unwrap().command else {
            panic!("serve")
        };
        let s = memory_budget(&file, &flags, &[], Some(1 << 30)).unwrap();
        assert_eq!(s.bytes, 300 << 20, "the flag wins over the container");
    }

    /// An answer of `max_response_size` must fit an owner's share of the
    /// budget, four times over with its head: written, one that cannot
    /// stops start-up naming the key and what fits; left out, the 10 MiB
    /// default is lowered to what fits.
    #[test]
    fn an_answer_the_budget_could_never_hold_stops_start_up() {
        let err = settings("memory_budget = \"64MiB\"\nmax_response_size = \"10MiB\"")
            .err()
            .unwrap();
        assert_eq!(err.key, "max_response_size");
        assert!(err.message.contains("at most 7.9 MiB"), "{}", err.message);
        assert!(
            err.message.contains("memory_budget_owner_share"),
            "{}",
            err.message
        );
        let whole = "memory_budget = \"64MiB\"\nmemory_budget_owner_share = 1.0\nmax_response_size = \"10MiB\"";
        assert_eq!(settings(whole).unwrap().max_response_size, 10 << 20);
        let lowered = settings("memory_budget = \"64MiB\"").unwrap();
        assert_eq!(lowered.max_response_size, (8 << 20) - (64 << 10));
        // Not this machine's cgroup: a budget of the default size.
        let budget = |bytes: usize, per_owner: usize| MemoryBudget {
            bytes,
            per_owner,
            from: BudgetSource::Default,
        };
        let unwritten = FileConfig::default();
        let default = max_response_size(&unwritten, &budget(DEFAULT_BUDGET, DEFAULT_BUDGET / 2));
        assert_eq!(default.unwrap(), 10 << 20);
        // A share that would leave no answer room is refused, not taken as 0.
        let err = max_response_size(&unwritten, &budget(1 << 20, 256 << 10)).unwrap_err();
        assert_eq!(err.key, "memory_budget");
        assert!(
            err.message.contains("raise memory_budget"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_budget_too_small_for_a_routes_body_stops_start_up_naming_the_fix() {
        let err = settings("memory_budget = \"1MiB\"").err().unwrap();
        assert_eq!(err.key, "memory_budget");
        assert!(err.message.contains("body_limit"), "{}", err.message);
        let routes = settings("").unwrap().routes;
        let (file, flags) = (FileConfig::default(), Flags::default());
        let err = memory_budget(&file, &flags, &routes, Some(8 << 20)).unwrap_err();
        assert!(
            err.message.contains("container's memory limit"),
            "{}",
            err.message
        );
        let err = settings("memory_budget = 0").err().unwrap();
        assert_eq!(err.key, "memory_budget");
    }

    #[test]
    fn listener_timeouts_default_and_zero_turns_http2_clocks_off() {
        let limits = settings("").unwrap().limits;
        assert_eq!(limits.body_read_timeout, Duration::from_secs(30));
        assert_eq!(
            limits.http2_keepalive_interval,
            Some(Duration::from_secs(20))
        );
        assert_eq!(limits.http2_idle_timeout, Some(Duration::from_secs(60)));
        let off = settings("http2_keepalive_interval = \"0s\"\nhttp2_idle_timeout = \"0s\"")
            .unwrap()
            .limits;
        assert_eq!(
            (off.http2_keepalive_interval, off.http2_idle_timeout),
            (None, None)
        );
        let err = settings("body_read_timeout = \"0s\"").err().unwrap();
        assert_eq!(err.key, "body_read_timeout");
        assert_eq!(limits.body_min_rate, 1024);
        let any = settings("body_min_rate = \"0B\"").unwrap().limits;
        assert_eq!(any.body_min_rate, 0, "zero: any rate");
    }

    #[test]
    fn the_send_timeout_is_a_minute_and_neither_zero_nor_past_a_day() {
        let limits = settings("").unwrap().limits;
        assert_eq!(limits.send_timeout, Duration::from_secs(60), "as nginx");
        let set = settings("send_timeout = \"5s\"").unwrap().limits;
        assert_eq!(set.send_timeout, Duration::from_secs(5));
        for (value, says) in [("0s", "greater than zero"), ("2d", "at most 24h")] {
            let err = settings(&format!("send_timeout = \"{value}\""))
                .err()
                .unwrap();
            assert_eq!(err.key, "send_timeout");
            assert!(err.message.contains(says), "{}", err.message);
        }
    }

    #[test]
    fn an_owner_holds_half_the_budget_unless_told_and_a_share_past_one_stops_start_up() {
        let budget = settings("memory_budget = \"100MiB\"")
            .unwrap()
            .memory_budget;
        assert_eq!(budget.per_owner, 50 << 20);
        let all = settings("memory_budget = \"100MiB\"\nmemory_budget_owner_share = 1.0")
            .unwrap()
            .memory_budget;
        assert_eq!(all.per_owner, 100 << 20);
        for bad in ["0", "0.0", "1.5", "-0.5", "nan"] {
            let err = settings(&format!("memory_budget_owner_share = {bad}"))
                .err()
                .unwrap_or_else(|| panic!("{bad} was taken"));
            assert_eq!(err.key, "memory_budget_owner_share", "{bad}");
            assert!(err.message.contains("at most 1"), "{}", err.message);
        }
    }

    fn write(root: &Path, path: &str, text: &str) {
        let file = root.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, text).unwrap();
    }

    #[test]
    fn a_v2_limit_is_read_at_the_root_of_a_container() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "memory.max", "536870912\n");
        assert_eq!(cgroup_memory_limit("0::/\n", root.path()), Some(512 << 20));
        write(root.path(), "memory.max", "max\n");
        assert_eq!(cgroup_memory_limit("0::/\n", root.path()), None);
    }

    #[test]
    fn the_smallest_limit_along_the_cgroup_and_its_ancestors_counts() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "kubepods/memory.max", "1073741824");
        write(root.path(), "kubepods/pod1/app/memory.max", "max");
        assert_eq!(
            cgroup_memory_limit("0::/kubepods/pod1/app\n", root.path()),
            Some(1 << 30)
        );
    }

    #[test]
    fn a_v1_limit_is_read_from_the_memory_controller() {
        let root = tempfile::tempdir().unwrap();
        write(
            root.path(),
            "memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        write(
            root.path(),
            "memory/docker/abc/memory.limit_in_bytes",
            "268435456\n",
        );
        let own = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n";
        assert_eq!(cgroup_memory_limit(own, root.path()), Some(256 << 20));
        let unlimited = "4:memory:/\n";
        assert_eq!(cgroup_memory_limit(unlimited, root.path()), None);
    }

    #[test]
    fn no_cgroup_files_is_no_limit() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(cgroup_memory_limit("0::/a/b\n", root.path()), None);
        assert_eq!(cgroup_memory_limit("", root.path()), None);
    }
}
