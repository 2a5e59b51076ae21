//! Suspect ranking on recorded scenarios: each injected cause comes out on top.
use super::*;

/// A recorded-scenario builder: ten minutes of a healthy run (loss lines every second,
/// system samples, fast block I/O, informational kernel lines), then the first NaN at t=0.
pub(super) struct Scenario {
    events: Vec<Value>,
    pub(super) snapshot: Value,
    pub(super) probes: Value,
    /// `accounting.kernel_writers`, as a dump that checked `/dev/kmsg` writes it.
    pub(super) writers: Value,
}

pub(super) const ROOT: u64 = 4242;

impl Scenario {
    pub(super) fn healthy() -> Self {
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
        Scenario {
            events,
            snapshot,
            probes: json!(["printk:console"]),
            writers: Value::Null,
        }
    }

    pub(super) fn with(mut self, e: Value) -> Self {
        self.events.push(e);
        self
    }

    pub(super) fn analyze(&self) -> Analysis {
        self.analyze_window(json!(600.0))
    }

    /// As `analyze`, with the bundle's `window.pre_s` as given (a user's bundle may say anything).
    pub(super) fn analyze_window(&self, pre_s: Value) -> Analysis {
        let mut evs = self.events.clone();
        evs.sort_by(|a, b| {
            a["offset_s"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["offset_s"].as_f64().unwrap())
        });
        let t = json!({
            "schema": crate::bundle::SCHEMA,
            "first_nan": { "offset_s": 0.0, "time": "2026-11-30T10:00:00Z", "line": "step 600 | loss nan", "step": 600 },
            "trigger": { "kind": "nan", "time": "2026-11-30T10:00:00Z" },
            "job": { "root_pid": ROOT },
            "window": { "pre_s": pre_s },
            "accounting": { "probes_attached": self.probes, "events": {}, "kernel_writers": self.writers },
            "events": evs,
        });
        analyze(&t, &self.snapshot)
    }
}

