//! `nantrace report`: answers "was it the machine?" from a bundle's timeline and snapshot.
//! Ranked suspects come from the signal table in [`rules`]; when nothing fires, the report says
//! so plainly and lists what was checked.
pub mod rules;
mod joblog;
mod render;

pub use render::{for_bundle, markdown};

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{json, Value};

use rules::{signal, Family, Signal};

/// One suspect: a signal that fired, with its evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub signal: &'static str,
    pub family: Family,
    pub severity: u32,
    /// Seconds relative to the first NaN (or the trigger when there is none); negative = before.
    pub rel_s: f64,
    pub text: String,
    pub touches_job: bool,
    pub count: usize,
    pub score: f64,
    /// What NVIDIA's catalog recommends for this Xid/SXid (in words), when it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<&'static str>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    pub verdict: String,
    /// The family the verdict names (`GPU`, `network`, ..., `none`).
    pub family: String,
    pub machine: bool,
    pub reference: String,
    pub suspects: Vec<Finding>,
    pub checked: Vec<String>,
    pub facts: Value,
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn when(rel: f64, reference: &str) -> String {
    let a = rel.abs();
    let t = if a < 1.0 { format!("{:.0} ms", a * 1000.0) } else if a < 120.0 { format!("{a:.1} s") } else { format!("{:.1} min", a / 60.0) };
    if rel <= 0.0 { format!("{t} before {reference}") } else { format!("{t} after {reference}") }
}

struct Ctx<'a> {
    by_src: std::collections::HashMap<&'a str, Vec<(f64, &'a Value)>>,
    job_pids: BTreeSet<u64>,
    job_gpus: BTreeSet<String>,
    /// "ip:port" of the job's TCP peers and local ends (snapshot.network.job_sockets).
    job_peers: BTreeSet<String>,
    root: Option<u64>,
}

impl Ctx<'_> {
    /// Events of one source that can be causes: a cause precedes its effect, so only what
    /// happened before the reference (with 0.2 s of slack for the log line's own delivery
    /// through the job's pipe).
    fn src<'b>(&'b self, s: &'b str) -> impl Iterator<Item = &'b (f64, &'b Value)> + 'b {
        self.by_src.get(s).into_iter().flatten().filter(|(r, _)| *r <= 0.2)
    }

    /// Every event of one source in the window, before and after the reference.
    fn all<'b>(&'b self, s: &'b str) -> impl Iterator<Item = &'b (f64, &'b Value)> + 'b {
        self.by_src.get(s).into_iter().flatten()
    }
}

struct Acc {
    out: BTreeMap<String, Finding>,
}

impl Acc {
    fn add(&mut self, sig: &'static Signal, key: &str, rel: f64, touches: bool, text: impl FnOnce() -> String) {
        let k = format!("{}/{key}", sig.id);
        match self.out.get_mut(&k) {
            Some(x) => {
                x.count += 1;
                x.touches_job |= touches;
                if rel.abs() < x.rel_s.abs() {
                    x.rel_s = rel;
                }
            }
            None => {
                self.out.insert(k, Finding { signal: sig.id, family: sig.family, severity: sig.severity, rel_s: rel, text: text(), touches_job: touches, count: 1, score: 0.0, action: None });
            }
        }
    }

    fn set_action(&mut self, sig: &'static Signal, key: &str, action: &str) {
        if let Some(f) = self.out.get_mut(&format!("{}/{key}", sig.id)) {
            f.action = Some(crate::classify::action_text(action));
        }
    }
}

fn job_gpus(snapshot: &Value, job_pids: &BTreeSet<u64>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let devs = snapshot["gpu"]["devices"].as_array().cloned().unwrap_or_default();
    for d in &devs {
        if let Some(ps) = d["compute_processes"].as_array() {
            if ps.iter().any(|p| p["pid"].as_u64().is_some_and(|x| job_pids.contains(&x))) {
                out.insert(d["pci"].as_str().unwrap_or("").to_string());
            }
        }
    }
    if let Some(cvd) = snapshot["software"]["env"]["CUDA_VISIBLE_DEVICES"].as_str() {
        for idx in cvd.split(',').filter_map(|s| s.trim().parse::<u64>().ok()) {
            if let Some(d) = devs.iter().find(|d| d["index"].as_u64() == Some(idx)) {
                out.insert(d["pci"].as_str().unwrap_or("").to_string());
            }
        }
    }
    out
}

fn p99(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[((v.len() as f64 * 0.99).ceil() as usize).saturating_sub(1).min(v.len() - 1)])
}

