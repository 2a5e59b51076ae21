//! `cargo xtask bench-jobs [--smoke]`: the job report (`nantrace report <job incident dir>`)
//! at scale and its accuracy on simulated multi-node jobs.
//!
//! Scale: one job of N nodes (64, 256, 1024), each node's bundle shaped as the agent writes
//! it (timeline.json one event per line: five minutes of GPU and system samples, rank 0's loss
//! lines and its NaN), an Xid 79 on one node: wall time and peak RSS of `nantrace report
//! --json`, and whether it named that node.
//!
//! Accuracy: jobs of 8 to 48 nodes with one cause planted on one random node (an Xid 79, a
//! GPU 25 °C hotter than its peers, one at half power, 40 TCP retransmits to a peer, 60
//! corrected ECC errors) or none (a clean numeric NaN; the other ranks' NCCL errors after
//! rank 0 stopped, which are consequences): precision and recall of the node the report
//! names, as Minder reports them (precision 0.904, F1 0.893).
use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Cause {
    Xid,
    HotGpu,
    LowPower,
    Retransmits,
    Ecc,
    /// No cause: a NaN of the model's own.
    Clean,
    /// No cause on the machine: the other ranks' communicator errors after rank 0's NaN.
    Consequences,
    /// A hung collective (the scale run only): every rank of every node prints torch's
    /// watchdog lines for collective 42; one rank (on the culprit) never enqueued it.
    Hang,
}

impl Cause {
    const ALL: [Cause; 7] = [
        Cause::Xid,
        Cause::HotGpu,
        Cause::LowPower,
        Cause::Retransmits,
        Cause::Ecc,
        Cause::Clean,
        Cause::Consequences,
    ];

    fn has_culprit(self) -> bool {
        !matches!(self, Cause::Clean | Cause::Consequences)
    }

    fn name(self) -> &'static str {
        match self {
            Cause::Xid => "xid79",
            Cause::HotGpu => "hot_gpu",
            Cause::LowPower => "low_power",
            Cause::Retransmits => "retransmits",
            Cause::Ecc => "ecc_corrected",
            Cause::Clean => "clean",
            Cause::Consequences => "consequences_only",
            Cause::Hang => "hang",
        }
    }
}

/// A small deterministic generator (the same jobs every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// RFC 3339 for `offset_s` around the job's reference, 2026-12-01T10:15:00Z.
fn at(offset_s: f64) -> String {
    let t = 900.0 + offset_s; // seconds after 10:00:00
    let whole = t.floor();
    let ns = ((t - whole) * 1e9) as u64;
    let s = whole as u64;
    format!(
        "2026-12-01T{:02}:{:02}:{:02}.{ns:09}Z",
        10 + s / 3600,
        s % 3600 / 60,
        s % 60
    )
}

fn host(i: usize) -> String {
    format!("bn{i:04}")
}

/// The shape of a node's bundle: its GPUs, how often the collectors sample, the window.
#[derive(Clone, Copy)]
struct Shape {
    gpus: u32,
    period_s: f64,
    window_s: f64,
}

/// What the agent's collectors write over the default window on a node of 8 GPUs: a GPU
/// sample per GPU, a system and a network sample, each second, for 600 s.
const REAL: Shape = Shape {
    gpus: 8,
    period_s: 1.0,
    window_s: 600.0,
};

/// The accuracy jobs: 8 GPUs, the same window, a sample each 5 s (the causes are the same;
/// 70 jobs of up to 48 nodes at the full rate would take 8 GB to write).
const LIGHT: Shape = Shape {
    gpus: 8,
    period_s: 5.0,
    window_s: 600.0,
};

/// The GPU of a node the planted cause is on.
const FAULTY_GPU: u32 = 5;

fn pci(g: u32) -> String {
    format!("0000:{:02x}:00.0", 0x18 + g * 0x10)
}

