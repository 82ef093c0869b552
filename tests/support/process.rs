//! What a gateway process uses, read from `/proc`: CPU time and resident
//! memory; the test process's own limit on open files; and process groups
//! killed whole, so that nothing a test starts outlives it.

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

/// A process the test started in a process group of its own (made with
/// `process_group(0)`, so the group's id is its pid), and everything it
/// started in turn: all killed (SIGKILL) when this is dropped, whether the
/// test passed, failed or panicked. A browser's renderers, a shell's
/// commands and their children go with it; so does any descendant that left
/// the group, found through `/proc` before anything is killed.
pub struct ProcessGroup {
    pid: u32,
}

impl ProcessGroup {
    /// The group of `child`, which must have been spawned with
    /// `process_group(0)`.
    pub fn of(child: &tokio::process::Child) -> ProcessGroup {
        ProcessGroup {
            pid: child.id().expect("the process is running"),
        }
    }

    /// Kills the group and every descendant of its leader now.
    pub fn kill(&self) {
        use rustix::process::{kill_process, kill_process_group, Pid, Signal};
        let Some(group) = Pid::from_raw(self.pid as i32) else {
            return;
        };
        let descendants = descendants(self.pid);
        let _ = kill_process_group(group, Signal::KILL);
        for pid in descendants {
            if let Some(pid) = Pid::from_raw(pid as i32) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Every process descending from `root` (children, theirs, …), from the
/// parent each `/proc/PID/stat` names.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The command name may hold spaces: fields are counted after its `)`.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        if let Some(ppid) = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok())
        {
            parents.push((pid, ppid));
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    found.remove(0);
    found
}