/// Evaluate every signal over the incident.
pub fn analyze(timeline: &Value, snapshot: &Value) -> Analysis {
    let nan_off = f(&timeline["first_nan"]["offset_s"]);
    let ref_off = nan_off.unwrap_or(0.0);
    let empty = Vec::new();
    let evs = timeline["events"].as_array().unwrap_or(&empty);
    let root = timeline["job"]["root_pid"].as_u64();
    let mut job_pids: BTreeSet<u64> = evs.iter().filter(|e| e["job"] == true).filter_map(|e| e["pid"].as_u64()).collect();
    job_pids.extend(root);
    for e in evs.iter().filter(|e| e["source"] == "fork" && e["job"] == true) {
        job_pids.extend(e["child_pid"].as_u64());
    }
    let events: Vec<(f64, &Value)> = evs.iter().map(|e| (f(&e["offset_s"]).unwrap_or(0.0) - ref_off, e)).collect();
    let mut by_src: std::collections::HashMap<&str, Vec<(f64, &Value)>> = std::collections::HashMap::new();
    for (r, e) in &events {
        by_src.entry(e["source"].as_str().unwrap_or("")).or_default().push((*r, *e));
    }
    let ctx = Ctx {
        by_src,
        job_gpus: job_gpus(snapshot, &job_pids),
        job_peers: snapshot["network"]["job_sockets"].as_array().into_iter().flatten().flat_map(|s| [s["remote"].as_str(), s["local"].as_str()]).flatten().map(String::from).collect(),
        job_pids,
        root,
    };
    let mut acc = Acc { out: BTreeMap::new() };
    let gpu_of_job = |pci: &str, pid: Option<u64>| ctx.job_gpus.contains(pci) || pid.is_some_and(|p| ctx.job_pids.contains(&p));

    // Kernel log classes (and the AER tracepoint).
    let nvml_xids: Vec<(f64, &Value)> = ctx.src("nvml_xid").map(|(r, e)| (*r, *e)).collect();
    let kernel: Vec<(f64, &Value)> = ["kmsg", "xid", "aer"].iter().flat_map(|s| ctx.src(s)).map(|(r, e)| (*r, *e)).collect();
    let mut corrected: BTreeMap<String, (Vec<f64>, bool, String)> = BTreeMap::new();
    for (rel, e) in &kernel {
        let class = e["class"].as_str().unwrap_or("");
        match class {
            "xid" => {
                let xid = e["xid"].as_u64().unwrap_or(0);
                let pci = e["pci"].as_str().unwrap_or("?");
                let touches = gpu_of_job(pci, e["xid_pid"].as_u64());
                let sig = match (xid, e["severity"].as_str().unwrap_or("")) {
                    (79, _) => signal("gpu_fallen_off_bus"),
                    (_, "critical") => signal("xid_critical"),
                    (_, "error") => signal("xid_error"),
                    (_, "warning") => signal("xid_warning"),
                    _ => continue,
                };
                let witnessed = nvml_xids.iter().any(|(r, n)| n["xid"].as_u64() == Some(xid) && n["pci"] == pci && (r - rel).abs() < 5.0);
                acc.add(sig, &format!("{xid}/{pci}"), *rel, touches, || {
                    format!(
                        "Xid {xid} ({}) on {pci}{}{}",
                        e["meaning"].as_str().unwrap_or(""),
                        if touches { ", a GPU of this job" } else { "" },
                        if witnessed { " [two witnesses: kernel log and NVML]" } else { "" }
                    )
                });
                acc.set_action(sig, &format!("{xid}/{pci}"), e["action"].as_str().unwrap_or(""));
            }
            "gpu_fallen_off_bus" => {
                let pci = e["pci"].as_str().unwrap_or("?");
                acc.add(signal("gpu_fallen_off_bus"), &format!("79/{pci}"), *rel, gpu_of_job(pci, None), || format!("GPU {pci} has fallen off the bus (NVRM, no Xid)"));
            }
            "sxid" => {
                let sx = e["sxid"].as_u64().unwrap_or(0);
                acc.add(signal("sxid"), &sx.to_string(), *rel, false, || format!("NVSwitch SXid {sx} on {}", e["pci"].as_str().unwrap_or("?")));
            }
            "oom_kill" => {
                let v = e["victim_pid"].as_u64().unwrap_or(0);
                // The oom:mark_victim probe saw the same kill: one kill, two witnesses.
                if ctx.src("oom").any(|(_, o)| o["victim_pid"].as_u64() == Some(v)) {
                    continue;
                }
                let job = ctx.job_pids.contains(&v);
                let sig = if job { signal("oom_kill_job") } else { signal("oom_kill_other") };
                acc.add(sig, &v.to_string(), *rel, job, || format!("OOM kill of {} {v}{}", e["victim_comm"].as_str().unwrap_or("?"), if job { " (job)" } else { "" }));
            }
            "hung_task" => acc.add(signal("hung_task"), e["task"].as_str().unwrap_or(""), *rel, false, || format!("hung task {}:{} blocked {} s", e["task"].as_str().unwrap_or("?"), e["task_pid"], e["seconds"])),
            "machine_check" => {
                let sig = if e["uncorrected"] == true { signal("machine_check") } else { signal("machine_check_corrected") };
                acc.add(sig, "mce", *rel, false, || format!("machine check: {}", e["message"].as_str().unwrap_or("").chars().take(100).collect::<String>()));
            }
            "link_down" => acc.add(signal("ib_link_down"), e["iface"].as_str().unwrap_or(""), *rel, false, || format!("link down on {}", e["iface"].as_str().unwrap_or("?"))),
            "nic_error" => acc.add(signal("nic_error"), e["device"].as_str().unwrap_or(""), *rel, false, || format!("NIC error on {}: {}", e["device"].as_str().unwrap_or("?"), e["message"].as_str().unwrap_or(""))),
            "soft_lockup" => acc.add(signal("soft_lockup"), "lockup", *rel, false, || format!("soft lockup: CPU#{} stuck for {} s", e["cpu"], e["seconds"])),
            "rcu_stall" => acc.add(signal("rcu_stall"), "rcu", *rel, false, || "RCU stall reported by the kernel".to_string()),
            "cpu_thermal" => acc.add(signal("cpu_thermal"), e["scope"].as_str().unwrap_or(""), *rel, false, || format!("CPU{} {} temperature above threshold, clock throttled", e["cpu"], e["scope"].as_str().unwrap_or("?"))),
            "net_fs_down" => acc.add(signal("netfs_down"), e["server"].as_str().unwrap_or(""), *rel, false, || format!("{} server {} not responding", e["fs"].as_str().unwrap_or("?"), e["server"].as_str().unwrap_or("?"))),
            "stale_handle" => acc.add(signal("stale_handle"), "stale", *rel, false, || format!("stale file handle: {}", e["message"].as_str().unwrap_or("").chars().take(100).collect::<String>())),
            "block_error" => {
                let dev = e["dev"].as_str().unwrap_or("?");
                acc.add(signal("block_io_error"), dev, *rel, false, || format!("{} on {dev} (kernel log)", e["kind"].as_str().unwrap_or("I/O error").replace('_', " ")));
            }
            "segfault" => {
                // Only a crash of a job process inside the GPU libraries is worth a line; the
                // comm in these lines is the process's own text and is never matched.
                let victim = e["crashed_pid"].as_u64();
                if e["gpu_library"] == true && victim.is_some_and(|v| ctx.job_pids.contains(&v)) {
                    acc.add(signal("segfault_gpu_library"), e["library"].as_str().unwrap_or("?"), *rel, true, || format!("job process {} crashed inside {}", victim.unwrap_or(0), e["library"].as_str().unwrap_or("?")));
                }
            }
            _ => {}
        }
        if e["source"] == "aer" {
            let dev = e["device"].as_str().unwrap_or("?").to_string();
            let touches = ctx.job_gpus.contains(&dev);
            let sev = e["aer_severity"].as_str().unwrap_or("");
            let ty = e["error_type"].as_str().map_or(String::new(), |t| format!(" ({t})"));
            match sev {
                "uncorrected_fatal" | "uncorrected_nonfatal" => {
                    let sig = if sev == "uncorrected_fatal" { signal("aer_fatal") } else { signal("aer_nonfatal") };
                    acc.add(sig, &dev, *rel, touches, || format!("PCIe AER {} on {dev}{ty}", sev.replace('_', " ")));
                }
                // Corrected errors count only as a burst (threshold), below.
                _ => corrected.entry(dev).or_insert_with(|| (Vec::new(), touches, ty)).0.push(*rel),
            }
        }
    }
    {
        let sig = signal("aer_corrected_burst");
        for (dev, (rels, touches, ty)) in corrected {
            if rels.len() as f64 >= sig.threshold {
                for r in &rels {
                    acc.add(sig, &dev, *r, touches, || format!("PCIe AER corrected on {dev}{ty}"));
                }
            }
        }
    }
    for (rel, n) in &nvml_xids {
        let xid = n["xid"].as_u64().unwrap_or(0);
        let pci = n["pci"].as_str().unwrap_or("?");
        let (meaning, sev) = crate::classify::xid_info(xid as u32);
        let key = format!("{xid}/{pci}");
        let seen = acc.out.keys().any(|k| k.ends_with(&key));
        if !seen {
            let sig = if xid == 79 { signal("gpu_fallen_off_bus") } else if sev == crate::classify::Severity::Critical { signal("xid_critical") } else { signal("xid_error") };
            acc.add(sig, &key, *rel, gpu_of_job(pci, None), || format!("Xid {xid} ({meaning}) on {pci} (NVML event)"));
        }
    }
    // OOM tracepoint, signals, exits, block errors.
    for (rel, e) in ctx.src("oom") {
        let v = e["victim_pid"].as_u64().unwrap_or(0);
        let job = e["victim_job"] == true || ctx.job_pids.contains(&v);
        let sig = if job { signal("oom_kill_job") } else { signal("oom_kill_other") };
        acc.add(sig, &v.to_string(), *rel, job, || format!("OOM kill of {} {v}{}, RSS {} MB", e["victim_comm"].as_str().unwrap_or("?"), if job { " (job)" } else { "" }, e["anon_rss_kb"].as_u64().unwrap_or(0) / 1024));
    }
    for (rel, e) in ctx.src("signal") {
        let name = e["signal"].as_str().unwrap_or("");
        let target = e["target_pid"].as_u64().unwrap_or(0);
        let sender = e["pid"].as_u64().unwrap_or(0);
        let sender_in_job = e["job"] == true || ctx.job_pids.contains(&sender);
        if !ctx.job_pids.contains(&target) || matches!(name, "SIGTERM" | "SIGINT" | "SIGHUP" | "SIGPIPE" | "SIGCHLD" | "SIGUSR1" | "SIGUSR2" | "signal") {
            continue;
        }
        let crash = matches!(name, "SIGSEGV" | "SIGABRT" | "SIGFPE" | "SIGILL" | "SIGBUS");
        if crash && (sender == target || sender_in_job) {
            // The job crashed by itself: software, unless a hardware signal corroborates it.
            acc.add(signal("job_crash"), &format!("{name}/{target}"), *rel, true, || format!("{name} in job process {} {target} (raised by the job itself)", e["target_comm"].as_str().unwrap_or("?")));
        } else if !sender_in_job {
            // The job stopping its own workers is housekeeping; a kill from outside is not.
            acc.add(signal("job_fatal_signal"), &format!("{name}/{target}"), *rel, true, || format!("{name} to {} {target} (job) from {} {sender} (outside the job)", e["target_comm"].as_str().unwrap_or("?"), e["comm"].as_str().unwrap_or("?")));
        }
    }
    let forked: std::collections::HashMap<u64, f64> = ctx.all("fork").filter_map(|(r, e)| Some((e["child_pid"].as_u64()?, *r))).collect();
    for (rel, e) in ctx.src("exit") {
        let pid = e["pid"].as_u64();
        // A helper that lived less than the threshold (`grep -q`, a pyenv shim) is not a worker.
        let lived = pid.and_then(|p| forked.get(&p)).map_or(f64::INFINITY, |f| rel - f);
        if e["job"] == true && pid != ctx.root && e["exit_code"].as_i64().is_some_and(|c| c != 0) && lived >= signal("worker_exit").threshold {
            acc.add(signal("worker_exit"), &pid.unwrap_or(0).to_string(), *rel, true, || format!("job process {} {} exited with code {}", e["comm"].as_str().unwrap_or("?"), pid.unwrap_or(0), e["exit_code"]));
        }
    }
    for (rel, e) in ctx.src("block") {
        if e["error"].as_i64().is_some_and(|x| x != 0) {
            let dev = e["dev"].as_str().unwrap_or("?");
            acc.add(signal("block_io_error"), dev, *rel, e["job"] == true, || format!("block I/O error {} on device {dev}", e["error"]));
        }
    }
    // Rates: the minute before vs the minute earlier.
    {
        let sig = signal("disk_stall");
        // Per device (by name when the block event could be resolved, so the probe's events
        // and the iostat samples of one disk are one suspect): (recent, earlier, first slow).
        let mut per_dev: BTreeMap<String, (Vec<f64>, Vec<f64>, f64)> = BTreeMap::new();
        let mut job_devs = BTreeSet::new();
        for (r, e) in ctx.src("block").chain(ctx.src("disk")).filter(|(r, _)| *r > -120.0) {
            let mut push = |dev: String, v: f64| {
                let slot = per_dev.entry(dev).or_insert((Vec::new(), Vec::new(), f64::INFINITY));
                if *r > -60.0 {
                    slot.0.push(v);
                    if v >= 100.0 {
                        slot.2 = slot.2.min(*r);
                    }
                } else {
                    slot.1.push(v);
                }
            };
            if e["source"] == "block" {
                let name = e["disk"].as_str().or(e["dev"].as_str()).unwrap_or("?").to_string();
                if e["job"] == true {
                    job_devs.insert(name.clone());
                }
                if let Some(l) = f(&e["latency_ms"]) {
                    push(name, l);
                }
            } else if let Some(m) = e["disks"].as_object() {
                for (d, v) in m {
                    push(d.clone(), f(&v["r_await_ms"]).unwrap_or(0.0).max(f(&v["w_await_ms"]).unwrap_or(0.0)));
                }
            }
        }
        for (dev, (recent, earlier, first_slow)) in per_dev {
            let had_earlier = !earlier.is_empty();
            let (Some(r), e) = (p99(recent), p99(earlier).unwrap_or(1.0).max(1.0)) else { continue };
            if r >= 100.0 && r >= sig.threshold * e {
                let vs = if had_earlier { format!("{:.0}× the minute earlier", r / e) } else { "no I/O seen the minute earlier".to_string() };
                acc.add(sig, &dev, first_slow.min(0.0), job_devs.contains(&dev), || format!("block I/O p99 on {dev} {r:.0} ms in the minute before ({vs}), slow since"));
            }
        }
    }
    {
        let sig = signal("retransmit_storm");
        let mut per_peer: BTreeMap<String, (usize, usize, f64, bool)> = BTreeMap::new();
        for (r, e) in ctx.src("tcp_retransmit").filter(|(r, _)| *r > -120.0) {
            let peer = format!("{}:{}", e["daddr"].as_str().unwrap_or("?"), e["dport"]);
            let peer_of_job = ctx.job_peers.contains(&peer);
            let s = per_peer.entry(peer).or_insert((0, 0, f64::NEG_INFINITY, false));
            if *r > -60.0 { s.0 += 1 } else { s.1 += 1 }
            s.2 = s.2.max(*r);
            // Retransmits run in softirq context: tie them to the job through its sockets.
            let local = format!("{}:{}", e["saddr"].as_str().unwrap_or("?"), e["sport"]);
            s.3 |= e["job"] == true || peer_of_job || ctx.job_peers.contains(&local);
        }
        for (peer, (recent, earlier, last, job)) in per_peer {
            if recent >= 20 && recent as f64 >= sig.threshold * (earlier.max(1) as f64) {
                acc.add(sig, &peer, last, job, || format!("TCP retransmits to {peer}{} up {}× ({recent} in the minute before)", if job { ", a peer of this job" } else { "" }, recent / earlier.max(1)));
            }
        }
    }
    for (rel, e) in ctx.src("system").filter(|(r, _)| *r > -60.0) {
        if let Some(s) = f(&e["swap_in_kb_s"]).filter(|s| *s >= signal("swap_thrash").threshold) {
            acc.add(signal("swap_thrash"), "swap", *rel, false, || format!("swap-in {:.0} MB/s", s / 1024.0));
        }
        if let Some(p) = f(&e["psi_memory_some_avg10"]).filter(|p| *p >= signal("memory_pressure").threshold) {
            acc.add(signal("memory_pressure"), "psi", *rel, false, || format!("memory pressure (PSI some avg10) {p:.0}%"));
        }
    }
    for (rel, e) in ctx.src("gpu_change") {
        let c = e["change"].as_str().unwrap_or("");
        let pci = e["pci"].as_str().unwrap_or("?");
        let touches = ctx.job_gpus.contains(pci);
        let sig = if c.contains("uncorrected ECC") {
            signal("ecc_uncorrected")
        } else if c.contains("corrected ECC") {
            signal("ecc_corrected")
        } else if c.contains("PCIe replay") {
            signal("pcie_replay")
        } else if c.contains("started") && (c.starts_with("HW")) {
            signal("gpu_hw_slowdown")
        } else if c.contains("started") || c.contains("temperature") {
            signal("gpu_power_cap")
        } else {
            continue;
        };
        acc.add(sig, c, *rel, touches, || c.to_string());
    }
    for (rel, e) in ctx.src("net_change") {
        let c = e["change"].as_str().unwrap_or("");
        // The state it went to decides: `ACTIVE -> DOWN` is a link down, `DOWN -> ACTIVE` is not.
        let to = c.rsplit_once("->").map_or("", |(_, t)| t).to_ascii_lowercase();
        let sig = if c.contains("->") && (to.trim_start().starts_with("down") || to.contains(": down") || to.contains("polling") || to.contains("disabled")) {
            signal("ib_link_down")
        } else if c.contains("->") && c.contains("state") {
            continue;
        } else {
            signal("link_errors")
        };
        acc.add(sig, e["link"].as_str().unwrap_or(""), *rel, false, || c.to_string());
    }
    // Numerics: the loss scale and the loss curve before the NaN.
    let logs: Vec<(f64, &Value)> = ctx.src("log").filter(|(r, _)| *r <= 0.0).map(|(r, e)| (*r, *e)).collect();
    {
        let scales: Vec<(f64, f64, Option<u64>)> = logs.iter().filter_map(|(r, e)| Some((*r, f(&e["loss_scale"])?, e["step"].as_u64()))).collect();
        let overflow = logs.iter().any(|(_, e)| e["overflow"] == true);
        if let (Some(max), Some(last)) = (scales.iter().map(|s| s.1).reduce(f64::max), scales.last()) {
            let sig = signal("loss_scale_collapse");
            if overflow && (max / last.1.max(1e-12) >= sig.threshold || (last.1 <= 1.0 && max > 1.0)) {
                let first_max = scales.iter().find(|s| s.1 == max).unwrap();
                let steps = match (first_max.2, last.2) {
                    (Some(a), Some(b)) if b > a => format!(" over {} steps", b - a),
                    _ => String::new(),
                };
                acc.add(sig, "scale", last.0, true, || format!("loss scale fell from {max} to {}{steps} (fp16 overflow messages before it)", last.1));
            }
        }
        let losses: Vec<(f64, f64, Option<u64>)> = logs.iter().filter_map(|(r, e)| Some((*r, f(&e["loss"])?, e["step"].as_u64()))).filter(|l| l.1.is_finite()).collect();
        let tail = &losses[losses.len().saturating_sub(100)..];
        if let (Some(min), Some(last)) = (tail.iter().map(|l| l.1).reduce(f64::min), tail.last()) {
            let sig = signal("loss_spike");
            if min > 0.0 && last.1 / min >= sig.threshold {
                acc.add(sig, "loss", last.0, true, || format!("loss grew from {min:.4} to {:.4e} before the NaN", last.1));
            }
        }
    }

    // The job's own failure lines, at any time in the window.
    joblog::detect(&ctx, &mut acc, f64::INFINITY);

    let ref_name = if nan_off.is_some() { "the first NaN" } else { "the trigger" };
    let mut suspects: Vec<Finding> = acc.out.into_values().collect();
    for s in &mut suspects {
        let closeness = 1.0 / (1.0 + s.rel_s.abs() / 60.0);
        s.score = f64::from(s.severity) * (0.5 + 0.5 * closeness) * if s.touches_job { 1.25 } else { 1.0 };
        if s.count > 1 && !s.text.ends_with(" since") {
            s.text.push_str(&format!(" (×{})", s.count));
        }
        let sep = if s.text.ends_with(" since") { " " } else { ", " };
        s.text = format!("{}{sep}{}", s.text, when(s.rel_s, ref_name));
    }
    suspects.sort_by(|a, b| b.score.total_cmp(&a.score));

    let window_min = timeline["window"]["pre_s"].as_f64().unwrap_or(600.0) / 60.0;
    let (verdict, family) = verdict(&suspects, timeline, snapshot, window_min, ref_name);
    let machine: Vec<&Finding> = suspects.iter().filter(|s| s.family.is_machine()).collect();
    let reference = match nan_off {
        Some(_) => format!("first NaN at {} ({}): {}", timeline["first_nan"]["time"].as_str().unwrap_or("?"), local_time(timeline["first_nan"]["time"].as_str()), timeline["first_nan"]["line"].as_str().unwrap_or("")),
        None => format!("no NaN in the log; times are relative to the trigger ({} at {})", timeline["trigger"]["kind"].as_str().unwrap_or("?"), timeline["trigger"]["time"].as_str().unwrap_or("?")),
    };
    Analysis { verdict, family, machine: !machine.is_empty(), reference, suspects, checked: checked(timeline, snapshot), facts: facts(timeline, snapshot) }
}

