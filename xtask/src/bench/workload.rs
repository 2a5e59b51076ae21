//! The fixed workload under each tracer (none, the do-nothing floor, nantrace on each path and
//! watching another process, bpftrace): its time, the tracer's CPU, each BPF program's cost.
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use super::{cpu_ticks, internal, json_line, stats, wait_for_line, BPFTRACE};

/// The workload `reps` times under each tracer in `kinds`; a run that fails is kept with its
/// error.
pub(super) fn runs(
    kinds: &[&'static str],
    bin: &Path,
    reps: usize,
    iters: u32,
    tmp: &Path,
) -> Vec<serde_json::Value> {
    let mut runs = Vec::new();
    for rep in 0..reps {
        for k in kinds {
            eprintln!("xtask bench: workload rep {}/{reps} under {k}", rep + 1);
            match run_once(k, bin, iters, tmp) {
                Ok(r) => runs.push(r),
                Err(e) => runs.push(serde_json::json!({ "tracer": k, "error": format!("{e:#}") })),
            }
        }
    }
    runs
}

/// Each tracer's medians (min, max, n) over its runs, and the ratios of the workload times'
/// medians.
pub(super) fn summary(
    kinds: &[&str],
    runs: &[serde_json::Value],
) -> (
    serde_json::Map<String, serde_json::Value>,
    serde_json::Value,
) {
    let col = |k: &str, f: &str| -> Vec<f64> {
        runs.iter()
            .filter(|r| r["tracer"] == k)
            .filter_map(|r| r[f].as_f64())
            .collect()
    };
    let mut summary = serde_json::Map::new();
    for k in kinds {
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
    let ratios = serde_json::json!({ "nantrace_vs_none": ratio("nantrace", "none"), "bpftrace_vs_none": ratio("bpftrace", "none"), "nantrace_vs_bpftrace": ratio("nantrace", "bpftrace") });
    (summary, ratios)
}

/// One workload run under one tracer: elapsed, tracer CPU, per-program kernel cost.
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
    let cost = KernelCost::between(&progs0, &progs1);
    if let Some(t) = tracer {
        t.stop(tmp)?;
    }
    let elapsed = w["elapsed_s"].as_f64().unwrap_or(0.0);
    let tps = 100.0;
    Ok(serde_json::json!({
        "tracer": kind,
        "elapsed_s": elapsed,
        "tracer_cpu_s_per_s": match (cpu0, cpu1) { (Some(a), Some(b)) if elapsed > 0.0 => serde_json::json!((b - a) as f64 / tps / elapsed), _ => serde_json::Value::Null },
        "kernel_ns_per_event": if cost.runs > 0 { serde_json::json!(cost.ns as f64 / cost.runs as f64) } else { serde_json::Value::Null },
        "kernel_runs": cost.runs,
        "programs": cost.per_prog,
    }))
}

/// What the tracer's BPF programs cost in the kernel between two reads of their statistics.
#[derive(Default)]
struct KernelCost {
    /// `NAME#ID` -> ns per run and runs, of each program that ran.
    per_prog: serde_json::Map<String, serde_json::Value>,
    ns: u64,
    runs: u64,
}

impl KernelCost {
    fn between(progs0: &[serde_json::Value], progs1: &[serde_json::Value]) -> Self {
        let mut cost = Self::default();
        for p0 in progs0 {
            if let Some(p1) = progs1.iter().find(|p| p["id"] == p0["id"]) {
                let dns = p1["run_time_ns"]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(p0["run_time_ns"].as_u64().unwrap_or(0));
                let dc = p1["run_cnt"]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(p0["run_cnt"].as_u64().unwrap_or(0));
                cost.ns += dns;
                cost.runs += dc;
                if dc > 0 {
                    let name = p0["name"].as_str().unwrap_or("?").to_string();
                    cost.per_prog.insert(
                        format!("{name}#{}", p0["id"]),
                        serde_json::json!({ "ns_per_run": dns as f64 / dc as f64, "runs": dc }),
                    );
                }
            }
        }
        cost
    }
}

/// A tracer running against a workload that waits for its go file.
struct Tracer {
    child: Child,
    kind: &'static str,
    /// `nantrace-outside`: the idle process it watches instead of the workload.
    decoy: Option<Child>,
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

impl Tracer {
    /// Stop it: SIGINT to bpftrace, the floor's go file removed; then up to 20 s for it to
    /// exit before it is killed, and its decoy with it.
    fn stop(mut self, tmp: &Path) -> Result<()> {
        if self.kind == "bpftrace" {
            let _ = Command::new("kill")
                .args(["-INT", &self.child.id().to_string()])
                .status();
        }
        if self.kind == "floor" {
            let _ = std::fs::remove_file(tmp.join("go-floor"));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(mut d) = self.decoy.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        Ok(())
    }
}
