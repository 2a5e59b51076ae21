//! `cargo xtask bench`: what nantrace costs the job it watches, next to no tracing and an
//! equivalent bpftrace script, on this machine. Writes bench/results.json and
//! docs/performance.md. Not a test: no timing assertions; `--smoke` only proves it runs.
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::root;

mod agent;
mod blocks;
pub mod jobs;
mod render;

pub use render::render;

/// Same tracepoints and fields as nantrace's probes, job followed from the root pid ($1).
const BPFTRACE: &str = r#"
BEGIN { @job[$1] = 1; }
tracepoint:printk:console { printf("kmsg %s\n", str(args->msg)); }
tracepoint:oom:mark_victim { printf("oom %d %s %lu\n", args->pid, str(args->comm), args->anon_rss); }
tracepoint:block:block_rq_issue { @start[args->dev, args->sector] = nsecs; }
tracepoint:block:block_rq_complete /@start[args->dev, args->sector]/ {
  $l = nsecs - @start[args->dev, args->sector];
  @lat[args->dev] = hist($l / 1000);
  if ($l > 50000000 || args->error != 0) { printf("block %d %lu %d %lu\n", args->dev, args->sector, args->error, $l); }
  delete(@start[args->dev, args->sector]);
}
tracepoint:tcp:tcp_retransmit_skb { printf("retrans %d %d %d\n", args->sport, args->dport, args->state); }
tracepoint:sched:sched_process_fork /@job[pid]/ { @job[args->child_pid] = 1; printf("fork %d %d %s\n", pid, args->child_pid, str(args->child_comm)); }
tracepoint:sched:sched_process_exec /@job[pid]/ { printf("exec %d %s\n", pid, str(args->filename)); }
tracepoint:syscalls:sys_enter_exit_group /@job[pid]/ { @code[pid] = args->error_code; }
tracepoint:sched:sched_process_exit /@job[tid]/ { if (args->group_dead) { printf("exit %d %d\n", pid, @code[pid]); delete(@code[pid]); } delete(@job[tid]); }
tracepoint:signal:signal_generate /(args->sig == 9 || args->sig == 11 || args->sig == 7 || args->sig == 6 || args->sig == 8 || args->sig == 15) && @job[args->pid]/ { printf("signal %d %d %d\n", pid, args->pid, args->sig); }
"#;