pub(super) fn kmsg(t: f64, text: &str) -> Value {
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
    a.suspects
        .first()
        .unwrap_or_else(|| panic!("no suspects; verdict {}", a.verdict))
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
    assert!(
        top(&a)
            .text
            .starts_with("Xid 48 (Double Bit ECC Error) on 0000:5e:00.0"),
        "{}",
        top(&a).text
    );
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
    assert!(
        top(&a)
            .text
            .starts_with("OOM kill of pt_data_worker 4711 (job)"),
        "{}",
        top(&a).text
    );
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

/// A shared virtual disk's few hundred milliseconds under the machine's other work, on
/// requests that are not the job's, is not a stall (the net demo's verdict of 12-02 went to
/// vda's 214 ms over the job's dropped packets); a second or more is; the job's own slow
/// requests count from 100 ms.
#[test]
fn a_slow_shared_disk_is_not_a_stall_unless_the_job_waited_or_it_took_seconds() {
    let other = |ms: f64| {
        let mut s = Scenario::healthy();
        for i in 0..10 {
            s = s.with(json!({ "offset_s": -50.0 + f64::from(i) * 4.0, "source": "block", "dev": "254:0", "disk": "vda", "latency_ms": ms, "error": 0, "pid": 4242, "job": false }));
        }
        s.analyze()
    };
    assert!(
        other(214.0)
            .suspects
            .iter()
            .all(|x| x.signal != "disk_stall"),
        "214 ms on another process's requests"
    );
    assert!(other(1500.0)
        .suspects
        .iter()
        .any(|x| x.signal == "disk_stall"));
    let mut s = Scenario::healthy();
    for i in 0..10 {
        s = s.with(json!({ "offset_s": -50.0 + f64::from(i) * 4.0, "source": "block", "dev": "254:0", "disk": "vda", "latency_ms": 214.0, "error": 0, "pid": ROOT, "job": true }));
    }
    assert_eq!(
        top(&s.analyze()).signal,
        "disk_stall",
        "the job waited 214 ms"
    );
}

#[test]
fn retransmit_storm_is_the_top_suspect() {
    let mut s = Scenario::healthy().with(json!({ "offset_s": -100.0, "source": "tcp_retransmit", "daddr": "10.0.0.7", "dport": 29500, "job": false }));
    for i in 0..40 {
        s = s.with(json!({ "offset_s": -59.0 + f64::from(i), "source": "tcp_retransmit", "daddr": "10.0.0.7", "dport": 29500, "job": false }));
    }
    let a = s.analyze();
    assert_eq!(top(&a).signal, "retransmit_storm");
    assert!(
        top(&a)
            .text
            .starts_with("TCP retransmits to 10.0.0.7:29500 up 40×"),
        "{}",
        top(&a).text
    );
}

#[test]
fn swap_thrash_is_the_top_suspect() {
    let a = Scenario::healthy()
        .with(json!({ "offset_s": -8.0, "source": "system", "swap_in_kb_s": 300.0 * 1024.0 }))
        .analyze();
    assert_eq!(top(&a).signal, "swap_thrash");
    assert!(top(&a).text.starts_with("swap-in 300 MB/s"));
}

#[test]
fn thermal_throttling_is_the_top_suspect() {
    // Row remaps and NVLink errors sampled during the window (collect::gpu::changes' words).
    let r = Scenario::healthy()
        .with(json!({ "offset_s": -30.0, "source": "gpu_change", "gpu": 0, "pci": "0000:3b:00.0", "change": "row remapping: 1 more row(s) remapped for uncorrectable errors on GPU 0 (0000:3b:00.0)" }))
        .with(json!({ "offset_s": -30.0, "source": "gpu_change", "gpu": 0, "pci": "0000:3b:00.0", "change": "row remap pending (needs a GPU reset) on GPU 0 (0000:3b:00.0)" }))
        .with(json!({ "offset_s": -20.0, "source": "gpu_change", "gpu": 0, "pci": "0000:3b:00.0", "change": "NVLink CRC errors +7 on GPU 0 (0000:3b:00.0)" }))
        .analyze();
    let sigs: Vec<&str> = r.suspects.iter().map(|f| f.signal).collect();
    assert!(
        sigs.contains(&"ecc_uncorrected")
            && sigs.contains(&"gpu_remap_pending")
            && sigs.contains(&"nvlink_errors"),
        "{sigs:?}"
    );
    assert!(r.machine, "{}", r.verdict);
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
    assert!(
        top(&a)
            .text
            .starts_with("loss scale fell from 65536 to 0.5"),
        "{}",
        top(&a).text
    );
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
    let xids: Vec<&Finding> = a
        .suspects
        .iter()
        .filter(|f| f.text.contains("Xid 48"))
        .collect();
    assert_eq!(xids.len(), 1, "{:?}", a.suspects);
    assert!(
        xids[0]
            .text
            .contains("[two witnesses: kernel log and NVML]"),
        "{}",
        xids[0].text
    );
    assert!(
        xids[0].touches_job,
        "0000:3b:00.0 is the job's GPU (CUDA_VISIBLE_DEVICES=0)"
    );
    // NVML alone still names it.
    let b = Scenario::healthy()
        .with(json!({ "offset_s": -5.9, "source": "nvml_xid", "xid": 79, "pci": "0000:3b:00.0" }))
        .analyze();
    assert_eq!(top(&b).signal, "gpu_fallen_off_bus");
    assert!(top(&b).text.contains("(NVML event)"));
}

/// A job output line as the session records it (the real reader: scanner + classifier).
pub(super) fn job_line(t: f64, line: &str) -> Value {
    let mut r = crate::session::LineReader::new(crate::nanscan::Scanner::default());
    let l = r.read(line);
    let mut e = json!({ "offset_s": t, "source": "log", "pid": ROOT, "job": true, "line": line });
    if let Some(f) = &l.fault {
        e["fault"] = serde_json::to_value(f).unwrap();
    }
    e
}

#[test]
fn the_issue_9_job_gets_a_gpu_verdict_not_not_the_machine() {
    let a = Scenario::healthy()
        .with(job_line(-9.0, "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered"))
        .with(job_line(-5.0, "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."))
        .with(job_line(-4.0, "node7:311:402 [0] NCCL WARN NET/IB : Got completion from peer 10.0.3.9<52431> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.3.7"))
        .analyze();
    assert!(a.machine);
    // The job's words alone: at most POSSIBLY, and the family says whose words they are.
    assert_eq!(a.family, "GPU (job's words only)");
    assert!(a.verdict.starts_with("POSSIBLY THE MACHINE (GPU), in the job's own words only: job output: uncorrectable ECC error (cudaErrorECCUncorrectable (214))"), "{}", a.verdict);
    assert_eq!(top(&a).signal, "joblog_gpu_hw");
    assert!(top(&a).text.contains("rank 1"), "{}", top(&a).text);
    let net = a
        .suspects
        .iter()
        .find(|s| s.signal == "joblog_network")
        .expect("the IB error is a suspect");
    assert!(
        net.text
            .contains("ibv status 12 (transport retry counter exceeded"),
        "{}",
        net.text
    );
    let hang = a
        .suspects
        .iter()
        .find(|s| s.signal == "joblog_hang")
        .expect("the hang is listed");
    assert!(
        // After the ECC error, the hang is its consequence, not a pointer at the network.
        hang.text.contains("ALLREDUCE SeqNum=812")
            && hang
                .text
                .contains("after the job's first failure, uncorrectable ECC error on rank 1")
            && !hang.text.contains("points at the network"),
        "{}",
        hang.text
    );
}

#[test]
fn each_machine_family_of_job_output_names_its_family() {
    for (line, family, signal) in [
        ("RuntimeError: DataLoader worker (pid 4412) is killed by signal: Killed.", "host memory", "joblog_host_memory"),
        ("OSError: [Errno 5] Input/output error: '/mnt/lustre/shards/train-00017.tar'", "storage", "joblog_storage"),
        ("misc/ibvwrap.cc:252 NCCL WARN Call to ibv_modify_qp failed with error Connection timed out", "network", "joblog_network"),
        ("RuntimeError: CUDA error: unspecified launch failure", "GPU", "joblog_gpu_hw"),
    ] {
        let a = Scenario::healthy().with(job_line(-2.0, line)).analyze();
        assert_eq!((a.family.as_str(), top(&a).signal), (format!("{family} (job's words only)").as_str(), signal), "{line}: {}", a.verdict);
        assert!(a.verdict.starts_with(&format!("POSSIBLY THE MACHINE ({family}), in the job's own words only: ")), "{}", a.verdict);
    }
}

#[test]
fn software_and_gpu_memory_limits_never_blame_the_machine() {
    for (line, family) in [
        ("RuntimeError: CUDA error: device-side assert triggered", "software/configuration"),
        ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x512 and 256x10)", "software/configuration"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.2 GiB is free.", "GPU memory limit"),
    ] {
        let a = Scenario::healthy().with(job_line(-1.0, line)).analyze();
        assert!(!a.machine, "{line}: {:?}", a.suspects);
        assert_eq!(a.family, family);
        assert!(a.verdict.starts_with(&format!("NOT THE MACHINE ({family})")), "{}", a.verdict);
    }
}

