//! CPU time and peak memory of a controller process, read from procfs.

/// Seconds of user + system CPU the process has used so far (`utime` + `stime` of
/// `/proc/<pid>/stat`, converted with the kernel clock tick).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; fields restart after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')' index 0 is field 3 (state), so utime (field 14) is index 11 and stime index 12.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / clock_tick())
}

/// Peak resident set size in bytes (`VmHWM` of `/proc/<pid>/status`).
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:").map(|k| k * 1024)
}

/// Resident set size now, in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:").map(|k| k * 1024)
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn clock_tick() -> f64 {
    // SAFETY: sysconf only reads a constant of the running kernel.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_own_process() {
        let pid = std::process::id();
        // Burn a little CPU so the counter is not zero on a coarse clock tick.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        assert!(super::cpu_seconds(pid).unwrap() >= 0.0);
        assert!(super::peak_rss_bytes(pid).unwrap() > 1024 * 1024);
        assert!(super::rss_bytes(pid).unwrap() <= super::peak_rss_bytes(pid).unwrap());
    }
}
