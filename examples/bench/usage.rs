//! What serving costs, read from /proc: CPU time, resident memory, and
//! the system's clock (for a profile's time window).

/// CPU time (user + system) of processes, in microseconds.
pub fn cpu_us(pids: &[u32]) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .map(|stat| {
            // Fields after the command name, which is in parentheses.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
            let stime: f64 = fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
            (utime + stime) / tick * 1e6
        })
        .sum()
}

/// Seconds since boot, to 10 ms.
pub fn uptime() -> f64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}
