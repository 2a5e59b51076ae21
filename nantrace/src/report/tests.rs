//! Suspect ranking on recorded scenarios: each injected cause comes out on top.
use super::*;

/// A recorded-scenario builder: ten minutes of a healthy run (loss lines every second,
/// system samples, fast block I/O, informational kernel lines), then the first NaN at t=0.
struct Scenario {
    events: Vec<Value>,
    snapshot: Value,
}

const ROOT: u64 = 4242;

impl Scenario {
    fn healthy() -> Self {
        let mut events = Vec::new();
        for i in 0..600 {
            let t = -600.0 + f64::from(i);
            events.push(json!({ "offset_s": t, "source": "log", "pid": ROOT, "job": true, "line": format!("step {i} | loss {:.3}", 2.5 - f64::from(i) / 600.0), "step": i, "loss": 2.5 - f64::from(i) / 600.0, "loss_scale": 65536.0 }));
            if i % 5 == 0 {
                events.push(json!({ "offset_s": t + 0.5, "source": "system", "mem_available_kb": 20_000_000, "swap_in_kb_s": 0.0, "psi_memory_some_avg10": 0.0, "iowait_pct": 1.0 }));
                events.push(json!({ "offset_s": t + 0.3, "source": "block", "dev": "259:0", "latency_ms": 4.0 + f64::from(i % 3), "error": 0, "pid": ROOT, "job": true }));
            }
        }
        events.push(json!({ "offset_s": -300.0, "source": "kmsg", "text": "NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.54.15", "pid": 0 }));
        events.push(json!({ "offset_s": 0.0, "source": "log", "pid": ROOT, "job": true, "line": "step 600 | loss nan", "step": 600, "loss": "NaN", "nonfinite": true }));
        let snapshot = json!({ "gpu": { "available": true, "device_count": 4, "devices": [
            { "index": 0, "pci": "0000:3b:00.0", "compute_processes": [{ "pid": ROOT }] },
            { "index": 1, "pci": "0000:5e:00.0", "compute_processes": [] },
        ] }, "software": { "env": { "CUDA_VISIBLE_DEVICES": "0" } } });
        Scenario { events, snapshot }
    }

    fn with(mut self, e: Value) -> Self {
        self.events.push(e);
        self
    }

    fn analyze(&self) -> Analysis {
        let mut evs = self.events.clone();
        evs.sort_by(|a, b| a["offset_s"].as_f64().unwrap().total_cmp(&b["offset_s"].as_f64().unwrap()));
        let t = json!({
            "schema": crate::bundle::SCHEMA,
            "first_nan": { "offset_s": 0.0, "time": "2026-11-30T10:00:00Z", "line": "step 600 | loss nan", "step": 600 },
            "trigger": { "kind": "nan", "time": "2026-11-30T10:00:00Z" },
            "job": { "root_pid": ROOT },
            "window": { "pre_s": 600.0 },
            "accounting": { "probes_attached": ["printk:console"], "events": {} },
            "events": evs,
        });
        analyze(&t, &self.snapshot)
    }
}

fn kmsg(t: f64, text: &str) -> Value {
    let mut e = json!({ "offset_s": t, "source": "kmsg", "text": text, "pid": 0, "job": false });
    if let Some(c) = crate::classify::classify(text) {
        e["severity"] = serde_json::to_value(c.severity()).unwrap();
        if let Value::Object(m) = serde_json::to_value(&c).unwrap() {
            for (k, v) in m {
                e[k] = v;
            }
        }
        if matches!(c, crate::classify::KmsgClass::Xid { .. }) {
            e["source"] = json!("xid");
        }
        if matches!(c, crate::classify::KmsgClass::Aer { .. }) {
            e["source"] = json!("aer");
        }
    }
    e
}

fn top(a: &Analysis) -> &Finding {
    a.suspects.first().unwrap_or_else(|| panic!("no suspects; verdict {}", a.verdict))
}

#[test]
fn healthy_run_then_nan_names_no_hardware() {
    let a = Scenario::healthy().analyze();
    assert!(!a.machine, "{:?}", a.suspects);
    assert!(a.suspects.is_empty(), "{:?}", a.suspects);
    assert!(a.verdict.starts_with("NOT THE MACHINE"), "{}", a.verdict);
    assert!(a.verdict.contains("10 minutes"));
    assert!(a.checked.iter().any(|c| c.contains("printk:console")));
}

#[test]
fn xid_79_on_the_jobs_gpu_is_the_top_suspect() {
    let a = Scenario::healthy().with(kmsg(-4.1, &format!("NVRM: Xid (PCI:0000:3b:00): 79, pid={ROOT}, name=python3, GPU has fallen off the bus."))).analyze();
    let t = top(&a);
    assert_eq!(t.signal, "gpu_fallen_off_bus");
    assert!(t.touches_job);
    assert!(t.text.contains("Xid 79 (GPU has fallen off the bus) on 0000:3b:00.0, a GPU of this job, 4.1 s before the first NaN"), "{}", t.text);
    assert!(a.verdict.starts_with("PROBABLY THE MACHINE"));
}

#[test]
fn xid_48_is_the_top_suspect() {
    let a = Scenario::healthy().with(kmsg(-20.0, "NVRM: Xid (PCI:0000:5e:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.")).analyze();
    assert_eq!(top(&a).signal, "xid_critical");
    assert!(top(&a).text.starts_with("Xid 48 (Double Bit ECC Error) on 0000:5e:00.0"), "{}", top(&a).text);
}