/// The verdict and the family it names. Any machine-family suspect (GPU, PCIe, host memory,
/// host kernel/CPU, storage, network) makes it "PROBABLY" (a strong signal) or "POSSIBLY"
/// THE MACHINE: nantrace never says "not the machine" while the machine spoke. Without one,
/// the job's own software or GPU-memory-limit error is named, then an unexplained hang; only
/// with none of these, and with eyes (probes or NVML), "NOT THE MACHINE as far as nantrace can see".
fn verdict(suspects: &[Finding], timeline: &Value, snapshot: &Value, window_min: f64, ref_name: &str) -> (String, String) {
    let first = |pred: &dyn Fn(&Finding) -> bool| suspects.iter().find(|s| pred(s));
    let label = |f: &Finding| f.family.label().to_string();
    if let Some(top) = first(&|s| s.family.is_machine()) {
        let job_sw = first(&|s| matches!(s.family, Family::Software | Family::GpuMemoryLimit)).map_or(String::new(), |s| format!(" (the job also reported: {})", s.text));
        return if top.severity >= 60 {
            (format!("PROBABLY THE MACHINE ({}): {}{job_sw}", top.family.label(), top.text), label(top))
        } else {
            (format!("POSSIBLY THE MACHINE ({}, weak signals only): {}{job_sw}", top.family.label(), top.text), label(top))
        };
    }
    if let Some(top) = first(&|s| matches!(s.family, Family::Software | Family::GpuMemoryLimit)) {
        let why = if top.family == Family::GpuMemoryLimit { "a resource limit, not a fault: reduce the batch or sequence length, or use more GPUs" } else { "a bug or a configuration problem in the job, not a machine fault" };
        return (format!("NOT THE MACHINE ({}): {}; {why}", top.family.label(), top.text), label(top));
    }
    if let Some(top) = first(&|s| s.family == Family::Hang) {
        return (format!("UNDECIDED ({}): {}. No GPU, network or host fault on this node in the window: the rank that stopped is elsewhere; merge the other nodes' bundles (nantrace merge)", top.family.label(), top.text), label(top));
    }
    let acc = &timeline["accounting"];
    let probes = acc["probes_attached"].as_array().is_some_and(|a| !a.is_empty());
    let nvml = snapshot["gpu"]["available"].as_bool() == Some(true);
    if !probes && !nvml {
        return (
            format!(
                "CANNOT TELL: nantrace saw neither kernel events ({}) nor GPU health (NVML: {}); the job's output names no machine fault. Run as root with the probes to answer.",
                acc["probes_error"].as_str().unwrap_or("probes not loaded"),
                snapshot["gpu"]["reason"].as_str().unwrap_or("not available")
            ),
            "unknown".into(),
        );
    }
    let incomplete = incomplete_classes(acc);
    let window = if incomplete.is_empty() {
        format!("in the {window_min:.0} minutes before {ref_name}")
    } else {
        format!("in what the window kept before {ref_name} (INCOMPLETE: {} evicted for memory)", incomplete.join(", "))
    };
    (
        format!("NOT THE MACHINE, as far as nantrace can see: no hardware, kernel, system or job-output fault {window}. Look at the model side: learning rate, data, precision. (Silent data corruption, ~1 faulty device in 1000, logs nothing: if the run is otherwise healthy, re-run the step on other GPUs.)"),
        "none".into(),
    )
}

