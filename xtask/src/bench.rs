//! `cargo xtask bench`: what nantrace costs the job it watches, next to no tracing and an
//! equivalent bpftrace script, on this machine. Writes bench/results.json and
//! docs/performance.md. Not a test: no timing assertions; `--smoke` only proves it runs.
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::root;

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
    let line = s.lines().rev().find(|l| l.starts_with('{') || l.starts_with('[')).context("no JSON output")?;
    Ok(serde_json::from_str(line)?)
}

fn internal(bin: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let o = Command::new(bin).arg("bench-internal").args(args).output()?;
    if !o.status.success() {
        bail!("bench-internal {args:?}: {}", String::from_utf8_lossy(&o.stderr));
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
    rx.recv_timeout(timeout).map_err(|_| anyhow::anyhow!("tracer did not report {needle:?} within {timeout:?}"))
}

fn start_tracer(kind: &'static str, bin: &Path, target: u32, tmp: &Path) -> Result<Option<Tracer>> {
    match kind {
        "none" => Ok(None),
        "floor" => {
            // The do-nothing programs on the same tracepoints; they stop when `go-floor` goes.
            let flag = tmp.join("go-floor");
            std::fs::write(&flag, "")?;
            let mut c = Command::new(bin).args(["bench-internal", "floor", "--go"]).arg(&flag).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
            wait_for_line(&mut c, "floor programs attached", Duration::from_secs(30))?;
            Ok(Some(Tracer { child: c, kind, decoy: None }))
        }
        // nantrace on its default path (BTF programs where the kernel has BTF); on the
        // tracefs fallback; and watching an idle process, so that every event of the
        // workload is outside the watched job.
        "nantrace" | "nantrace-tracefs" | "nantrace-outside" => {
            let decoy = if kind == "nantrace-outside" { Some(Command::new("sleep").arg("3600").spawn()?) } else { None };
            let pid = decoy.as_ref().map_or(target, Child::id);
            let mut cmd = Command::new(bin);
            if kind == "nantrace-tracefs" {
                cmd.env("NANTRACE_PROBE_PATH", "tracefs");
            }
            let mut c = cmd
                .args(["attach", "--pid", &pid.to_string(), "--no-trigger", "exit", "--no-trigger", "signal", "--post", "0", "--out"])
                .arg(tmp)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()?;
            wait_for_line(&mut c, "nantrace: recording", Duration::from_secs(30))?;
            std::thread::sleep(Duration::from_millis(300));
            Ok(Some(Tracer { child: c, kind, decoy }))
        }
        "bpftrace" => {
            let script = tmp.join("nantrace-equivalent.bt");
            std::fs::write(&script, BPFTRACE)?;
            let mut c = Command::new("bpftrace").arg(&script).arg(target.to_string()).stdout(Stdio::null()).stderr(Stdio::piped()).env("BPFTRACE_STRLEN", "200").spawn().context("bpftrace (apt-get install bpftrace)")?;
            // bpftrace prints "Attaching N probes..." on stdout (discarded): wait a fixed time.
            std::thread::sleep(Duration::from_secs(3));
            if let Ok(Some(st)) = c.try_wait() {
                let mut e = String::new();
                use std::io::Read as _;
                let _ = c.stderr.take().map(|mut s| s.read_to_string(&mut e));
                bail!("bpftrace exited {st}: {e}");
            }
            Ok(Some(Tracer { child: c, kind, decoy: None }))
        }
        _ => unreachable!(),
    }
}

fn bpf_progs(bin: &Path) -> Result<Vec<serde_json::Value>> {
    Ok(internal(bin, &["bpf-stats"])?.as_array().cloned().unwrap_or_default())
}

/// One workload run under one tracer: elapsed, tracer CPU, per-program kernel cost.
/// A job floods its stdout, then prints a NaN: nantrace's peak RSS (sampled every 20 ms)
/// against its memory cap, how long the job took with and without nantrace, and the bundle.
fn flood_dump(bin: &Path, lines: u64, cap_mib: u64, tmp: &Path) -> Result<serde_json::Value> {
    let job = format!("yes 'step 1 | loss 2.0 | lr 3e-4 | tokens/s 123456 | mfu 41.2%' | head -n {lines}; echo 'step 2 | loss nan'; sleep 0.5");
    let t = std::time::Instant::now();
    Command::new("sh").args(["-c", &job]).stdout(std::process::Stdio::null()).status()?;
    let alone = t.elapsed().as_secs_f64();
    let out = tmp.join("flood-out");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let t = std::time::Instant::now();
    let mut child = Command::new(bin)
        .args(["run", "--no-probes", "--post", "0.5", "--mem-cap-mb", &cap_mib.to_string(), "--out", out.to_str().unwrap(), "--", "sh", "-c", &job])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut peak_kb = 0u64;
    let status = format!("/proc/{}/status", child.id());
    let mut job_s = None;
    while child.try_wait()?.is_none() {
        if let Ok(st) = std::fs::read_to_string(&status) {
            if let Some(kb) = st.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()) {
                peak_kb = peak_kb.max(kb);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let total = t.elapsed().as_secs_f64();
    let bundle = std::fs::read_dir(&out)?.flatten().map(|e| e.path()).find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("nantrace-")));
    let mut not_scanned = serde_json::Value::Null;
    if let Some(b) = &bundle {
        let head = std::fs::read_to_string(b.join("timeline.json")).unwrap_or_default();
        not_scanned = head.lines().find_map(|l| l.trim().strip_prefix("\"log_bytes_not_scanned\": ")).map(|v| serde_json::json!(v.trim_end_matches(',').parse::<u64>().unwrap_or(0))).unwrap_or_default();
        let app = std::fs::read_to_string(b.join("app.log")).unwrap_or_default();
        // The job's own time: from the first to the last line it printed.
        let times: Vec<&str> = [app.lines().next(), app.lines().last()].into_iter().flatten().filter_map(|l| l.split(' ').next()).collect();
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
    let before_ids: Vec<u64> = bpf_progs(bin)?.iter().filter_map(|p| p["id"].as_u64()).collect();
    let work = Command::new(bin).args(["bench-internal", "workload", "--n", &iters.to_string(), "--dir", "/var/tmp", "--go"]).arg(&go).stdout(Stdio::piped()).spawn()?;
    let tracer = start_tracer(kind, bin, work.id(), tmp)?;
    let progs0: Vec<serde_json::Value> = bpf_progs(bin)?.into_iter().filter(|p| !before_ids.contains(&p["id"].as_u64().unwrap_or(0))).collect();
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
            let dns = p1["run_time_ns"].as_u64().unwrap_or(0).saturating_sub(p0["run_time_ns"].as_u64().unwrap_or(0));
            let dc = p1["run_cnt"].as_u64().unwrap_or(0).saturating_sub(p0["run_cnt"].as_u64().unwrap_or(0));
            tot_ns += dns;
            tot_cnt += dc;
            if dc > 0 {
                let name = p0["name"].as_str().unwrap_or("?").to_string();
                per_prog.insert(format!("{name}#{}", p0["id"]), serde_json::json!({ "ns_per_run": dns as f64 / dc as f64, "runs": dc }));
            }
        }
    }
    if let Some(mut t) = tracer {
        if t.kind == "bpftrace" {
            let _ = Command::new("kill").args(["-INT", &t.child.id().to_string()]).status();
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
        std::fs::write(&script, "tracepoint:printk:console { printf(\"%s\\n\", str(args->msg)); }\n")?;
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
    let storm = Command::new(bin).args(["bench-internal", "forkstorm", "--n", &n.to_string(), "--go"]).arg(&go).stdout(Stdio::piped()).spawn()?;
    let mut w = Command::new(bin);
    w.args(["watch", "--json", "--pid", &storm.id().to_string()]).stdout(Stdio::piped()).stderr(Stdio::piped());
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
    let _ = Command::new("kill").args(["-INT", &watch.id().to_string()]).status();
    let _ = watch.wait();
    let (delivered, acct) = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))?;
    let secs = s["seconds"].as_f64().unwrap_or(1.0);
    let drops: u64 = acct["accounting"]["kernel_drops"].as_object().map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
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
    let mut c = Command::new(bin).args(["watch", "--json", "--duration", &secs.to_string()]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    wait_for_line(&mut c, "watching", Duration::from_secs(30))?;
    let a = cpu_ticks(c.id()).unwrap_or(0);
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64((secs - 0.5).max(0.5)));
    let b = cpu_ticks(c.id()).unwrap_or(a);
    let el = t.elapsed().as_secs_f64();
    let _ = c.wait();
    Ok((b - a) as f64 / 100.0 / el)
}

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `nantrace agent`: idle CPU and RSS with 0, 1 and 4 watched jobs, job start to "watched",
/// trigger (`ctl dump`, post-window 0) to bundle on disk.
fn agent(bin: &Path, secs: f64, tmp: &Path) -> Result<serde_json::Value> {
    let dir = tmp.join("agent");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("run/agent.sock");
    let spool = dir.join("spool");
    let mut a = Command::new(bin)
        .args(["agent", "--spool", spool.to_str().unwrap(), "--socket", sock.to_str().unwrap(), "--metrics-addr", "127.0.0.1:19499", "--match", "nt-benchjob-", "--post", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let result = (|| -> Result<serde_json::Value> {
        wait_for_line(&mut a, "probes attached", Duration::from_secs(30))?;
        let ctl = |args: &[&str]| -> Result<serde_json::Value> {
            let o = Command::new(bin).arg("ctl").args(args).args(["--json", "--socket", sock.to_str().unwrap()]).output()?;
            if !o.status.success() {
                bail!("ctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
            }
            json_line(&o.stdout)
        };
        let measure = |pid: u32| -> (f64, Option<u64>) {
            let c0 = cpu_ticks(pid).unwrap_or(0);
            let t = Instant::now();
            std::thread::sleep(Duration::from_secs_f64(secs));
            let c1 = cpu_ticks(pid).unwrap_or(c0);
            ((c1 - c0) as f64 / 100.0 / t.elapsed().as_secs_f64(), rss_kib(pid))
        };
        let mut out = serde_json::Map::new();
        std::thread::sleep(Duration::from_secs(1));
        let (cpu0, rss0) = measure(a.id());
        out.insert("jobs0".into(), serde_json::json!({ "cpu_s_per_s": cpu0, "rss_kib": rss0 }));
        let mut jobs: Vec<Child> = Vec::new();
        let mut to_watched = Vec::new();
        for n in [1usize, 4] {
            while jobs.len() < n {
                let i = jobs.len();
                let script = dir.join(format!("nt-benchjob-{i}.sh"));
                std::fs::write(&script, format!("#!/bin/sh\nwhile :; do echo \"job {i} loss 0.5\"; sleep 0.5; done\n"))?;
                std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
                let log = std::fs::File::create(dir.join(format!("nt-benchjob-{i}.log")))?;
                let t = Instant::now();
                let c = Command::new(&script).stdout(log.try_clone()?).stderr(log).spawn()?;
                let pid = c.id();
                jobs.push(c);
                loop {
                    if ctl(&["jobs"])?["jobs"].as_array().is_some_and(|j| j.iter().any(|j| j["root"] == pid)) {
                        to_watched.push(t.elapsed().as_secs_f64());
                        break;
                    }
                    if t.elapsed() > Duration::from_secs(20) {
                        bail!("job {pid} not watched within 20 s");
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            std::thread::sleep(Duration::from_secs(1));
            let (cpu, rss) = measure(a.id());
            out.insert(format!("jobs{n}"), serde_json::json!({ "cpu_s_per_s": cpu, "rss_kib": rss }));
        }
        // Trigger to bundle: `ctl dump` of one job, post-window 0.
        let key = ctl(&["jobs"])?["jobs"][0]["key"].as_str().unwrap_or("").to_string();
        let t = Instant::now();
        ctl(&["dump", "--job", &key])?;
        let dump_s = loop {
            let done = std::fs::read_dir(&spool)?.flatten().any(|e| e.file_name().to_string_lossy().starts_with("nantrace-"));
            if done {
                break t.elapsed().as_secs_f64();
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!("no bundle 60 s after ctl dump");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        for mut j in jobs {
            let _ = j.kill();
            let _ = j.wait();
        }
        out.insert("start_to_watched_s".into(), stats(&mut to_watched));
        out.insert("trigger_to_bundle_s".into(), serde_json::json!(dump_s));
        out.insert("measured_s".into(), serde_json::json!(secs));
        Ok(serde_json::Value::Object(out))
    })();
    // SAFETY: signalling our own child.
    unsafe { libc_kill(a.id() as i32, 15) };
    let _ = a.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

pub fn run(smoke: bool, bin: &Path) -> Result<()> {
    if euid() != 0 {
        bail!("cargo xtask bench needs root (it loads eBPF probes and reads BPF run statistics)");
    }
    std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1").context("enabling kernel.bpf_stats_enabled")?;
    let tmp = root().join("bench/tmp");
    std::fs::create_dir_all(&tmp)?;
    let (reps, iters) = if smoke { (1, 40) } else { (5, 1500) };
    let have_bpftrace = Command::new("bpftrace").arg("--version").output().is_ok_and(|o| o.status.success());
    let mut kinds = vec!["none", "floor", "nantrace", "nantrace-tracefs", "nantrace-outside"];
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
    let col = |k: &str, f: &str| -> Vec<f64> { runs.iter().filter(|r| r["tracer"] == k).filter_map(|r| r[f].as_f64()).collect() };
    let mut summary = serde_json::Map::new();
    for k in &kinds {
        summary.insert(k.to_string(), serde_json::json!({
            "elapsed_s": stats(&mut col(k, "elapsed_s")),
            "kernel_ns_per_event": stats(&mut col(k, "kernel_ns_per_event")),
            "tracer_cpu_s_per_s": stats(&mut col(k, "tracer_cpu_s_per_s")),
        }));
    }
    let med = |k: &str| summary.get(k).and_then(|v| v["elapsed_s"]["median"].as_f64());
    let ratio = |a: &str, b: &str| match (med(a), med(b)) { (Some(x), Some(y)) if y > 0.0 => serde_json::json!(x / y), _ => serde_json::Value::Null };
    let mut startup_n = Vec::new();
    let mut startup_b = Vec::new();
    for _ in 0..reps.min(3) {
        if let Ok(s) = startup("nantrace", bin, &tmp) { startup_n.push(s) }
        if have_bpftrace {
            if let Ok(s) = startup("bpftrace", bin, &tmp) { startup_b.push(s) }
        }
    }
    let storm = if smoke { 2_000 } else { 50_000 };
    let tp = throughput(bin, storm, None, &tmp).unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let tp_small = throughput(bin, storm, Some("4096"), &tmp).unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let mem = internal(bin, &["memory", "--n", if smoke { "20000" } else { "600000" }])?;
    let drain = internal(bin, &["drain", "--n", if smoke { "100000" } else { "5000000" }])?;
    let mut dumps = Vec::new();
    for _ in 0..reps.min(3) {
        dumps.push(internal(bin, &["dump", "--n", if smoke { "2000" } else { "100000" }, "--dir", tmp.to_str().unwrap()])?["seconds"].as_f64().unwrap_or(0.0));
    }
    let idle = idle_cpu(bin, if smoke { 2.0 } else { 10.0 }).ok();
    let micro = microcost(bin, if smoke { 20_000 } else { 1_000_000 }, reps.min(3)).unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let synth = synthetic(bin, if smoke { 100_000 } else { 500_000 }, if smoke { 1.0 } else { 10.0 }).unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let agent = agent(bin, if smoke { 1.0 } else { 10.0 }, &tmp).unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let flood = flood_dump(bin, if smoke { 200_000 } else { 8_000_000 }, if smoke { 16 } else { 64 }, &tmp).unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }));
    let uname = Command::new("uname").arg("-r").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let date = Command::new("date").arg("-u").arg("+%Y-%m-%d %H:%M UTC").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
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
    });
    // The previous run, for the tables' "before" column.
    let prev_path = std::env::var_os("NANTRACE_BENCH_PREVIOUS").map_or_else(|| root().join("bench/results.json"), std::path::PathBuf::from);
    let previous: serde_json::Value = std::fs::read_to_string(prev_path).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&tmp);
    if smoke {
        // Smoke mode proves the benchmark runs; it does not overwrite the recorded numbers.
        eprintln!("xtask bench --smoke: ok\n{}", serde_json::to_string_pretty(&results["ratios"])?);
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
        eprintln!("xtask bench --smoke: synthetic {}", results["synthetic_throughput"]);
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
    std::fs::write(root().join("bench/results.json"), serde_json::to_string_pretty(&results)?)?;
    std::fs::write(root().join("docs/performance.md"), markdown(&results, &previous))?;
    eprintln!("xtask bench: wrote bench/results.json and docs/performance.md");
    Ok(())
}

/// `cargo xtask bench --render [--previous FILE]`: docs/performance.md from bench/results.json.
pub fn render(previous: Option<&Path>) -> Result<()> {
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root().join("bench/results.json")).context("bench/results.json")?)?;
    let prev: serde_json::Value = previous.map(std::fs::read_to_string).transpose()?.map(|t| serde_json::from_str(&t)).transpose()?.unwrap_or_default();
    std::fs::write(root().join("docs/performance.md"), markdown(&r, &prev))?;
    eprintln!("xtask bench: wrote docs/performance.md from bench/results.json");
    Ok(())
}

fn f(v: &serde_json::Value, scale: f64, unit: &str) -> String {
    match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
        (Some(m), Some(a), Some(b)) => format!("{:.3}{unit} ({:.3}–{:.3})", m * scale, a * scale, b * scale),
        _ => "n/a".into(),
    }
}

/// `bench-internal microcost`, `reps` times: median ns/run of each building block.
fn microcost(bin: &Path, n: u64, reps: usize) -> Result<serde_json::Value> {
    let mut by: std::collections::BTreeMap<String, (String, Vec<f64>)> = std::collections::BTreeMap::new();
    let mut order = Vec::new();
    for _ in 0..reps {
        for row in internal(bin, &["microcost", "--n", &n.to_string()])?.as_array().cloned().unwrap_or_default() {
            let p = row["program"].as_str().unwrap_or("?").to_string();
            if !order.contains(&p) {
                order.push(p.clone());
            }
            let e = by.entry(p).or_insert_with(|| (row["what"].as_str().unwrap_or("").to_string(), Vec::new()));
            e.1.extend(row["ns_per_run"].as_f64());
        }
    }
    let rows: Vec<serde_json::Value> = order
        .iter()
        .filter_map(|p| by.get_mut(p).map(|(what, v)| serde_json::json!({ "program": p, "what": what, "ns_per_run": stats(v) })))
        .collect();
    Ok(serde_json::json!({ "calls": n, "reps": reps, "rows": rows }))
}

/// `bench-internal synth`: the synthetic generator through the real ring, reader and recorder.
fn synthetic(bin: &Path, rate: u64, secs: f64) -> Result<serde_json::Value> {
    internal(bin, &["synth", "--rate", &rate.to_string(), "--seconds", &secs.to_string(), "--burst", "32", "--threads", "2"])
}

/// One row of the per-program table: a nantrace program, its floor, the path it is on, and
/// the names to compare with: bpftrace's program on the same tracepoint, and the program that
/// held this tracepoint in the "before" run (see `nantrace/src/probes/mod.rs`, PROBES).
struct Row {
    prog: &'static str,
    floor: &'static str,
    path: &'static str,
    bpftrace: Option<&'static str>,
    before: &'static str,
}

const fn row(prog: &'static str, floor: &'static str, path: &'static str, bpftrace: Option<&'static str>, before: &'static str) -> Row {
    Row { prog, floor, path, bpftrace, before }
}

const ROWS: &[Row] = &[
    row("printk_console", "floor_printk", "tracefs", Some("console"), "printk_console"),
    row("oom_mark_victim", "floor_oom", "tracefs", None, "oom_mark_victim"),
    row("blk_issue_btf", "floor_issue_btf", "btf", Some("block_rq_issue"), "block_rq_issue"),
    row("block_rq_issue", "floor_blk_issue", "tracefs", Some("block_rq_issue"), "block_rq_issue"),
    row("blk_done_btf", "floor_done_btf", "btf", Some("block_rq_comple"), "block_rq_done"),
    row("block_rq_done", "floor_blk_done", "tracefs", Some("block_rq_comple"), "block_rq_done"),
    row("tcp_retransmit", "floor_tcp", "tracefs", None, "tcp_retransmit"),
    row("fork_btf", "floor_fork_btf", "btf", Some("sched_process_f"), "sched_fork"),
    row("sched_fork", "floor_fork", "tracefs", Some("sched_process_f"), "sched_fork"),
    row("task_newtask", "floor_newtask", "tracefs", None, "task_newtask"),
    row("sched_exec", "floor_exec", "tracefs", None, "sched_exec"),
    row("sched_exit", "floor_exit", "tracefs", None, "sched_exit"),
    row("exit_group", "floor_exit_grp", "tracefs", Some("sys_enter_exit_"), "exit_group"),
    row("signal_btf", "floor_sig_btf", "btf", Some("signal_generate"), "signal_generate"),
    row("signal_generate", "floor_signal", "tracefs", Some("signal_generate"), "signal_generate"),
];

/// Median ns/run of one program (by name, before `#id`) over all runs of one tracer.
fn prog_ns(r: &serde_json::Value, tracer: &str, name: &str) -> Option<f64> {
    let mut v: Vec<f64> = r["runs"].as_array()?.iter().filter(|x| x["tracer"] == tracer).filter_map(|x| x["programs"].as_object()).flat_map(|m| m.iter().filter(|(k, _)| k.split('#').next() == Some(name)).filter_map(|(_, p)| p["ns_per_run"].as_f64()).collect::<Vec<_>>()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn markdown(r: &serde_json::Value, prev: &serde_json::Value) -> String {
    let w = &r["workload"];
    let mut s = format!(
        "# Performance\n\nMeasured by `sudo cargo xtask bench` on {} — kernel {}, {} CPUs (the project's 2-core VM).\nMedians over {} repetitions, (min–max) in brackets. The raw numbers are in `bench/results.json`.\n\n",
        r["date"].as_str().unwrap_or("?"), r["kernel"].as_str().unwrap_or("?"), r["cpus"], r["reps"]
    );
    s.push_str(&format!("## Workload slowdown\n\nThe fixed workload (`nantrace bench-internal workload --n {}`): per iteration one 4 KiB O_DIRECT write + fdatasync, one fork/exec/exit of /bin/true, one TCP round trip over loopback, and a kernel log line every 10 iterations. Tracers: nantrace `attach --pid` (all probes, flight recorder, collectors at 1 s) on its default path (BTF programs for the block pair and fork), the same on the tracefs fallback (`nantrace-tracefs`), the same watching an idle process instead of the workload (`nantrace-outside`: the workload's events are not the job's), and bpftrace running an equivalent script (same tracepoints and fields, `xtask/src/bench.rs`).\n\n| tracer | workload time s | tracer CPU s/s | kernel ns per program run |\n|---|---|---|---|\n", r["workload_iterations"]));
    for k in ["none", "floor", "nantrace", "nantrace-tracefs", "nantrace-outside", "bpftrace"] {
        if w.get(k).is_some() {
            s.push_str(&format!("| {k} | {} | {} | {} |\n", f(&w[k]["elapsed_s"], 1.0, ""), f(&w[k]["tracer_cpu_s_per_s"], 1.0, ""), f(&w[k]["kernel_ns_per_event"], 1.0, "")));
        }
    }
    let ra = &r["ratios"];
    s.push_str(&format!("\nRatios of medians: nantrace/none = {}, bpftrace/none = {}, nantrace/bpftrace = {}.\n\n", ra["nantrace_vs_none"], ra["bpftrace_vs_none"], ra["nantrace_vs_bpftrace"]));
    s.push_str("### Per-program kernel cost, above the floor\n\nMedians over the repetitions (`kernel.bpf_stats_enabled=1`). The floor is a do-nothing program of the same kind on the same tracepoint, run under the same workload (`floor_*` in `nantrace-ebpf/src/bench.rs`): what any BPF program there costs (dispatch and run accounting). Path `btf`: the `tp_btf` programs nantrace runs by default where the kernel has BTF (`nantrace-ebpf/src/btf.rs`); `tracefs`: the fallback, measured in a separate run with `NANTRACE_PROBE_PATH=tracefs` (programs on both paths are shown from the default run). \"Outside the job\": the same programs while nantrace watches an idle process, so every event of the workload is someone else's (only the membership check should run). bpftrace's equivalents are listed beside, with the same floor subtracted. The \"before\" column is the run these results replaced (`--previous FILE`), for the program that held the tracepoint then; it ran on another instance of the VM, so compare against bpftrace in the same run rather than absolute nanoseconds across runs.\n\n| program | path | runs/iteration | ns/run | floor | above floor | outside the job, above floor | bpftrace above floor | before: ns/run | before: bpftrace ns/run |\n|---|---|---|---|---|---|---|---|---|---|\n");
    let iters = r["workload_iterations"].as_f64().unwrap_or(1.0);
    let fmt = |v: Option<f64>| v.map_or("n/a".to_string(), |x| format!("{x:.0}"));
    for row in ROWS {
        // A program that runs on both paths is read from the default run.
        let tracer = if prog_ns(r, "nantrace", row.prog).is_some() { "nantrace" } else { "nantrace-tracefs" };
        let Some(ns) = prog_ns(r, tracer, row.prog) else { continue };
        let fl = prog_ns(r, "floor", row.floor);
        let outside_tracer = if tracer == "nantrace" { "nantrace-outside" } else { "" };
        let outside = prog_ns(r, outside_tracer, row.prog);
        let runs = r["runs"].as_array().and_then(|a| a.iter().rev().find(|x| x["tracer"] == tracer)).and_then(|x| x["programs"].as_object()).and_then(|m| m.iter().find(|(k, _)| k.split('#').next() == Some(row.prog)).map(|(_, p)| p["runs"].as_f64().unwrap_or(0.0)));
        let bt = row.bpftrace.and_then(|b| prog_ns(r, "bpftrace", b));
        let before = prog_ns(prev, "nantrace", row.before);
        let bt_before = row.bpftrace.and_then(|b| prog_ns(prev, "bpftrace", b));
        let above = |v: Option<f64>| match (v, fl) { (Some(x), Some(f)) => Some(x - f), _ => None };
        s.push_str(&format!(
            "| {} | {} | {} | {ns:.0} | {} | {} | {} | {} | {} | {} |\n",
            row.prog, row.path, runs.map_or("?".into(), |x| format!("{:.1}", x / iters)), fmt(fl), fmt(above(Some(ns))), fmt(above(outside)), fmt(above(bt)), fmt(before), fmt(bt_before)
        ));
    }
    let mc = &r["microcost"];
    if let Some(rows) = mc["rows"].as_array() {
        s.push_str(&format!("\n### What the building blocks cost here\n\n`bench-internal microcost`: each block alone in a program on `syscalls:sys_enter_getppid` while one process calls getppid {} times (median of {} runs; `mc_*` in `nantrace-ebpf/src/bench.rs`). A hot loop: caches and branch predictors are warm, so a real program, which runs once per I/O or fork among other work, pays more for the same blocks.\n\n| block | ns/run | above the empty program |\n|---|---|---|\n", mc["calls"], mc["reps"]));
        let empty = rows.iter().find(|x| x["program"] == "mc_empty").and_then(|x| x["ns_per_run"]["median"].as_f64());
        for x in rows {
            let ns = x["ns_per_run"]["median"].as_f64();
            let above = match (ns, empty) { (Some(a), Some(e)) if x["program"] != "mc_empty" => format!("{:.0}", a - e), _ => "".into() };
            s.push_str(&format!("| {} | {} | {above} |\n", x["what"].as_str().unwrap_or("?"), fmt(ns)));
        }
    }
    s.push_str(&format!("\n## Startup (launch to first event delivered)\n\n| tracer | seconds |\n|---|---|\n| nantrace | {} |\n| bpftrace | {} |\n", f(&r["startup_s"]["nantrace"], 1.0, ""), f(&r["startup_s"]["bpftrace"], 1.0, "")));
    let tp = &r["throughput"];
    let tps = &r["throughput_tiny_ring"];
    s.push_str(&format!("\n## Throughput and loss\n\nA fork storm of the watched job (`bench-internal forkstorm`, fork + _exit in a loop), 2 events per fork.\n\n| ring | offered ev/s | delivered ev/s | delivered / expected | drops reported |\n|---|---|---|---|---|\n| {} | {:.0} | {:.0} | {} / {} | {} |\n| {} | {:.0} | {:.0} | {} / {} | {} |\n",
        tp["ring_bytes"], tp["offered_events_per_s"].as_f64().unwrap_or(0.0), tp["delivered_events_per_s"].as_f64().unwrap_or(0.0), tp["delivered_events"], tp["expected_events"], tp["kernel_drops_reported"],
        tps["ring_bytes"], tps["offered_events_per_s"].as_f64().unwrap_or(0.0), tps["delivered_events_per_s"].as_f64().unwrap_or(0.0), tps["delivered_events"], tps["expected_events"], tps["kernel_drops_reported"]));
    let sy = &r["synthetic_throughput"];
    s.push_str(&format!("\n### Synthetic: {:.0} records/s offered for {:.0} s (SYNTHETIC)\n\nThe fork storm cannot offer more than ~16 k events/s on this VM. `bench_emit` (`nantrace-ebpf/src/bench.rs`, attached only by `bench-internal synth`) writes 32 fork-shaped records into the same ring buffer per getppid() of a generator process (2 threads, paced per 0.5 ms); the same reader, decoder and flight recorder as `run` and the agent consume them. Default ring ({} bytes).\n\n| offered | delivered | lost | drops reported | userspace CPU s per million records |\n|---|---|---|---|---|\n| {} ({:.0}/s) | {} ({:.0}/s) | {} | {} | {:.3} |\n",
        sy["offered_per_s"].as_f64().unwrap_or(0.0), sy["seconds"].as_f64().unwrap_or(0.0), sy["ring_bytes"], sy["offered"], sy["offered_per_s"].as_f64().unwrap_or(0.0), sy["delivered"], sy["delivered_per_s"].as_f64().unwrap_or(0.0), sy["lost"], sy["kernel_drops_reported"], sy["userspace_cpu_s_per_million"].as_f64().unwrap_or(f64::NAN)));
    s.push_str(&format!("\nUserspace drain (decode + recorder push of recorded ring-buffer records, `bench-internal drain`): {:.0} events/s.\n", r["userspace_drain"]["events_per_s"].as_f64().unwrap_or(0.0)));
    let m = &r["memory"];
    s.push_str(&format!("\n## Memory\n\n{} events pushed at a simulated 1 k events/s (10-minute window; timestamps simulated, not waited for) with the mix of kernel events nantrace records: {:.1} bytes per event in the recorder ({} bytes of `Event` inline + heap for strings), RSS {} KiB after the load (started at {} KiB).\n",
        m["events"], m["bytes_per_event"].as_f64().unwrap_or(0.0), m["event_struct_bytes"], m["rss_kb_after"], m["rss_kb_before"]));
    s.push_str(&format!("\nBefore: {:.1} bytes per event (that run did not count the queue's capacity: see docs/performance-notes.md), RSS {} KiB.\n", prev["memory"]["bytes_per_event"].as_f64().unwrap_or(f64::NAN), prev["memory"]["rss_kb_after"]));
    s.push_str(&format!("\n## Dump latency\n\nTrigger to bundle on disk with 100 000 events in the window (timeline, app/kernel logs, report, trace, HTML): {} s (before: {} s).\n", f(&r["dump_s_100k"], 1.0, ""), f(&prev["dump_s_100k"], 1.0, "")));
    let fl = &r["flood_dump"];
    s.push_str(&format!("\n## A log flood, then the dump (redteam 2.8, 7.3, 7.4)\n\n`nantrace run --no-probes --mem-cap-mb {}` of a job that prints {} lines as fast as `yes | head` can, then a NaN: the job took {} s (alone: {} s); nantrace's peak RSS {} MiB = cap + {} MiB (target: cap + 64 MiB); {} bytes of output passed through without the full scan (only their lines with a NaN or failure word were read; counted in the bundle); bundle written: {}.\n",
        fl["cap_mib"], fl["lines"], fl["job_s_under_nantrace"], fl["job_s_alone"], fl["peak_rss_mib"], fl["over_cap_mib"], fl["log_bytes_not_scanned"], fl["bundle"]));
    s.push_str(&format!("\n## CPU at idle\n\n`nantrace watch` on an idle machine: {} CPU-seconds per second.\n", r["idle_cpu_s_per_s"]));
    let ag = &r["agent"];
    s.push_str("\n## The node agent\n\n`nantrace agent` (all probes, collectors at 1 s, /proc scanned every 500 ms), with jobs that print a line every 0.5 s to a log file the agent follows:\n\n| watched jobs | agent CPU s/s | agent RSS MiB |\n|---|---|---|\n");
    for n in [0, 1, 4] {
        let j = &ag[format!("jobs{n}")];
        s.push_str(&format!("| {n} | {:.4} | {:.1} |\n", j["cpu_s_per_s"].as_f64().unwrap_or(f64::NAN), j["rss_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0));
    }
    s.push_str(&format!("\nJob start to listed by `nantrace ctl jobs`: {} s (5 jobs). `ctl dump` to bundle on disk (post-window 0): {:.2} s.\n", f(&ag["start_to_watched_s"], 1.0, ""), ag["trigger_to_bundle_s"].as_f64().unwrap_or(f64::NAN)));
    s.push_str("\n## Against the targets\n\nSee the section written by hand below the generated tables (docs/performance-notes.md).\n");
    s
}