#[test]
fn aer_burst_is_the_top_suspect() {
    let mut s = Scenario::healthy();
    for i in 0..8 {
        s = s.with(kmsg(-30.0 + f64::from(i), "pcieport 0000:3a:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)"));
    }
    let a = s.analyze();
    assert_eq!(top(&a).signal, "aer_corrected_burst");
    assert!(top(&a).text.contains("(×8)"), "{}", top(&a).text);
}

#[test]
fn oom_kill_of_a_worker_is_the_top_suspect() {
    let a = Scenario::healthy()
        .with(json!({ "offset_s": -12.0, "source": "oom", "victim_pid": 4711, "victim_comm": "pt_data_worker", "victim_job": true, "anon_rss_kb": 8_000_000, "pid": 1, "job": false }))
        .analyze();
    assert_eq!(top(&a).signal, "oom_kill_job");
    assert!(top(&a).text.starts_with("OOM kill of pt_data_worker 4711 (job)"), "{}", top(&a).text);
    assert!(top(&a).text.ends_with("12.0 s before the first NaN"));
}

#[test]
fn disk_stall_is_the_top_suspect() {
    let mut s = Scenario::healthy();
    for i in 0..10 {
        s = s.with(json!({ "offset_s": -50.0 + f64::from(i) * 4.0, "source": "block", "dev": "259:0", "latency_ms": 1800.0, "error": 0, "pid": ROOT, "job": true }));
    }
    let a = s.analyze();
    assert_eq!(top(&a).signal, "disk_stall");
    assert!(top(&a).text.starts_with("block I/O p99 on 259:0 1800 ms in the minute before (300× the minute earlier), slow since 50.0 s before the first NaN"), "{}", top(&a).text);
}

#[test]
fn retransmit_storm_is_the_top_suspect() {
    let mut s = Scenario::healthy().with(json!({ "offset_s": -100.0, "source": "tcp_retransmit", "daddr": "10.0.0.7", "dport": 29500, "job": false }));
    for i in 0..40 {
        s = s.with(json!({ "offset_s": -59.0 + f64::from(i), "source": "tcp_retransmit", "daddr": "10.0.0.7", "dport": 29500, "job": false }));
    }
    let a = s.analyze();
    assert_eq!(top(&a).signal, "retransmit_storm");
    assert!(top(&a).text.starts_with("TCP retransmits to 10.0.0.7:29500 up 40×"), "{}", top(&a).text);
}

#[test]
fn swap_thrash_is_the_top_suspect() {
    let a = Scenario::healthy().with(json!({ "offset_s": -8.0, "source": "system", "swap_in_kb_s": 300.0 * 1024.0 })).analyze();
    assert_eq!(top(&a).signal, "swap_thrash");
    assert!(top(&a).text.starts_with("swap-in 300 MB/s"));
}

#[test]
fn thermal_throttling_is_the_top_suspect() {
    let a = Scenario::healthy().with(json!({ "offset_s": -40.0, "source": "gpu_change", "gpu": 0, "pci": "0000:3b:00.0", "change": "HW slowdown started on GPU 0 (0000:3b:00.0)" })).analyze();
    assert_eq!(top(&a).signal, "gpu_hw_slowdown");
    assert!(top(&a).touches_job);
}

#[test]
fn loss_scale_collapse_with_nothing_else_wrong() {
    let mut s = Scenario::healthy();
    let mut scale = 65536.0;
    for i in 0..17 {
        scale /= 2.0;
        s = s.with(json!({ "offset_s": -17.0 + f64::from(i), "source": "log", "pid": ROOT, "job": true, "line": "OVERFLOW! Skipping step", "overflow": true, "loss_scale": scale, "step": 583 + i }));
    }
    let a = s.analyze();
    assert_eq!(top(&a).signal, "loss_scale_collapse");
    assert!(top(&a).text.starts_with("loss scale fell from 65536 to 0.5"), "{}", top(&a).text);
    assert!(!a.machine);
    assert!(a.verdict.starts_with("NOT THE MACHINE"));
}

#[test]
fn the_job_killing_its_own_worker_after_the_nan_is_not_a_suspect() {
    let a = Scenario::healthy()
        .with(json!({ "offset_s": 0.7, "source": "signal", "signal": "SIGKILL", "target_pid": 4300, "pid": ROOT, "job": true }))
        .with(json!({ "offset_s": -3.0, "source": "signal", "signal": "SIGKILL", "target_pid": 4301, "pid": ROOT, "job": true }))
        .analyze();
    assert!(a.suspects.is_empty(), "{:?}", a.suspects);
}

#[test]
fn an_xid_seen_by_the_kernel_log_and_nvml_is_one_suspect_with_two_witnesses() {
    let a = Scenario::healthy()
        .with(kmsg(-6.0, "NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."))
        .with(json!({ "offset_s": -5.9, "source": "nvml_xid", "xid": 48, "pci": "0000:3b:00.0", "witness": "nvml" }))
        .analyze();
    let xids: Vec<&Finding> = a.suspects.iter().filter(|f| f.text.contains("Xid 48")).collect();
    assert_eq!(xids.len(), 1, "{:?}", a.suspects);
    assert!(xids[0].text.contains("[two witnesses: kernel log and NVML]"), "{}", xids[0].text);
    assert!(xids[0].touches_job, "0000:3b:00.0 is the job's GPU (CUDA_VISIBLE_DEVICES=0)");
    // NVML alone still names it.
    let b = Scenario::healthy().with(json!({ "offset_s": -5.9, "source": "nvml_xid", "xid": 79, "pci": "0000:3b:00.0" })).analyze();
    assert_eq!(top(&b).signal, "gpu_fallen_off_bus");
    assert!(top(&b).text.contains("(NVML event)"));
}