/// One node's sample events, each a line of the timeline, as the collectors write them.
fn samples(ev: &mut Vec<(f64, Value)>, shape: Shape, cause: Option<Cause>, rng: &mut Lcg) {
    let jitter = |rng: &mut Lcg| (rng.below(1000) as f64) / 1000.0 * shape.period_s.min(1.0) * 0.5;
    let ticks = (shape.window_s / shape.period_s) as u32;
    for k in 0..ticks {
        let t = -shape.window_s + 5.0 + f64::from(k) * shape.period_s + jitter(rng);
        for g in 0..shape.gpus {
            let (mut temp, mut power, mut ecc) = (
                61.0 + (rng.below(5) as f64),
                650.0 + (rng.below(20) as f64),
                0u64,
            );
            if g == FAULTY_GPU {
                match cause {
                    Some(Cause::HotGpu) => temp += 25.0,
                    Some(Cause::LowPower) => power *= 0.45,
                    Some(Cause::Ecc) if t > -100.0 => ecc = ((t + 100.0) * 0.6) as u64,
                    _ => {}
                }
            }
            ev.push((t + f64::from(g) * 0.001, json!({ "source": "gpu", "gpu": g, "pci": pci(g), "temp_c": temp, "power_w": power, "power_limit_w": 700.0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "throttle": [], "util_gpu_pct": 100, "util_mem_pct": 41, "mem_used_mib": 61_440 + g, "mem_total_mib": 143_771, "ecc_corrected_volatile": ecc, "ecc_uncorrected_volatile": 0, "pcie_replay": 0, "comm": "", "job": false, "pid": 0, "tid": 0 })));
        }
        ev.push((t + 0.3, json!({ "source": "system", "comm": "", "job": false, "pid": 0, "tid": 0, "load1": 12.5, "mem_available_kb": 1_800_000_000u64, "mem_total_kb": 2_113_000_000u64, "mem_used_kb": 300_000_000u64, "swap_used_kb": 0, "psi_cpu_some_avg10": 1.5, "psi_io_some_avg10": 0.0, "psi_memory_some_avg10": 0.0 })));
        ev.push((t + 0.4, json!({ "source": "net", "comm": "", "job": false, "pid": 0, "tid": 0, "tcp_out_segs_per_s": 81_000.0, "tcp_retrans_per_s": 0.0 })));
    }
}

/// A hang job's directory (`scale-hang-N`): every node of it prints the hang's lines.
fn hang_job(dir: &Path) -> bool {
    dir.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("scale-hang-"))
}

/// torch's watchdog lines of a node's ranks for a hang in collective 42 (as recorded from
/// torch 2.x, docs/hangs.md), classified as the session does; on the culprit, the rank of
/// the faulty GPU never enqueued 42 and printed only its counters.
fn hang_lines(ev: &mut Vec<(f64, Value)>, (i, gpus): (usize, u32), culprit: bool, rng: &mut Lcg) {
    let fault = |kind: &str, rank: u32| json!({ "family": "hang", "kind": kind, "what": "collective timed out (NCCL watchdog)", "code": "ALLREDUCE SeqNum=42 timeout 600000 ms ran 600035 ms", "generic": false, "fatal": true, "rank": rank, "group": 0 });
    for g in 0..gpus {
        let rank = i as u32 * gpus + g;
        let t = -0.5 + (rng.below(200) as f64) / 1000.0;
        let pid = 1000 + g;
        if culprit && g == FAULTY_GPU {
            ev.push((t + 0.8, json!({ "source": "log", "pid": pid, "job": true, "line": format!("[rank{rank}]:[E1202 04:54:04.100 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL work: 41.") })));
            continue;
        }
        ev.push((t, json!({ "source": "log", "pid": pid, "job": true, "line": format!("[rank{rank}]:[E1202 04:54:03.190 ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600035 milliseconds before timing out."), "fault": fault("nccl_watchdog_timeout", rank) })));
        ev.push((t + 0.01, json!({ "source": "log", "pid": pid, "job": true, "line": format!("[rank{rank}]:[E1202 04:54:03.200 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41."), "fault": fault("nccl_watchdog_timeout", rank) })));
    }
}