/// Sources of machine evidence that lost events to the memory cap (the window is incomplete).
fn incomplete_classes(acc: &Value) -> Vec<String> {
    let ev = &acc["recorder"]["evicted_by_memory_per_source"];
    ev.as_object()
        .map(|m| m.iter().filter(|(k, v)| k.as_str() != "log" && v.as_u64().unwrap_or(0) > 0).map(|(k, v)| format!("{k} ×{v}")).collect())
        .unwrap_or_default()
}

fn local_time(utc: Option<&str>) -> String {
    let Some(t) = utc.and_then(|s| time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()) else { return "local time unknown".into() };
    // SAFETY: localtime_r with valid pointers; only reads the TZ database.
    let off = unsafe {
        let secs = t.unix_timestamp() as libc::time_t;
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&secs, &mut tm);
        tm.tm_gmtoff
    };
    let lt = t.to_offset(time::UtcOffset::from_whole_seconds(off as i32).unwrap_or(time::UtcOffset::UTC));
    format!("{:04}-{:02}-{:02} {:02}:{:02}:{:02} local, UTC{:+}", lt.year(), u8::from(lt.month()), lt.day(), lt.hour(), lt.minute(), lt.second(), off as f64 / 3600.0)
}

fn checked(timeline: &Value, snapshot: &Value) -> Vec<String> {
    let acc = &timeline["accounting"];
    let mut out = Vec::new();
    let probes: Vec<String> = acc["probes_attached"].as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect()).unwrap_or_default();
    if probes.is_empty() {
        out.push(format!("kernel probes: NOT loaded ({})", acc["probes_error"].as_str().unwrap_or("unknown reason")));
    } else {
        out.push(format!("kernel events through eBPF: {}", probes.join(", ")));
    }
    if let Some(m) = acc["probes_not_attached"].as_object() {
        for (k, v) in m {
            out.push(format!("not attached: {k} ({})", v.as_str().unwrap_or("")));
        }
    }
    match snapshot["gpu"]["available"].as_bool() {
        Some(true) => out.push(format!("GPU health through NVML: {} GPU(s)", snapshot["gpu"]["device_count"])),
        _ => out.push(format!("GPU health: {}", snapshot["gpu"]["reason"].as_str().unwrap_or("no snapshot"))),
    }
    let n = |s: &str| acc["events"][s].as_u64().unwrap_or(0);
    out.push(format!("system samples: {} (memory, swap, CPU, PSI), disk samples: {}, network samples: {}, GPU samples: {}", n("system"), n("disk"), n("net"), n("gpu")));
    out.push(format!("log lines read: {}", n("log")));
    let drops: u64 = acc["kernel_drops"].as_object().map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
    let ev = &acc["recorder"];
    out.push(format!("losses: {drops} kernel events dropped, {} evicted by time, {} by memory", ev["evicted_by_time"], ev["evicted_by_memory"]));
    out
}

