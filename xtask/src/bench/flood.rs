//! A log flood, then the dump: nantrace's memory against its cap while a job floods its
//! stdout, and the time the job took with and without it.
use std::path::Path;
use std::process::Command;

use anyhow::Result;

/// A job floods its stdout, then prints a NaN: nantrace's peak RSS (sampled every 20 ms)
/// against its memory cap, how long the job took with and without nantrace, and the bundle.
pub(super) fn flood_dump(
    bin: &Path,
    lines: u64,
    cap_mib: u64,
    tmp: &Path,
) -> Result<serde_json::Value> {
    let job = format!("yes 'step 1 | loss 2.0 | lr 3e-4 | tokens/s 123456 | mfu 41.2%' | head -n {lines}; echo 'step 2 | loss nan'; sleep 0.5");
    let t = std::time::Instant::now();
    Command::new("sh")
        .args(["-c", &job])
        .stdout(std::process::Stdio::null())
        .status()?;
    let alone = t.elapsed().as_secs_f64();
    let out = tmp.join("flood-out");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let t = std::time::Instant::now();
    let mut child = Command::new(bin)
        .args([
            "run",
            "--no-probes",
            "--post",
            "0.5",
            "--mem-cap-mb",
            &cap_mib.to_string(),
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &job,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut peak_kb = 0u64;
    let status = format!("/proc/{}/status", child.id());
    let mut job_s = None;
    while child.try_wait()?.is_none() {
        if let Ok(st) = std::fs::read_to_string(&status) {
            if let Some(kb) = st
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            {
                peak_kb = peak_kb.max(kb);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let total = t.elapsed().as_secs_f64();
    let bundle = std::fs::read_dir(&out)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("nantrace-"))
        });
    let mut not_scanned = serde_json::Value::Null;
    if let Some(b) = &bundle {
        let head = std::fs::read_to_string(b.join("timeline.json")).unwrap_or_default();
        not_scanned = head
            .lines()
            .find_map(|l| l.trim().strip_prefix("\"log_bytes_not_scanned\": "))
            .map(|v| serde_json::json!(v.trim_end_matches(',').parse::<u64>().unwrap_or(0)))
            .unwrap_or_default();
        let app = std::fs::read_to_string(b.join("app.log")).unwrap_or_default();
        // The job's own time: from the first to the last line it printed.
        let times: Vec<&str> = [app.lines().next(), app.lines().last()]
            .into_iter()
            .flatten()
            .filter_map(|l| l.split(' ').next())
            .collect();
        if let [a, z] = times[..] {
            let p = |s: &str| time_of(s);
            job_s = Some(p(z) - p(a) + 0.5);
        }
    }
    let _ = std::fs::remove_dir_all(&out);
    Ok(serde_json::json!({
        "lines": lines, "cap_mib": cap_mib, "job_s_alone": alone, "nantrace_total_s": total,
        "job_s_under_nantrace": job_s, "peak_rss_mib": peak_kb / 1024, "over_cap_mib": (peak_kb / 1024) as i64 - cap_mib as i64,
        "log_bytes_not_scanned": not_scanned, "bundle": bundle.is_some(),
    }))
}

/// Seconds of an RFC 3339 time (`2026-11-30T15:00:01.123456789Z`) within its day.
fn time_of(s: &str) -> f64 {
    let t = s.split('T').nth(1).unwrap_or("").trim_end_matches('Z');
    let mut parts = t.split(':');
    let h: f64 = parts.next().and_then(|x| x.parse().ok()).unwrap_or(0.0);
    let m: f64 = parts.next().and_then(|x| x.parse().ok()).unwrap_or(0.0);
    let sec: f64 = parts.next().and_then(|x| x.parse().ok()).unwrap_or(0.0);
    h * 3600.0 + m * 60.0 + sec
}