#[test]
fn an_ambiguous_gpu_fault_with_a_hardware_xid_is_hardware_and_with_xid_13_stays_ambiguous() {
    let hw = Scenario::healthy()
        .with(kmsg(-3.0, "NVRM: Xid (PCI:0000:3b:00): 95, pid=4242, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No"))
        .with(job_line(-1.0, "RuntimeError: CUDA error: an illegal memory access was encountered"))
        .analyze();
    assert_eq!(
        top(&hw).signal,
        "joblog_gpu_corroborated",
        "{:?}",
        hw.suspects
    );
    assert!(
        top(&hw).text.contains("with Xid 95")
            && top(&hw).text.ends_with("1.0 s before the first NaN"),
        "{}",
        top(&hw).text
    );
    let app = Scenario::healthy()
        .with(kmsg(-3.0, "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address"))
        .with(job_line(-1.0, "RuntimeError: CUDA error: an illegal memory access was encountered"))
        .analyze();
    let amb = app
        .suspects
        .iter()
        .find(|s| s.signal == "joblog_gpu_ambiguous")
        .expect("ambiguous GPU finding");
    assert!(
        amb.text
            .contains("Xid 13 on 0000:3b:00.0 confirms a GPU fault"),
        "{}",
        amb.text
    );
}

#[test]
fn a_hang_alone_is_undecided_and_generic_lines_give_way_to_specific_ones() {
    let a = Scenario::healthy()
        .with(job_line(-1.0, "[rank3]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 3] Heartbeat monitor timed out! Process will be terminated after dumping debug info."))
        .analyze();
    assert!(
        a.verdict.starts_with("UNDECIDED (collective hang)"),
        "{}",
        a.verdict
    );
    let b = Scenario::healthy()
        .with(job_line(-2.0, "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5"))
        .with(job_line(-2.0, "node1:88:88 [0] misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-Gx1T to 9637892 bytes"))
        .analyze();
    assert_eq!(top(&b).signal, "joblog_host_memory", "{:?}", b.suspects);
    assert!(
        !b.suspects
            .iter()
            .any(|s| s.signal == "joblog_network_generic"),
        "{:?}",
        b.suspects
    );
}

