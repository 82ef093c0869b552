//! What a gateway process uses, read from `/proc`: CPU time and resident
//! memory; and the test process's own limit on open files.

use std::time::Duration;

fn status(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process is running")
}

fn kib(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {field} in /proc/PID/status"))
}

/// The most memory the process has had resident since it started (VmHWM).
pub fn peak_rss(pid: u32) -> u64 {
    kib(&status(pid), "VmHWM:") * 1024
}

/// The memory resident now (VmRSS).
pub fn rss(pid: u32) -> u64 {
    kib(&status(pid), "VmRSS:") * 1024
}

/// CPU time the process has used, user and system (`/proc/PID/stat`).
pub fn cpu_time(pid: u32) -> Duration {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process is running");
    // The command name may hold spaces: fields are counted after its `)`.
    let after = &stat[stat.rfind(')').expect("a stat line") + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15; `after` starts at field 3.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let per_second = rustix::param::clock_ticks_per_second();
    Duration::from_secs_f64(ticks as f64 / per_second as f64)
}

/// Files the process has open.
pub fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process is running")
        .count()
}

/// Raises this process's limit on open files (and so its children's, the
/// gateway's) to at least `wanted`, as far as the hard limit allows;
/// panics if that is too low.
pub fn raise_open_files(wanted: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    assert!(
        hard >= wanted,
        "this test needs {wanted} open files and the hard limit is {hard}: raise it (ulimit -Hn)"
    );
    if limit.current.is_some_and(|current| current < wanted) {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(wanted),
                maximum: limit.maximum,
            },
        )
        .expect("raise the open-file limit");
    }
}
