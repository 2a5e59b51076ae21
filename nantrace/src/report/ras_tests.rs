//! NCCL RAS's view in the node report: named in a hang, with the verdict's words, never the
//! machine; not read at a NaN; said in what was checked, also when RAS could not be asked.
use super::*;

/// RAS's text answer (NCCL 2.26+'s format strings): rank 5's process dead, rank 2 an AllReduce
/// behind.
const RAS_TEXT: &str = "NCCL version 2.26.2+cuda12.8 compiled with CUDA 12.8\nCUDA runtime version 12080, driver version 12080\n\nJob summary\n===========\n\n  Nodes  Processes         GPUs  Processes     GPUs\n(total)   per node  per process    (total)  (total)\n      2          4            1          8        8\n\nCommunicators... (2.013s)\n=============\n\nGroup     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n    0         1         2       3-4         8         8   RUNNING  INCOMPLETE,MISMATCH\n\nErrors\n======\n\nDEAD\n  1 job process is considered dead (unreachable via the RAS network)\n  Process 4125 on node 10.0.0.2 managing GPU 1\n\n#0-0 (27a079b828ff1a75) INCOMPLETE\n  Missing communicator data from 1 rank\n  Rank 5 -- GPU 1 managed by process 4125 on node 10.0.0.2\n\nWarnings\n========\n\n#0-0 (27a079b828ff1a75) MISMATCH\n  Communicator ranks have different AllReduce operation counts\n  6 ranks have launched up to operation 42\n  Rank 2 has launched up to operation 41 -- GPU 2 managed by process 4012 on node 10.0.0.1\n\n";

fn ras_section() -> Value {
    let view = crate::collect::nccl_ras::from_text(RAS_TEXT);
    json!({ "pid": 4010, "rank": 0, "address": "127.0.0.1:28028", "format": "text", "output_bytes": RAS_TEXT.len(), "view": view })
}

/// A node whose job hung: rank 0's watchdog line (or the stall trigger), NVML and the kernel
/// log watched, nothing on the machine.
fn hung(stall: bool, ras: Option<Value>) -> Analysis {
    let mut events = vec![
        json!({ "offset_s": -30.0, "source": "log", "pid": tests::ROOT, "job": true, "line": "step 99 | loss 1.234", "step": 99, "loss": 1.234 }),
    ];
    if !stall {
        let line = "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.";
        events.push(tests::job_line(-1.0, line));
    }
    let t = json!({
        "schema": crate::bundle::SCHEMA,
        "trigger": if stall { json!({ "kind": "stall", "reason": "no training step for 300 s", "time": "2026-12-03T10:00:00Z" }) } else { json!({ "kind": "job-error", "time": "2026-12-03T10:00:00Z" }) },
        "job": { "root_pid": tests::ROOT },
        "events": events,
        "accounting": { "probes_attached": ["printk:console"] },
    });
    let mut snap = json!({ "gpu": { "available": true, "device_count": 8, "devices": [] } });
    if let Some(r) = ras {
        snap["nccl_ras"] = r;
    }
    analyze(&t, &snap)
}

#[test]
fn a_hang_names_the_ranks_ras_finds_dead_and_behind_and_never_the_machine() {
    let a = hung(false, Some(ras_section()));
    let f = a
        .suspects
        .iter()
        .find(|s| s.signal == "nccl_ras_ranks")
        .unwrap_or_else(|| panic!("{:#?}", a.suspects));
    assert_eq!(f.family, rules::Family::Hang);
    assert!(f.text.starts_with("NCCL RAS at the trigger (the job's own view, asked through pid 4010): communicator 27a079b828ff1a75 (8 ranks, RUNNING) INCOMPLETE,MISMATCH: rank 5 DEAD: unreachable over RAS for 60 s (process 4125 on 10.0.0.2, GPU 1); rank 2 MISMATCH: launched 41 AllReduce operations where most launched 42: behind (process 4012 on 10.0.0.1, GPU 2): where the job's own NCCL sees the hang, not machine evidence"), "{}", f.text);
    assert!(!a.machine, "{}", a.verdict);
    assert!(
        a.verdict.starts_with("UNDECIDED (collective hang): "),
        "{}",
        a.verdict
    );
    assert!(a.verdict.contains("; NCCL RAS at the trigger (the job's own view): rank 5 DEAD: unreachable over RAS for 60 s (process 4125 on 10.0.0.2, GPU 1); rank 2 MISMATCH: launched 41 AllReduce operations where most launched 42: behind (process 4012 on 10.0.0.1, GPU 2) (a dead process is its job's or its node's: read the bundle of 10.0.0.2)."), "{}", a.verdict);
    let said = format!("NCCL RAS at the trigger (text format, {} bytes): NCCL 2.26.2+cuda12.8, 1 communicator(s), 8 rank(s); 2 rank issue(s), 0 process(es) without an answer, 1 dead", RAS_TEXT.len());
    assert!(a.checked.contains(&said), "{:#?}", a.checked);
}

#[test]
fn a_stall_says_where_the_ranks_stood_and_what_ras_saw() {
    let a = hung(true, Some(ras_section()));
    assert!(a.verdict.starts_with("UNDECIDED (collective hang): the job stopped making progress (no training step for 300 s)"), "{}", a.verdict);
    assert!(
        a.verdict
            .contains("NCCL RAS at the trigger (the job's own view): rank 5 DEAD"),
        "{}",
        a.verdict
    );
    assert!(!a.machine);
}

#[test]
fn at_a_nan_or_without_the_section_ras_is_no_finding() {
    let mut s = tests::Scenario::healthy();
    s.snapshot["nccl_ras"] = ras_section();
    let a = s.analyze();
    assert!(
        a.suspects.iter().all(|f| f.signal != "nccl_ras_ranks"),
        "{:#?}",
        a.suspects
    );
    // A bundle from before RAS was asked: no word of it.
    let a = hung(false, None);
    assert!(a.suspects.iter().all(|f| f.signal != "nccl_ras_ranks"));
    assert!(
        a.checked.iter().all(|c| !c.contains("NCCL RAS")),
        "{:#?}",
        a.checked
    );
    assert!(!a.verdict.contains("NCCL RAS"), "{}", a.verdict);
}

#[test]
fn ras_out_of_reach_or_all_well_is_said() {
    let a = hung(
        false,
        Some(
            json!({ "pid": 4010, "not_reachable": "127.0.0.1:28028: Connection refused (os error 111); [::1]:28028: Connection refused (os error 111): no NCCL >= 2.24 process of the job listens there" }),
        ),
    );
    assert!(
        a.checked.iter().any(|c| c.starts_with(
            "NCCL RAS at the trigger: not reachable: 127.0.0.1:28028: Connection refused"
        )),
        "{:#?}",
        a.checked
    );
    assert!(a.suspects.iter().all(|f| f.signal != "nccl_ras_ranks"));
    let ok = "Communicators... (0.004s)\n=============\n\nGroup     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n    0         1         2         4         8         8   RUNNING      OK\n\nErrors\n======\n\nWarnings\n========\n\n";
    let view = crate::collect::nccl_ras::from_text(ok);
    let a = hung(
        false,
        Some(json!({ "format": "text", "output_bytes": ok.len(), "view": view })),
    );
    assert!(
        a.verdict
            .contains("; NCCL RAS at the trigger: every rank of 1 communicator OK"),
        "{}",
        a.verdict
    );
}