/// One node's eight ranks hung in one collective: their own counters say which rank never
/// enqueued it (rank 5), and the node's verdict names it; two ranks on one collective with
/// different operations are the job's code.
#[test]
fn a_nodes_ranks_counters_name_the_rank_that_stopped() {
    let mut s = Scenario::healthy();
    for r in 0..8 {
        let line = if r == 5 {
            // Nothing in flight, so no timeout of its own: it dumps on rank 0's signal.
            "[rank5]:[E1202 04:54:04.0 ProcessGroupNCCL.cpp:1590] [PG ID 0 PG GUID 0(default_pg) Rank 5] Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL work: 41.".to_string()
        } else {
            format!("[rank{r}]:[E1202 04:54:03.1 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank {r}] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.")
        };
        s = s.with(job_line(-1.0 + f64::from(r) * 0.01, &line));
    }
    let a = s.analyze();
    assert!(
        a.verdict.starts_with(
            "NOT THE MACHINE (software/configuration), most likely: rank 5 stopped first: it never enqueued collective 42 (PG 0)"
        ),
        "{}",
        a.verdict
    );
    assert!(a.verdict.contains("py-spy dump --pid"), "{}", a.verdict);
    let b = Scenario::healthy()
        .with(job_line(-1.0, "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."))
        .with(job_line(-1.0, "[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=2048, NumelOut=2048, Timeout(ms)=600000) ran for 600013 milliseconds before timing out."))
        .analyze();
    assert!(
        b.verdict.starts_with(
            "NOT THE MACHINE (software/configuration): the ranks disagree on collective 9"
        ),
        "{}",
        b.verdict
    );
}

/// A thread in D state at the trigger is read only in a hang: at a NaN a DataLoader worker
/// reading a network filesystem is no finding; with the ranks' watchdog lines it is
/// storage, at most POSSIBLY; and it never lifts the job's own words to PROBABLY (a user's
/// FUSE daemon can hold a thread in D state).
#[test]
fn a_thread_blocked_on_storage_counts_in_a_hang_only_and_never_lifts_the_jobs_words() {
    let blocked = json!({ "gap_ms": 300, "processes": [{ "pid": 4300, "rank": 0, "rank_main": false, "comm": "pt_data_worker", "io": { "read_bytes": [4096, 4096], "write_bytes": [0, 0] }, "threads": [{ "tid": 4300, "comm": "pt_data_worker", "state": ["D", "D"], "wchan": ["nfs_wait_bit_killable", "nfs_wait_bit_killable"], "kernel_stack": ["nfs_wait_bit_killable", "nfs_readpage"] }] }] });
    let mut s = Scenario::healthy();
    s.snapshot["stacks"] = blocked.clone();
    let a = s.analyze();
    assert!(
        !a.suspects
            .iter()
            .any(|f| f.signal == "rank_blocked_storage"),
        "at a NaN: {:?}",
        a.suspects
    );
    let mut s = Scenario::healthy().with(job_line(-1.0, "[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600659 milliseconds before timing out."));
    s.snapshot["stacks"] = blocked.clone();
    let a = s.analyze();
    assert!(
        a.verdict
            .starts_with("POSSIBLY THE MACHINE (storage, weak signals only): a process of rank 0 (pid 4300, pt_data_worker: a worker): main thread in D state in nfs_wait_bit_killable"),
        "{}",
        a.verdict
    );
    let mut s = Scenario::healthy()
        .with(job_line(-1.0, "[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600659 milliseconds before timing out."))
        .with(job_line(-2.0, "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered"));
    s.snapshot["stacks"] = blocked;
    let a = s.analyze();
    assert!(
        a.verdict
            .starts_with("POSSIBLY THE MACHINE (GPU), in the job's own words only"),
        "{}",
        a.verdict
    );
}

