//! `cargo xtask bench`: what nantrace costs the job it watches, next to no tracing and an
//! equivalent bpftrace script, on this machine. Writes bench/results.json and
//! docs/performance.md. Not a test: no timing assertions; `--smoke` only proves it runs.
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

use crate::root;

mod agent;
mod blocks;
mod flood;
pub mod jobs;
mod render;
mod watch;
mod workload;

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

/// How much each measurement does: tiny with `--smoke` (a few seconds, proves it runs), else
/// the sizes of the recorded numbers.
struct Sizes {
    /// Workload runs under each tracer; startup, dump and building-block runs: at most 3.
    reps: usize,
    /// Workload iterations per run.
    iters: u32,
    /// Forks of the fork storm.
    storm: u64,
    memory_events: &'static str,
    drain_events: &'static str,
    dump_events: &'static str,
    idle_s: f64,
    microcost_calls: u64,
    membership_iters: u64,
    synth_rate: u64,
    synth_s: f64,
    agent_s: f64,
    flood_lines: u64,
    flood_cap_mib: u64,
}

impl Sizes {
    fn new(smoke: bool) -> Self {
        let (reps, iters) = if smoke { (1, 40) } else { (5, 1500) };
        Sizes {
            reps,
            iters,
            storm: if smoke { 2_000 } else { 50_000 },
            memory_events: if smoke { "20000" } else { "600000" },
            drain_events: if smoke { "100000" } else { "5000000" },
            dump_events: if smoke { "2000" } else { "100000" },
            idle_s: if smoke { 2.0 } else { 10.0 },
            microcost_calls: if smoke { 20_000 } else { 1_000_000 },
            membership_iters: if smoke { 20 } else { 1500 },
            synth_rate: if smoke { 100_000 } else { 500_000 },
            synth_s: if smoke { 1.0 } else { 10.0 },
            agent_s: if smoke { 1.0 } else { 10.0 },
            flood_lines: if smoke { 200_000 } else { 8_000_000 },
            flood_cap_mib: if smoke { 16 } else { 64 },
        }
    }
}

/// A measurement's result, or its error in its place.
fn or_error(r: Result<serde_json::Value>) -> serde_json::Value {
    r.unwrap_or_else(|e| serde_json::json!({ "error": format!("{e:#}") }))
}

pub fn run(smoke: bool, bin: &Path) -> Result<()> {
    if euid() != 0 {
        bail!("cargo xtask bench needs root (it loads eBPF probes and reads BPF run statistics)");
    }
    std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1")
        .context("enabling kernel.bpf_stats_enabled")?;
    let tmp = root().join("bench/tmp");
    std::fs::create_dir_all(&tmp)?;
    let results = measure(smoke, bin, &tmp)?;
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
        return smoke_verdict(&results);
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

/// Every measurement, in this order: what bench/results.json holds.
fn measure(smoke: bool, bin: &Path, tmp: &Path) -> Result<serde_json::Value> {
    let z = Sizes::new(smoke);
    let (reps, iters) = (z.reps, z.iters);
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
    let runs = workload::runs(&kinds, bin, reps, iters, tmp);
    let (summary, ratios) = workload::summary(&kinds, &runs);
    let (mut startup_n, mut startup_b) = watch::startups(bin, reps.min(3), have_bpftrace, tmp);
    let tp = or_error(watch::throughput(bin, z.storm, None, tmp));
    let tp_small = or_error(watch::throughput(bin, z.storm, Some("4096"), tmp));
    let mem = internal(bin, &["memory", "--n", z.memory_events])?;
    let drain = internal(bin, &["drain", "--n", z.drain_events])?;
    let mut dumps = Vec::new();
    for _ in 0..reps.min(3) {
        dumps.push(
            internal(
                bin,
                &["dump", "--n", z.dump_events, "--dir", tmp.to_str().unwrap()],
            )?["seconds"]
                .as_f64()
                .unwrap_or(0.0),
        );
    }
    let idle = watch::idle_cpu(bin, z.idle_s).ok();
    let micro = or_error(blocks::microcost(bin, z.microcost_calls, reps.min(3)));
    let member = or_error(blocks::membership(bin, z.membership_iters, reps, tmp));
    let synth = or_error(synthetic(bin, z.synth_rate, z.synth_s));
    let agent = or_error(agent::agent(bin, z.agent_s, tmp));
    let flood = or_error(flood::flood_dump(bin, z.flood_lines, z.flood_cap_mib, tmp));
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
    Ok(serde_json::json!({
        "date": date, "kernel": uname, "cpus": cpus, "smoke": smoke, "reps": reps, "workload_iterations": iters,
        "workload": summary,
        "ratios": ratios,
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
    }))
}

/// `--smoke`: fails when one of nantrace's runs failed (bpftrace's: a warning), prints the
/// ratios, the synthetic run and the agent's.
fn smoke_verdict(results: &serde_json::Value) -> Result<()> {
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