fn euid() -> u32 {
    extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: no failure mode.
    unsafe { geteuid() }
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn json_line(out: &[u8]) -> Result<serde_json::Value> {
    let s = String::from_utf8_lossy(out);
    let line = s
        .lines()
        .rev()
        .find(|l| l.starts_with('{') || l.starts_with('['))
        .context("no JSON output")?;
    Ok(serde_json::from_str(line)?)
}

fn internal(bin: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let o = Command::new(bin)
        .arg("bench-internal")
        .args(args)
        .output()?;
    if !o.status.success() {
        bail!(
            "bench-internal {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    json_line(&o.stdout)
}

fn stats(v: &mut [f64]) -> serde_json::Value {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return serde_json::Value::Null;
    }
    serde_json::json!({ "median": v[v.len() / 2], "min": v[0], "max": v[v.len() - 1], "n": v.len() })
}

/// A tracer running against a workload that waits for its go file.
struct Tracer {
    child: Child,
    kind: &'static str,
    /// `nantrace-outside`: the idle process it watches instead of the workload.
    decoy: Option<Child>,
}

fn wait_for_line(child: &mut Child, needle: &str, timeout: Duration) -> Result<()> {
    let err = child.stderr.take().context("stderr")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let n2 = needle.to_string();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if l.contains(&n2) {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(timeout)
        .map_err(|_| anyhow::anyhow!("tracer did not report {needle:?} within {timeout:?}"))
}

fn start_tracer(kind: &'static str, bin: &Path, target: u32, tmp: &Path) -> Result<Option<Tracer>> {
    match kind {
        "none" => Ok(None),
        "floor" => {
            // The do-nothing programs on the same tracepoints; they stop when `go-floor` goes.
            let flag = tmp.join("go-floor");
            std::fs::write(&flag, "")?;
            let mut c = Command::new(bin)
                .args(["bench-internal", "floor", "--go"])
                .arg(&flag)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()?;
            wait_for_line(&mut c, "floor programs attached", Duration::from_secs(30))?;
            Ok(Some(Tracer {
                child: c,
                kind,
                decoy: None,
            }))
        }
        // nantrace on its default path (BTF programs where the kernel has BTF); on the
        // tracefs fallback; and watching an idle process, so that every event of the
        // workload is outside the watched job.
        "nantrace" | "nantrace-tracefs" | "nantrace-outside" => {
            let decoy = if kind == "nantrace-outside" {
                Some(Command::new("sleep").arg("3600").spawn()?)
            } else {
                None
            };
            let pid = decoy.as_ref().map_or(target, Child::id);
            let mut cmd = Command::new(bin);
            if kind == "nantrace-tracefs" {
                cmd.env("NANTRACE_PROBE_PATH", "tracefs");
            }
            let mut c = cmd
                .args([
                    "attach",
                    "--pid",
                    &pid.to_string(),
                    "--no-trigger",
                    "exit",
                    "--no-trigger",
                    "signal",
                    "--post",
                    "0",
                    "--out",
                ])
                .arg(tmp)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()?;
            wait_for_line(&mut c, "nantrace: recording", Duration::from_secs(30))?;
            std::thread::sleep(Duration::from_millis(300));
            Ok(Some(Tracer {
                child: c,
                kind,
                decoy,
            }))
        }
        "bpftrace" => {
            let script = tmp.join("nantrace-equivalent.bt");
            std::fs::write(&script, BPFTRACE)?;
            let mut c = Command::new("bpftrace")
                .arg(&script)
                .arg(target.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .env("BPFTRACE_STRLEN", "200")
                .spawn()
                .context("bpftrace (apt-get install bpftrace)")?;
            // bpftrace prints "Attaching N probes..." on stdout (discarded): wait a fixed time.
            std::thread::sleep(Duration::from_secs(3));
            if let Ok(Some(st)) = c.try_wait() {
                let mut e = String::new();
                use std::io::Read as _;
                let _ = c.stderr.take().map(|mut s| s.read_to_string(&mut e));
                bail!("bpftrace exited {st}: {e}");
            }
            Ok(Some(Tracer {
                child: c,
                kind,
                decoy: None,
            }))
        }
        _ => unreachable!(),
    }
}

fn bpf_progs(bin: &Path) -> Result<Vec<serde_json::Value>> {
    Ok(internal(bin, &["bpf-stats"])?
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// One workload run under one tracer: elapsed, tracer CPU, per-program kernel cost.
/// A job floods its stdout, then prints a NaN: nantrace's peak RSS (sampled every 20 ms)
/// against its memory cap, how long the job took with and without nantrace, and the bundle.
fn flood_dump(bin: &Path, lines: u64, cap_mib: u64, tmp: &Path) -> Result<serde_json::Value> {
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

fn run_once(kind: &'static str, bin: &Path, iters: u32, tmp: &Path) -> Result<serde_json::Value> {
    let go = tmp.join("go");
    let _ = std::fs::remove_file(&go);
    let before_ids: Vec<u64> = bpf_progs(bin)?
        .iter()
        .filter_map(|p| p["id"].as_u64())
        .collect();
    let work = Command::new(bin)
        .args([
            "bench-internal",
            "workload",
            "--n",
            &iters.to_string(),
            "--dir",
            "/var/tmp",
            "--go",
        ])
        .arg(&go)
        .stdout(Stdio::piped())
        .spawn()?;
    let tracer = start_tracer(kind, bin, work.id(), tmp)?;
    let progs0: Vec<serde_json::Value> = bpf_progs(bin)?
        .into_iter()
        .filter(|p| !before_ids.contains(&p["id"].as_u64().unwrap_or(0)))
        .collect();
    let cpu0 = tracer.as_ref().and_then(|t| cpu_ticks(t.child.id()));
    std::fs::write(&go, "")?;
    let out = work.wait_with_output()?;
    let w = json_line(&out.stdout)?;
    let cpu1 = tracer.as_ref().and_then(|t| cpu_ticks(t.child.id()));
    let progs1 = bpf_progs(bin)?;
    let mut per_prog = serde_json::Map::new();
    let (mut tot_ns, mut tot_cnt) = (0u64, 0u64);
    for p0 in &progs0 {
        if let Some(p1) = progs1.iter().find(|p| p["id"] == p0["id"]) {
            let dns = p1["run_time_ns"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(p0["run_time_ns"].as_u64().unwrap_or(0));
            let dc = p1["run_cnt"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(p0["run_cnt"].as_u64().unwrap_or(0));
            tot_ns += dns;
            tot_cnt += dc;
            if dc > 0 {
                let name = p0["name"].as_str().unwrap_or("?").to_string();
                per_prog.insert(
                    format!("{name}#{}", p0["id"]),
                    serde_json::json!({ "ns_per_run": dns as f64 / dc as f64, "runs": dc }),
                );
            }
        }
    }
    if let Some(mut t) = tracer {
        if t.kind == "bpftrace" {
            let _ = Command::new("kill")
                .args(["-INT", &t.child.id().to_string()])
                .status();
        }
        if t.kind == "floor" {
            let _ = std::fs::remove_file(tmp.join("go-floor"));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while t.child.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = t.child.kill();
        let _ = t.child.wait();
        if let Some(mut d) = t.decoy.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
    let elapsed = w["elapsed_s"].as_f64().unwrap_or(0.0);
    let tps = 100.0;
    Ok(serde_json::json!({
        "tracer": kind,
        "elapsed_s": elapsed,
        "tracer_cpu_s_per_s": match (cpu0, cpu1) { (Some(a), Some(b)) if elapsed > 0.0 => serde_json::json!((b - a) as f64 / tps / elapsed), _ => serde_json::Value::Null },
        "kernel_ns_per_event": if tot_cnt > 0 { serde_json::json!(tot_ns as f64 / tot_cnt as f64) } else { serde_json::Value::Null },
        "kernel_runs": tot_cnt,
        "programs": per_prog,
    }))
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
fn throughput(bin: &Path, n: u64, ring: Option<&str>, tmp: &Path) -> Result<serde_json::Value> {
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

fn idle_cpu(bin: &Path, secs: f64) -> Result<f64> {
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

pub fn run(smoke: bool, bin: &Path) -> Result<()> {
    if euid() != 0 {
        bail!("cargo xtask bench needs root (it loads eBPF probes and reads BPF run statistics)");
    }
    std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1")
        .context("enabling kernel.bpf_stats_enabled")?;
    let tmp = root().join("bench/tmp");
    std::fs::create_dir_all(&tmp)?;
    let (reps, iters) = if smoke { (1, 40) } else { (5, 1500) };
    let have_bpftrace = Command::new("bpftrace")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let mut kinds = vec![
        "none",
        "floor",
        "nantrace",
        "nantrace-tracefs",
        "nantrace-outside",
    ];
    if have_bpftrace {
        kinds.push("bpftrace");
    }
    let mut runs = Vec::new();
    for rep in 0..reps {
        for k in &kinds {
            eprintln!("xtask bench: workload rep {}/{reps} under {k}", rep + 1);
            match run_once(k, bin, iters, &tmp) {
                Ok(r) => runs.push(r),
                Err(e) => runs.push(serde_json::json!({ "tracer": k, "error": format!("{e:#}") })),
            }
        }
    }
    let col = |k: &str, f: &str| -> Vec<f64> {
        runs.iter()
            .filter(|r| r["tracer"] == k)
            .filter_map(|r| r[f].as_f64())
            .collect()
    };
    let mut summary = serde_json::Map::new();
    for k in &kinds {
        summary.insert(
            k.to_string(),
            serde_json::json!({
                "elapsed_s": stats(&mut col(k, "elapsed_s")),
                "kernel_ns_per_event": stats(&mut col(k, "kernel_ns_per_event")),
                "tracer_cpu_s_per_s": stats(&mut col(k, "tracer_cpu_s_per_s")),
            }),
        );
    }
    let med = |k: &str| {
        summary
            .get(k)
            .and_then(|v| v["elapsed_s"]["median"].as_f64())
    };
    let ratio = |a: &str, b: &str| match (med(a), med(b)) {
        (Some(x), Some(y)) if y > 0.0 => serde_json::json!(x / y),
        _ => serde_json::Value::Null,
    };
    let mut startup_n = Vec::new();
    let mut startup_b = Vec::new();
    for _ in 0..reps.min(3) {
        if let Ok(s) = startup("nantrace", bin, &tmp) {
            startup_n.push(s)
        }
        if have_bpftrace {
            if let Ok(s) = startup("bpftrace", bin, &tmp) {
                startup_b.push(s)
            }
        }
    }
    let storm = if smoke { 2_000 } else { 50_000 };
    let tp = throughput(bin, storm, None, &tmp)
        .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let tp_small = throughput(bin, storm, Some("4096"), &tmp)
        .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let mem = internal(
        bin,
        &["memory", "--n", if smoke { "20000" } else { "600000" }],
    )?;
    let drain = internal(
        bin,
        &["drain", "--n", if smoke { "100000" } else { "5000000" }],
    )?;
    let mut dumps = Vec::new();
    for _ in 0..reps.min(3) {
        dumps.push(
            internal(
                bin,
                &[
                    "dump",
                    "--n",
                    if smoke { "2000" } else { "100000" },
                    "--dir",
                    tmp.to_str().unwrap(),
                ],
            )?["seconds"]
                .as_f64()
                .unwrap_or(0.0),
        );
    }
    let idle = idle_cpu(bin, if smoke { 2.0 } else { 10.0 }).ok();
    let micro = blocks::microcost(bin, if smoke { 20_000 } else { 1_000_000 }, reps.min(3))
        .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let member = blocks::membership(bin, if smoke { 20 } else { 1500 }, reps, &tmp)
        .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let synth = synthetic(
        bin,
        if smoke { 100_000 } else { 500_000 },
        if smoke { 1.0 } else { 10.0 },
    )
    .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let agent = agent::agent(bin, if smoke { 1.0 } else { 10.0 }, &tmp)
        .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let flood = flood_dump(
        bin,
        if smoke { 200_000 } else { 8_000_000 },
        if smoke { 16 } else { 64 },
        &tmp,
    )
    .unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let uname = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let date = Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let results = serde_json::json!({
        "date": date, "kernel": uname, "cpus": cpus, "smoke": smoke, "reps": reps, "workload_iterations": iters,
        "workload": summary,
        "ratios": { "nantrace_vs_none": ratio("nantrace", "none"), "bpftrace_vs_none": ratio("bpftrace", "none"), "nantrace_vs_bpftrace": ratio("nantrace", "bpftrace") },
        "runs": runs,
        "startup_s": { "nantrace": stats(&mut startup_n), "bpftrace": stats(&mut startup_b) },
        "throughput": tp, "throughput_tiny_ring": tp_small,
        "memory": mem, "userspace_drain": drain,
        "dump_s_100k": stats(&mut dumps),
        "idle_cpu_s_per_s": idle,
        "flood_dump": flood,
        "agent": agent,
        "synthetic_throughput": synth,
        "microcost": micro,
        "membership_ab": member,
    });
    // The previous run, for the tables' "before" column.
    let prev_path = std::env::var_os("NANTRACE_BENCH_PREVIOUS").map_or_else(
        || root().join("bench/results.json"),
        std::path::PathBuf::from,
    );
    let previous: serde_json::Value = std::fs::read_to_string(prev_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    if smoke {
        // Smoke mode proves the benchmark runs; it does not overwrite the recorded numbers.
        eprintln!(
            "xtask bench --smoke: ok\n{}",
            serde_json::to_string_pretty(&results["ratios"])?
        );
        for r in results["runs"].as_array().into_iter().flatten() {
            if let Some(e) = r["error"].as_str() {
                // The peer (bpftrace) failing is reported, not ours to fail on.
                if r["tracer"] == "bpftrace" {
                    eprintln!("xtask bench --smoke: WARNING: the bpftrace run failed: {e}");
                } else {
                    bail!("bench smoke: {} run failed: {e}", r["tracer"]);
                }
            }
        }
        if let Some(e) = results["synthetic_throughput"]["error"].as_str() {
            bail!("bench smoke: the synthetic throughput run failed: {e}");
        }
        eprintln!(
            "xtask bench --smoke: synthetic {}",
            results["synthetic_throughput"]
        );
        if let Some(e) = results["microcost"]["error"].as_str() {
            bail!("bench smoke: the building-block run failed: {e}");
        }
        if let Some(e) = results["agent"]["error"].as_str() {
            bail!("bench smoke: the agent run failed: {e}");
        }
        eprintln!("xtask bench --smoke: agent {}", results["agent"]);
        return Ok(());
    }
    std::fs::create_dir_all(root().join("bench"))?;
    std::fs::write(
        root().join("bench/results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    std::fs::write(
        root().join("docs/performance.md"),
        render::markdown(&results, &previous),
    )?;
    eprintln!("xtask bench: wrote bench/results.json and docs/performance.md");
    Ok(())
}

/// `bench-internal synth`: the synthetic generator through the real ring, reader and recorder.
fn synthetic(bin: &Path, rate: u64, secs: f64) -> Result<serde_json::Value> {
    internal(
        bin,
        &[
            "synth",
            "--rate",
            &rate.to_string(),
            "--seconds",
            &secs.to_string(),
            "--burst",
            "32",
            "--threads",
            "2",
        ],
    )
}