#[test]
fn a_process_named_like_a_kernel_message_forges_nothing() {
    // Redteam 3.5: a uid-65534 process renamed `EDAC MC0: 1 UE` crashes.
    let a = Scenario::healthy().with(kmsg(-2.0, "EDAC MC0: 1 UE[20803]: segfault at 0 ip 000055d0c0a0113d sp 00007ffd3b1c0a20 error 6 in spoof[55d0c0a01000+1000]")).analyze();
    assert!(a.suspects.is_empty(), "{:?}", a.suspects);
    let b = Scenario::healthy().with(kmsg(-2.0, "x Link is Down[777]: segfault at 0 ip 0000000000401000 sp 00007ffc00000000 error 4 in spoof[401000+1000]")).analyze();
    assert!(b.suspects.is_empty(), "{:?}", b.suspects);
}

#[test]
fn a_helper_exit_and_the_jobs_own_crash_are_not_the_machine() {
    // Redteam 6.12: `grep -q` exits 1 a few ms after its fork.
    let a = Scenario::healthy()
        .with(json!({ "offset_s": -3.010, "source": "fork", "pid": ROOT, "child_pid": 5001, "job": true }))
        .with(json!({ "offset_s": -3.002, "source": "exit", "pid": 5001, "comm": "grep", "exit_code": 1, "job": true }))
        .analyze();
    assert!(a.suspects.is_empty(), "{:?}", a.suspects);
    // Redteam 6.9/6.10: a SIGSEGV the job raised itself is a software crash.
    let b = Scenario::healthy().with(json!({ "offset_s": -0.5, "source": "signal", "signal": "SIGSEGV", "target_pid": ROOT, "target_comm": "python3", "pid": ROOT, "comm": "python3", "job": true })).analyze();
    assert!(!b.machine, "{}", b.verdict);
    assert_eq!(top(&b).signal, "job_crash");
}

#[test]
fn a_single_corrected_aer_is_not_a_burst() {
    let a = Scenario::healthy().with(kmsg(-30.0, "pcieport 0000:3a:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)")).analyze();
    assert!(a.suspects.is_empty(), "{:?}", a.suspects);
}

#[test]
fn an_ib_port_coming_back_up_is_not_a_link_down() {
    let a = Scenario::healthy().with(json!({ "offset_s": -10.0, "source": "net_change", "link": "ib/mlx5_0/1", "change": "ib/mlx5_0/1: state 1: DOWN / 3: Disabled -> 4: ACTIVE / 5: LinkUp" })).analyze();
    assert!(a.suspects.is_empty(), "{:?}", a.suspects);
    let b = Scenario::healthy().with(json!({ "offset_s": -10.0, "source": "net_change", "link": "ib/mlx5_0/1", "change": "ib/mlx5_0/1: state 4: ACTIVE / 5: LinkUp -> 1: DOWN / 5: LinkUp" })).analyze();
    assert_eq!(top(&b).signal, "ib_link_down");
}