fn facts(timeline: &Value, snapshot: &Value) -> Value {
    let sw = &snapshot["software"];
    let precision: BTreeMap<String, Value> = sw["env"]
        .as_object()
        .map(|m| m.iter().filter(|(k, _)| ["AMP", "FP16", "BF16", "FP8", "TF32", "PRECISION", "MIXED", "CUBLAS", "CUDNN", "DTYPE", "HALF", "ALLOW_TF32"].iter().any(|w| k.to_ascii_uppercase().contains(w))).map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let losses: Vec<Value> = timeline["events"]
        .as_array()
        .map(|a| a.iter().filter(|e| e["source"] == "log" && !e["loss"].is_null()).map(|e| json!({ "step": e["step"], "loss": e["loss"], "offset_s": e["offset_s"] })).collect())
        .unwrap_or_default();
    let last: Vec<Value> = losses[losses.len().saturating_sub(12)..].to_vec();
    json!({
        "host": timeline["host"],
        "job": timeline["job"],
        "kernel": sw["kernel"],
        "nvidia_driver": sw["nvidia_driver"],
        "cuda_driver": sw["cuda_driver_version"],
        "nvcc": sw["nvcc"],
        "libraries": sw["libraries_loaded_by_job"],
        "frameworks": sw["frameworks"],
        "precision_env": precision,
        "env": sw["env"],
        "last_losses": last,
        "scheduler": snapshot["scheduler"],
        "injected": timeline["accounting"]["injected"],
    })
}

#[cfg(test)]
mod tests;