/// One node's bundle in `dir/<host>/`, as the agent writes it.
fn write_node(
    dir: &Path,
    (i, n): (usize, usize),
    shape: Shape,
    cause: Option<Cause>,
    rng: &mut Lcg,
) -> Result<u64> {
    let name = host(i);
    let d = dir.join(&name);
    std::fs::create_dir_all(&d)?;
    let hang = cause == Some(Cause::Hang) || hang_job(dir);
    let rank0 = i == 0 && !hang;
    let mut ev: Vec<(f64, Value)> = Vec::new();
    let jitter = |rng: &mut Lcg| (rng.below(1000) as f64) / 1000.0;
    samples(&mut ev, shape, cause, rng);
    if rank0 {
        let steps = shape.window_s as u32;
        for s in 0..steps {
            let t = -shape.window_s + f64::from(s);
            ev.push((t, json!({ "source": "log", "pid": 100, "job": true, "line": format!("step {s} | loss {:.3}", 2.5 - f64::from(s) / 600.0), "step": s, "loss": 2.5 - f64::from(s) / 600.0 })));
        }
        ev.push((0.0, json!({ "source": "log", "pid": 100, "job": true, "line": format!("step {steps} | loss nan"), "step": steps, "loss": "NaN", "nonfinite": true })));
    }
    match cause {
        Some(Cause::Xid) => ev.push((-0.4, json!({ "source": "xid", "text": format!("NVRM: Xid (PCI:{}): 79, pid=2214, name=python, GPU has fallen off the bus.", &pci(FAULTY_GPU)[..10]), "class": "xid", "xid": 79, "pci": pci(FAULTY_GPU), "severity": "critical", "implicates": "system", "action": "reboot_node", "meaning": "GPU has fallen off the bus", "pid": 0, "job": false }))),
        Some(Cause::Retransmits) => {
            for r in 0..40u32 {
                ev.push((-20.0 + f64::from(r) * 0.4, json!({ "source": "tcp_retransmit", "daddr": "10.0.0.7", "dport": 29500, "saddr": "10.0.0.9", "sport": 41000, "job": false, "pid": 0 })));
            }
        }
        Some(Cause::Consequences) => ev.push((2.0, json!({ "source": "log", "pid": 100, "job": true, "line": format!("{name}:100:200 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.1<4711> with status=12 opcode=0 len=0 vendor err 129 (Recv)"), "fault": { "family": "network", "code": "ibv status 12", "what": "IB completion error" } }))),
        _ => {}
    }
    if hang {
        hang_lines(&mut ev, (i, shape.gpus), cause == Some(Cause::Hang), rng);
    }
    ev.sort_by(|a, b| a.0.total_cmp(&b.0));
    let nan = rank0;
    let trigger_s = if nan { 0.0 } else { 0.5 + jitter(rng) };
    let identity = if hang {
        json!({ "job": "slurm-4711", "scheduler": { "kind": "slurm", "job_id": "4711" }, "distributed": { "launcher": "torch", "world_size": n as u32 * shape.gpus, "ranks": (0..shape.gpus).map(|g| json!({ "pid": 1000 + g, "rank": i as u32 * shape.gpus + g })).collect::<Vec<_>>() } })
    } else {
        json!({ "job": "slurm-4711", "scheduler": { "kind": "slurm", "job_id": "4711" } })
    };
    let mut text = String::with_capacity(ev.len() * 200);
    text.push_str("{\n");
    let head = [
        ("schema", json!("nantrace.timeline/1")),
        (
            "host",
            json!({ "hostname": name, "boot_id": format!("boot-{name}") }),
        ),
        (
            "clock",
            json!({ "correction_s": 0.0, "uncertainty_s": 0.001 }),
        ),
        (
            "trigger",
            json!({ "kind": if nan { "nan" } else if hang { "job-error" } else { "job-wide" }, "time": at(trigger_s), "mono_ns": 1_000_000_000i64 + (trigger_s * 1e9) as i64, "reason": "" }),
        ),
        (
            "first_nan",
            if nan {
                json!({ "time": at(0.0), "line": format!("step {0} | loss nan", shape.window_s as u32), "step": shape.window_s as u32 })
            } else {
                Value::Null
            },
        ),
        (
            "job",
            json!({ "root_pid": 100, "identity": identity }),
        ),
        ("window", json!({ "pre_s": shape.window_s })),
        (
            "accounting",
            json!({ "probes_attached": ["printk:console", "sched:sched_process_exit", "tcp:tcp_retransmit_skb"], "events": {} }),
        ),
    ];
    for (k, v) in head {
        let _ = writeln!(text, "  {}: {v},", json!(k));
    }
    text.push_str("  \"events\": [\n");
    let last = ev.len().saturating_sub(1);
    for (j, (t, mut e)) in ev.into_iter().enumerate() {
        e["time"] = json!(at(t));
        let _ = writeln!(text, "    {e}{}", if j == last { "" } else { "," });
    }
    text.push_str("  ]\n}\n");
    std::fs::write(d.join("timeline.json"), &text)?;
    let snapshot = json!({
        "gpu": { "available": true, "device_count": shape.gpus, "devices": (0..shape.gpus).map(|g| json!({ "index": g, "pci": pci(g), "uuid": format!("GPU-{name}-{g}"), "compute_processes": [{ "pid": 100 }] })).collect::<Vec<_>>() },
        "scheduler": { "slurm": { "job_id": "4711", "node_list": format!("bn[0000-{:04}]", n - 1), "procid": i.to_string() } },
    });
    let snap = serde_json::to_vec(&snapshot)?;
    std::fs::write(d.join("snapshot.json"), &snap)?;
    Ok((text.len() + snap.len()) as u64)
}

