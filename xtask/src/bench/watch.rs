//! `nantrace watch` against the events it must deliver: launch to the first event (next to
//! bpftrace), a fork storm's throughput and loss, the CPU it takes on an idle machine.
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

use super::{cpu_ticks, json_line, wait_for_line};

/// Startup times, `n` of each: nantrace's, and bpftrace's when it is here (the failed ones
/// left out).
pub(super) fn startups(
    bin: &Path,
    n: usize,
    have_bpftrace: bool,
    tmp: &Path,
) -> (Vec<f64>, Vec<f64>) {
    let mut startup_n = Vec::new();
    let mut startup_b = Vec::new();
    for _ in 0..n {
        if let Ok(s) = startup("nantrace", bin, tmp) {
            startup_n.push(s)
        }
        if have_bpftrace {
            if let Ok(s) = startup("bpftrace", bin, tmp) {
                startup_b.push(s)
            }
        }
    }
    (startup_n, startup_b)
}

/// Launch to first delivered event (a kernel log line written every 10 ms).
fn startup(kind: &str, bin: &Path, tmp: &Path) -> Result<f64> {
    let mut cmd = if kind == "nantrace" {
        let mut c = Command::new(bin);
        c.args(["watch", "--json"]);
        c
    } else {
        let script = tmp.join("startup.bt");
        std::fs::write(
            &script,
            "tracepoint:printk:console { printf(\"%s\\n\", str(args->msg)); }\n",
        )?;
        let mut c = Command::new("bpftrace");
        c.arg(script);
        c
    };
    let t0 = Instant::now();
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let writer = std::thread::spawn(move || {
        let mut i = 0;
        while !s2.load(std::sync::atomic::Ordering::Relaxed) && i < 3000 {
            let _ = std::fs::write("/dev/kmsg", format!("nt-startup-probe {i}\n"));
            i += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let out = child.stdout.take().context("stdout")?;
    let mut first = None;
    for l in BufReader::new(out).lines().map_while(Result::ok) {
        if l.contains("nt-startup-probe") {
            first = Some(t0.elapsed().as_secs_f64());
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = writer.join();
    let _ = child.kill();
    let _ = child.wait();
    first.context("no event delivered")
}

/// Highest process-event rate: a fork storm of the watched job; drops from the accounting.
pub(super) fn throughput(
    bin: &Path,
    n: u64,
    ring: Option<&str>,
    tmp: &Path,
) -> Result<serde_json::Value> {
    let go = tmp.join("go-storm");
    let _ = std::fs::remove_file(&go);
    let storm = Command::new(bin)
        .args(["bench-internal", "forkstorm", "--n", &n.to_string(), "--go"])
        .arg(&go)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut w = Command::new(bin);
    w.args(["watch", "--json", "--pid", &storm.id().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(r) = ring {
        w.env("NANTRACE_RING_BYTES", r);
    }
    let mut watch = w.spawn()?;
    wait_for_line(&mut watch, "watching", Duration::from_secs(30))?;
    let out = watch.stdout.take().context("stdout")?;
    let reader = std::thread::spawn(move || {
        let (mut n, mut acct) = (0u64, serde_json::Value::Null);
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if l.starts_with("{\"accounting\"") {
                acct = serde_json::from_str(&l).unwrap_or_default();
            } else if l.contains("\"source\":\"fork\"") || l.contains("\"source\":\"exit\"") {
                n += 1;
            }
        }
        (n, acct)
    });
    std::fs::write(&go, "")?;
    let so = storm.wait_with_output()?;
    let s = json_line(&so.stdout)?;
    std::thread::sleep(Duration::from_millis(500));
    let _ = Command::new("kill")
        .args(["-INT", &watch.id().to_string()])
        .status();
    let _ = watch.wait();
    let (delivered, acct) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    let secs = s["seconds"].as_f64().unwrap_or(1.0);
    let drops: u64 = acct["accounting"]["kernel_drops"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
    Ok(serde_json::json!({
        "ring_bytes": ring.unwrap_or("8388608 (default)"),
        "forks": n,
        "expected_events": 2 * n,
        "delivered_events": delivered,
        "kernel_drops_reported": drops,
        "offered_events_per_s": 2.0 * n as f64 / secs,
        "delivered_events_per_s": delivered as f64 / secs,
    }))
}

pub(super) fn idle_cpu(bin: &Path, secs: f64) -> Result<f64> {
    let mut c = Command::new(bin)
        .args(["watch", "--json", "--duration", &secs.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    wait_for_line(&mut c, "watching", Duration::from_secs(30))?;
    let a = cpu_ticks(c.id()).unwrap_or(0);
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64((secs - 0.5).max(0.5)));
    let b = cpu_ticks(c.id()).unwrap_or(a);
    let el = t.elapsed().as_secs_f64();
    let _ = c.wait();
    Ok((b - a) as f64 / 100.0 / el)
}