#[test]
fn without_probes_or_nvml_the_report_cannot_tell() {
    let mut s = Scenario::healthy();
    s.snapshot = json!({ "gpu": { "available": false, "reason": "NVML not found" } });
    let mut evs = s.events.clone();
    evs.sort_by(|a, b| {
        a["offset_s"]
            .as_f64()
            .unwrap()
            .total_cmp(&b["offset_s"].as_f64().unwrap())
    });
    let t = json!({ "first_nan": { "offset_s": 0.0 }, "trigger": { "kind": "nan" }, "window": { "pre_s": 600.0 }, "accounting": { "probes_attached": [], "probes_error": "not root" }, "events": evs });
    let a = analyze(&t, &s.snapshot);
    assert!(a.verdict.starts_with("CANNOT TELL"), "{}", a.verdict);
}

#[test]
fn an_evicted_class_makes_the_window_incomplete() {
    let mut s = Scenario::healthy();
    s.events
        .push(json!({ "offset_s": -1.0, "source": "system" }));
    let mut evs = s.events.clone();
    evs.sort_by(|a, b| {
        a["offset_s"]
            .as_f64()
            .unwrap()
            .total_cmp(&b["offset_s"].as_f64().unwrap())
    });
    let t = json!({ "first_nan": { "offset_s": 0.0 }, "trigger": { "kind": "nan" }, "window": { "pre_s": 600.0 }, "accounting": { "probes_attached": ["printk:console"], "recorder": { "evicted_by_memory_per_source": { "xid": 3, "log": 100 } } }, "events": evs });
    let a = analyze(&t, &s.snapshot);
    assert!(
        a.verdict.contains("INCOMPLETE: xid ×3 evicted"),
        "{}",
        a.verdict
    );
    assert!(!a.verdict.contains("10 minutes"), "{}", a.verdict);
}

/// redteam4 D-6: the incident history implicates a GPU on its hardware's faults only: an Xid
/// NVIDIA lists as possibly the application's (13, 31, 43) is not one; an Xid 79 is.
#[test]
fn only_hardware_faults_implicate_a_gpu_in_the_history() {
    let s = Scenario::healthy();
    let snap = s.snapshot.clone();
    let a = s.with(kmsg(-2.0, "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address")).analyze();
    assert!(a.suspects.iter().any(|f| f.signal == "xid_app_possible"));
    assert!(super::implicated_gpus(&a, &snap).is_empty());
    let a = Scenario::healthy()
        .with(kmsg(
            -2.0,
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.",
        ))
        .analyze();
    assert_eq!(
        super::implicated_gpus(&a, &snap)
            .into_iter()
            .map(|g| g.0)
            .collect::<Vec<_>>(),
        ["0000:3b:00.0"]
    );
}

#[test]
fn an_xid_nvidia_lists_as_possibly_the_applications_says_so() {
    let a = Scenario::healthy().with(kmsg(-2.0, "NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python3, Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2d_1a000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ")).analyze();
    assert_eq!(top(&a).signal, "xid_app_possible");
    assert!(
        a.verdict
            .starts_with("POSSIBLY THE MACHINE (GPU, or the job's own code): Xid 31"),
        "{}",
        a.verdict
    );
    // A hardware Xid stays PROBABLY.
    let b = Scenario::healthy().with(kmsg(-2.0, "NVRM: Xid (PCI:0000:3b:00): 94, pid=4242, name=python3, Contained: SM (0x1). RST: No, D-RST: No")).analyze();
    assert!(
        b.verdict.starts_with("PROBABLY THE MACHINE (GPU): Xid 94"),
        "{}",
        b.verdict
    );
}