/// The page cache dropped (as root; elsewhere the runs are warm, and said so).
fn drop_caches() {
    let _ = Command::new("sync").status();
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_err() {
        eprintln!("xtask bench-jobs: the page cache could not be dropped (not root): warm runs");
    }
}

/// `nantrace report --summaries DIR`: every node bundle's summary.json written.
fn summarise(bin: &Path, dir: &Path) -> Result<()> {
    let st = Command::new(bin)
        .arg("report")
        .arg("--summaries")
        .arg("--json")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("nantrace report --summaries")?;
    anyhow::ensure!(
        st.success(),
        "nantrace report --summaries {}: {st}",
        dir.display()
    );
    Ok(())
}

/// `nantrace report DIR --json`: (answer, wall s, peak RSS MiB from VmHWM, read every 10 ms).
fn report(bin: &Path, dir: &Path) -> Result<(Value, f64, f64)> {
    let t0 = Instant::now();
    let mut child = Command::new(bin)
        .arg("report")
        .arg(dir)
        .arg("--json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("nantrace report")?;
    let status = format!("/proc/{}/status", child.id());
    let mut hwm_kib = 0u64;
    let out = std::thread::scope(|s| {
        let out = s.spawn(|| {
            let mut o = String::new();
            let _ = std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut o);
            o
        });
        while !out.is_finished() {
            if let Some(v) = std::fs::read_to_string(&status).ok().and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            }) {
                hwm_kib = hwm_kib.max(v);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        out.join().unwrap_or_default()
    });
    let st = child.wait()?;
    let wall = t0.elapsed().as_secs_f64();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    anyhow::ensure!(
        st.success(),
        "nantrace report {}: {st}: {err}",
        dir.display()
    );
    let mut v: Value = serde_json::from_str(&out)
        .with_context(|| format!("nantrace report --json: {out:.200}"))?;
    // "nantrace: N of M nodes read from their summaries ...": not in the JSON.
    let summarised = err
        .lines()
        .find(|l| l.contains("nodes read from their summaries"))
        .and_then(|l| l.strip_prefix("nantrace: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    v["from_summaries"] = json!(summarised);
    Ok((v, wall, hwm_kib as f64 / 1024.0))
}

/// The job report on one job of each size, from timelines and from summaries.
fn scale(smoke: bool, bin: &Path, tmp: &Path, rng: &mut Lcg) -> Result<Vec<Value>> {
    let sizes: &[usize] = if smoke { &[20] } else { &[64, 256, 1024] };
    let mut scale = Vec::new();
    for (&n, hang) in sizes
        .iter()
        .map(|n| (n, false))
        .chain(sizes.iter().map(|n| (n, true)))
    {
        let cause = if hang { Cause::Hang } else { Cause::Xid };
        let dir = tmp.join(format!("scale-{}{n}", if hang { "hang-" } else { "" }));
        let culprit = 1 + rng.below(n as u64 - 1) as usize;
        let t0 = Instant::now();
        let mut bytes = 0;
        for i in 0..n {
            bytes += write_node(
                &dir,
                (i, n),
                REAL,
                (i == culprit).then_some(cause),
                rng,
            )?;
        }
        let gen_s = t0.elapsed().as_secs_f64();
        // Bundles of agents before summaries: every timeline read, one node at a time.
        drop_caches();
        let (v, wall, rss) = report(bin, &dir)?;
        let named = v["node"].as_str().unwrap_or("");
        let what = if hang { "the rank that never enqueued" } else { "the Xid" };
        eprintln!("xtask bench-jobs: {n} nodes{} ({:.0} MiB of bundles, written in {gen_s:.1} s), no summaries: report {wall:.2} s, peak RSS {rss:.0} MiB, named {named:?} ({what} is on {})", if hang { ", a hang" } else { "" }, bytes as f64 / 1048576.0, host(culprit));
        // Each node's summary, as the agent writes it at the dump (`report --summaries`
        // writes the same for bundles without one), then the job report on them.
        let t0 = Instant::now();
        summarise(bin, &dir)?;
        let sum_s = t0.elapsed().as_secs_f64();
        drop_caches();
        let (vs, wall_s, rss_s) = report(bin, &dir)?;
        let named_s = vs["node"].as_str().unwrap_or("");
        anyhow::ensure!(
            vs["verdict"] == v["verdict"],
            "the job report from summaries differs from the one from timelines: {} / {}",
            vs["verdict"],
            v["verdict"]
        );
        eprintln!("xtask bench-jobs: {n} nodes{} with summaries (written in {sum_s:.1} s): report {wall_s:.2} s, peak RSS {rss_s:.0} MiB, named {named_s:?}, {} nodes read from their summaries", if hang { ", a hang," } else { "" }, vs["from_summaries"]);
        scale.push(json!({ "job": cause.name(), "nodes": n, "from_summaries": vs["from_summaries"], "bundle_mib": bytes as f64 / 1048576.0, "report_s": wall, "peak_rss_mib": rss, "summaries_report_s": wall_s, "summaries_peak_rss_mib": rss_s, "named": named, "culprit": host(culprit), "right": named == host(culprit) && named_s == named }));
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(scale)
}

pub fn run(smoke: bool, bin: &Path, out: &Path) -> Result<Value> {
    let tmp = crate::root().join("bench/tmp/jobs");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let mut rng = Lcg(20_261_201);
    let scale = scale(smoke, bin, &tmp, &mut rng)?;
    // Accuracy.
    let jobs = if smoke {
        Cause::ALL.len()
    } else {
        Cause::ALL.len() * 10
    };
    let (mut tp, mut fp, mut fneg) = (0u32, 0u32, 0u32);
    let mut per: std::collections::BTreeMap<&str, (u32, u32)> = std::collections::BTreeMap::new();
    let mut misses = Vec::new();
    for j in 0..jobs {
        let cause = Cause::ALL[j % Cause::ALL.len()];
        let n = if smoke { 4 } else { 8 + rng.below(41) as usize };
        let dir = tmp.join(format!("acc-{j}"));
        let culprit = 1 + rng.below(n as u64 - 1) as usize;
        for i in 0..n {
            write_node(
                &dir,
                (i, n),
                LIGHT,
                (i == culprit).then_some(cause),
                &mut rng,
            )?;
        }
        let (v, _, _) = report(bin, &dir)?;
        let named = v["node"].as_str().map(str::to_string);
        let truth = cause.has_culprit().then(|| host(culprit));
        let right = named == truth;
        match (&named, &truth) {
            (Some(a), Some(b)) if a == b => tp += 1,
            (Some(_), Some(_)) => {
                fp += 1;
                fneg += 1;
            }
            (Some(_), None) => fp += 1,
            (None, Some(_)) => fneg += 1,
            (None, None) => {}
        }
        let e = per.entry(cause.name()).or_default();
        e.0 += u32::from(right);
        e.1 += 1;
        if !right {
            misses.push(json!({ "job": j, "cause": cause.name(), "nodes": n, "truth": truth, "named": named, "verdict": v["verdict"] }));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    let precision = if tp + fp == 0 {
        1.0
    } else {
        f64::from(tp) / f64::from(tp + fp)
    };
    let recall = if tp + fneg == 0 {
        1.0
    } else {
        f64::from(tp) / f64::from(tp + fneg)
    };
    let f1 = if precision + recall == 0.0 {
        0.0
    } else {
        2.0 * precision * recall / (precision + recall)
    };
    eprintln!("xtask bench-jobs: {jobs} simulated jobs: precision {precision:.3}, recall {recall:.3}, F1 {f1:.3} (Minder: 0.904, F1 0.893); per cause right/total: {per:?}");
    for m in &misses {
        eprintln!("xtask bench-jobs: miss: {m}");
    }
    let result = json!({
        "smoke": smoke,
        "scale": scale,
        "accuracy": { "jobs": jobs, "precision": precision, "recall": recall, "f1": f1, "per_cause_right_of": per.iter().map(|(k, (r, t))| (k.to_string(), json!([r, t]))).collect::<serde_json::Map<String, Value>>(), "misses": misses },
    });
    if !smoke {
        std::fs::write(out, serde_json::to_string_pretty(&result)?)?;
        eprintln!("xtask bench-jobs: wrote {}", out.display());
    }
    let _ = std::fs::remove_dir_all(&tmp);
    for s in &scale {
        anyhow::ensure!(
            s["right"] == true,
            "the job report did not name the node with the Xid or the rank that stopped: {s}"
        );
    }
    Ok(result)
}