#[test]
fn a_device_side_assert_explains_the_xid_43_that_follows_it() {
    // As recorded on a real H200: an out-of-range index, the driver's Xid 43 (kernel line and
    // NVML event), then PyTorch's device-side assert error.
    let a = Scenario::healthy()
        .with(kmsg(-0.469, "NVRM: Xid (PCI:0000:00:06): 43, pid=542, name=python3, channel 0x0000000a"))
        .with(json!({ "offset_s": -0.466, "source": "nvml_xid", "xid": 43, "pci": "0000:00:06.0", "witness": "nvml" }))
        .with(job_line(-0.2, "torch.AcceleratorError: CUDA error: device-side assert triggered"))
        .analyze();
    assert!(
        !a.machine
            || a.verdict
                .starts_with("NOT THE MACHINE (software/configuration)"),
        "{}",
        a.verdict
    );
    assert!(
        a.verdict.starts_with(
            "NOT THE MACHINE (software/configuration): job output: device-side assert"
        ),
        "{}",
        a.verdict
    );
    // The same assert next to an Xid 31 (possibly the application's): still the job's bug.
    let b = Scenario::healthy()
        .with(kmsg(-1.0, "NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python3, channel 0x0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS"))
        .with(job_line(-0.5, "RuntimeError: CUDA error: device-side assert triggered"))
        .analyze();
    assert!(
        b.verdict
            .starts_with("NOT THE MACHINE (software/configuration)"),
        "{}",
        b.verdict
    );
    assert!(
        b.verdict
            .contains("the GPU fault next to it follows from it: Xid 31"),
        "{}",
        b.verdict
    );
    // But a hardware Xid is not explained away.
    let c = Scenario::healthy()
        .with(kmsg(-1.0, "NVRM: Xid (PCI:0000:3b:00): 48, pid=4242, name=python3, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."))
        .with(job_line(-0.5, "RuntimeError: CUDA error: device-side assert triggered"))
        .analyze();
    assert!(
        c.verdict.starts_with("PROBABLY THE MACHINE (GPU)"),
        "{}",
        c.verdict
    );
}

#[test]
fn a_crash_after_a_gpu_fault_does_not_explain_it_and_outside_kills_are_outside() {
    // The abort that follows an illegal address is its consequence.
    let a = Scenario::healthy()
        .with(job_line(
            -1.0,
            "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered",
        ))
        .with(job_line(-0.9, "Fatal Python error: Aborted"))
        .analyze();
    assert!(
        a.verdict
            .starts_with("POSSIBLY THE MACHINE (GPU, or the job's own code)"),
        "{}",
        a.verdict
    );
    // kill -SEGV from outside the job (si_code 0, sender not a job process, though the event's
    // `job` flag says the target is one): a fatal signal from outside, not the job's crash.
    let b = Scenario::healthy()
        .with(json!({ "offset_s": -0.5, "source": "signal", "signal": "SIGSEGV", "si_code": 0, "target_pid": ROOT, "target_comm": "python3", "pid": 999_999, "comm": "kill", "job": true }))
        .analyze();
    assert_eq!(top(&b).signal, "job_fatal_signal", "{:?}", b.suspects);
    // A SIGKILL from outside: the job's `exitcode : -9` is that kill, not the OOM killer.
    let c = Scenario::healthy()
        .with(json!({ "offset_s": -0.5, "source": "signal", "signal": "SIGKILL", "si_code": 0, "target_pid": ROOT, "target_comm": "python3", "pid": 999_998, "comm": "kill", "job": true }))
        .with(job_line(-0.2, "    exitcode  : -9 (pid: 4242)"))
        .analyze();
    assert!(
        !c.suspects.iter().any(|s| s.signal == "joblog_host_memory"),
        "{:?}",
        c.suspects
    );
    assert_eq!(top(&c).signal, "job_fatal_signal");
    // A real fault (si_code > 0) in a job process is its own crash.
    let d = Scenario::healthy().with(json!({ "offset_s": -0.5, "source": "signal", "signal": "SIGSEGV", "si_code": 1, "target_pid": ROOT, "target_comm": "python3", "pid": ROOT, "comm": "python3", "job": true })).analyze();
    assert_eq!(top(&d).signal, "job_crash");
}

#[test]
fn a_gpucheck_disagreement_is_the_top_suspect_and_a_clean_one_is_said() {
    let gpu = |i: u32, fp: &str, mism: Value| {
        json!({ "index": i, "name": "NVIDIA H200", "pci": format!("0000:{:02x}:00.0", i),
        "compute": { "fp16": { "reps": 20, "fingerprint": fp, "mismatching_reps": mism, "seconds": 1.0 } },
        "memory": { "bytes_tested": 1u64 << 30, "patterns": [{ "pattern": "address", "errors": 0 }], "seconds": 1.0 } })
    };
    let mut s = Scenario::healthy();
    s.snapshot["gpucheck"] = json!({ "schema": crate::bundle::GPUCHECK_SCHEMA, "gpus": [gpu(0, "aa", json!([])), gpu(1, "aa", json!([])), gpu(2, "bb", json!([{ "rep": 3, "first_index": 7, "want_bits": "0x3c00", "got_bits": "0x3c01" }]))] });
    let a = s.analyze();
    assert_eq!(top(&a).signal, "gpucheck_mismatch");
    assert!(
        a.verdict
            .starts_with("PROBABLY THE MACHINE (GPU): nantrace gpucheck after the incident: GPU 2"),
        "{}",
        a.verdict
    );
    let mut c = Scenario::healthy();
    c.snapshot["gpucheck"] = json!({ "schema": crate::bundle::GPUCHECK_SCHEMA, "gpus": [gpu(0, "aa", json!([])), gpu(1, "aa", json!([]))] });
    let b = c.analyze();
    assert!(
        b.verdict.starts_with("NOT THE MACHINE")
            && b.verdict.contains("2 GPU(s) computed bit-identical"),
        "{}",
        b.verdict
    );
    // A GPU another process still used was not checked: said, not a suspect, not "clean".
    let mut d = Scenario::healthy();
    d.snapshot["gpucheck"] = json!({ "schema": crate::bundle::GPUCHECK_SCHEMA, "gpus": [gpu(0, "aa", json!([])), { "index": 1, "name": "NVIDIA H200", "pci": "0000:01:00.0", "skipped": "busy: python3 4242 compute(s) on it; not checked while another process uses the GPU" }] });
    let e = d.analyze();
    assert!(
        e.suspects.iter().all(|s| s.signal != "gpucheck_mismatch"),
        "{:?}",
        e.suspects
    );
    assert!(
        e.verdict.contains("1 GPU(s) computed bit-identical")
            && e.verdict.contains("GPU 1 (0000:01:00.0) not checked: busy"),
        "{}",
        e.verdict
    );
    let mut m = Scenario::healthy();
    m.snapshot["gpucheck"] = json!({ "schema": crate::bundle::GPUCHECK_SCHEMA, "gpus": [{ "index": 0, "name": "NVIDIA H200", "pci": "0000:00:00.0", "skipped": "MIG mode is on: the check tests whole GPUs" }] });
    let n = m.analyze();
    assert!(
        n.verdict
            .contains("tested no GPU: GPU 0 (0000:00:00.0) not checked: MIG mode is on")
            && n.verdict
                .contains("run `nantrace gpucheck --bundle BUNDLE`"),
        "{}",
        n.verdict
    );
}

#[test]
fn nvml_remapped_rows_pending_or_failed_are_suspects() {
    let mut s = Scenario::healthy();
    s.snapshot["gpu"]["devices"][0]["remapped_rows"] =
        json!({ "correctable": 0, "uncorrectable": 2, "pending": true, "failure_occurred": false });
    let a = s.analyze();
    assert_eq!(top(&a).signal, "gpu_remap_pending");
    assert!(
        top(&a).touches_job
            && top(&a)
                .text
                .starts_with("rows of 0000:3b:00.0 wait for a GPU reset"),
        "{}",
        top(&a).text
    );
    let mut f = Scenario::healthy();
    f.snapshot["gpu"]["devices"][1]["remapped_rows"] =
        json!({ "correctable": 0, "uncorrectable": 9, "pending": false, "failure_occurred": true });
    assert_eq!(top(&f.analyze()).signal, "gpu_remap_failure");
    // An H200 as recorded: nothing pending.
    let mut ok = Scenario::healthy();
    ok.snapshot["gpu"]["devices"][0]["remapped_rows"] = json!({ "correctable": 0, "uncorrectable": 0, "pending": false, "failure_occurred": false });
    assert!(ok.analyze().suspects.is_empty());
}
