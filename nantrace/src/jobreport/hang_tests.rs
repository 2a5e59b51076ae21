//! A hung collective across nodes: every rank's watchdog fires, the ranks' counters say which
//! one stopped, and the job report names its rank and node (never "the model side").
use serde_json::{json, Value};

use super::scale_tests::report;
use super::tests::{at, healthy, node};

/// A line of the job's output, classified as the session does.
pub(super) fn line(t: f64, text: &str) -> Value {
    let mut l = json!({ "time": at(t), "source": "log", "pid": 100, "job": true, "line": text });
    if let Some(f) = crate::joblog::classify(text) {
        l["fault"] = serde_json::to_value(f).unwrap();
    }
    l
}

const R0: &str = "[rank0]:[E1202 04:54:03.100 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 0] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.";
const R0_TIMEOUT: &str = "[rank0]:[E1202 04:54:03.090 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.";
const R1: &str = "[rank1]:[E1202 04:54:04.000 ProcessGroupNCCL.cpp:1590] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL work: 41.This is most likely caused by incorrect usages of collectives, e.g., wrong sizes used across ranks, the order of collectives is not same for all ranks or the scheduled collective, for some reason, didn't run. Additionally, this can be caused by GIL deadlock or other reasons such as network errors or bugs in the communications library (e.g. NCCL), etc.";
const R2: &str = "[rank2]:[E1202 04:54:03.200 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 2] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.";
const R2_TIMEOUT: &str = "[rank2]:[E1202 04:54:03.190 ProcessGroupNCCL.cpp:632] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600035 milliseconds before timing out.";

fn ranks(n: &mut super::Node, rank: u64) {
    n.timeline["job"]["identity"] = json!({ "kind": "slurm", "job_id": "4711", "distributed": { "launcher": "torch", "world_size": 3, "ranks": [{ "pid": 100, "rank": rank }] } });
}

/// The three nodes: ranks 0 and 2 wait in collective 42, rank 1 on n2 never
/// enqueued it. Before: "NOT THE MACHINE ... 3 nodes alike ... Look at the model side".
#[test]
fn the_rank_that_never_enqueued_the_collective_is_named_with_its_node() {
    let n1 = node(
        "n1",
        [
            healthy("n1", true),
            vec![line(-0.2, R0_TIMEOUT), line(-0.1, R0)],
        ]
        .concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let n2 = node(
        "n2",
        [healthy("n2", false), vec![line(0.8, R1)]].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let n3 = node(
        "n3",
        [
            healthy("n3", false),
            vec![line(-0.1, R2_TIMEOUT), line(0.0, R2)],
        ]
        .concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let r = report(vec![n1, n2, n3]);
    assert!(
        r.verdict.starts_with("NOT THE MACHINE (software/configuration), most likely: rank 1 on n2 stopped first: it never enqueued collective 42 (ALLREDUCE, PG 0)"),
        "{}",
        r.verdict
    );
    assert!(
        r.verdict
            .contains("its last enqueued 41 while ranks 0, 2 wait in 42"),
        "{}",
        r.verdict
    );
    assert!(
        r.verdict.contains("Last enqueued NCCL work: 41"),
        "the evidence line: {}",
        r.verdict
    );
    assert!(!r.verdict.contains("model side"), "{}", r.verdict);
    assert_eq!(r.node.as_deref(), Some("n2"));
    assert_eq!(r.family, "software/configuration");
    // Every node's only words are hang lines: the differential test read n1 and n3 from
    // their summaries (n2, named, read whole again) and found the same report.
    assert_eq!(super::scale_tests::SUMMARISED.with(std::cell::Cell::get), 2);
    assert!(
        r.action
            .as_deref()
            .is_some_and(|a| a.contains("rank 1 on n2")),
        "{:?}",
        r.action
    );
}

/// srun's output on a shared filesystem: every node's agent read every rank's lines. The
/// node of each rank comes from the ranks each bundle says its processes are.
#[test]
fn with_every_line_in_every_bundle_the_ranks_own_node_is_named() {
    let all = || {
        vec![
            line(-0.2, R0_TIMEOUT),
            line(-0.1, R0),
            line(0.8, R1),
            line(-0.1, R2_TIMEOUT),
            line(0.0, R2),
        ]
    };
    let mut n1 = node(
        "n1",
        [healthy("n1", true), all()].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let mut n2 = node(
        "n2",
        [healthy("n2", false), all()].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let mut n3 = node(
        "n3",
        [healthy("n3", false), all()].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    ranks(&mut n1, 0);
    ranks(&mut n2, 1);
    ranks(&mut n3, 2);
    // n2's trigger caught rank 1's main process in Python, asleep (py-spy's frame).
    n2.snapshot["stacks"] = json!({ "gap_ms": 300, "processes": [{ "pid": 100, "rank": 1, "rank_main": true, "comm": "python3", "threads": [{ "tid": 100, "state": ["S", "S"], "wchan": ["hrtimer_nanosleep", "hrtimer_nanosleep"] }] }], "python": { "dumps": { "100": { "lines": ["Thread 100 (idle): \"MainThread\"", "    load_batch (data.py:88)", "    <module> (train.py:211)"] } } } });
    let r = report(vec![n3, n1, n2]);
    assert!(
        r.verdict.contains("at the trigger: rank 1 on n2, pid 100: main thread S in hrtimer_nanosleep, from data.py:88 load_batch"),
        "{}",
        r.verdict
    );
    assert!(
        r.verdict.starts_with(
            "NOT THE MACHINE (software/configuration), most likely: rank 1 on n2 stopped first"
        ),
        "{}",
        r.verdict
    );
    assert_eq!(r.node.as_deref(), Some("n2"));
}

/// Rank 1's node sent no bundle and its line is nowhere: ranks 0 and 2 timed out in 42, so
/// rank 1 (not in it) is named, but with a node missing (it may have died: no bundle, no
/// lines) the job's side is not claimed: UNDECIDED, and the report says it is incomplete.
/// Never a drain.
#[test]
fn a_silent_rank_on_a_node_without_a_bundle_is_named_and_the_report_incomplete() {
    let mut n1 = node(
        "n1",
        [
            healthy("n1", true),
            vec![line(-0.2, R0_TIMEOUT), line(-0.1, R0)],
        ]
        .concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let mut n3 = node(
        "n3",
        [
            healthy("n3", false),
            vec![line(-0.1, R2_TIMEOUT), line(0.0, R2)],
        ]
        .concat(),
        0.0,
        false,
        "n[1-3]",
    );
    ranks(&mut n1, 0);
    ranks(&mut n3, 2);
    let r = report(vec![n1, n3]);
    assert!(r.verdict.starts_with("UNDECIDED (collective hang): rank 1 printed nothing while the others waited in collective 42 (ALLREDUCE, PG 0) (ranks 0, 2 timed out waiting in it"), "{}", r.verdict);
    assert!(
        r.verdict.contains("INCOMPLETE: no bundle from n2"),
        "{}",
        r.verdict
    );
    assert!(!r.verdict.contains("model side"), "{}", r.verdict);
    assert!(
        !r.action.as_deref().unwrap_or("").contains("drain"),
        "{:?}",
        r.action
    );
}

/// Every rank waits in one collective and none is behind or silent: no rank is named, and the
/// report says so instead of "the model side".
#[test]
fn ranks_alike_in_a_hang_name_nobody_and_never_the_model_side() {
    let r1 = R0.replace("rank0", "rank1").replace("Rank 0", "Rank 1");
    let mut n1 = node(
        "n1",
        [healthy("n1", true), vec![line(-0.1, R0)]].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let mut n2 = node(
        "n2",
        [healthy("n2", false), vec![line(-0.1, &r1)]].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let mut n3 = node(
        "n3",
        [healthy("n3", false), vec![line(0.0, R2)]].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    ranks(&mut n1, 0);
    ranks(&mut n2, 1);
    ranks(&mut n3, 2);
    // Every node's trigger took its rank's stacks: rank 1 is the odd one out.
    let st = |pid: u64, rank: u32, state: &str, wchan: &str| json!({ "gap_ms": 300, "processes": [{ "pid": pid, "rank": rank, "rank_main": true, "threads": [{ "tid": pid, "state": [state, state], "wchan": [wchan, wchan] }] }] });
    n1.snapshot["stacks"] = st(100, 0, "S", "futex_wait_queue");
    n2.snapshot["stacks"] = st(100, 1, "S", "ep_poll");
    n3.snapshot["stacks"] = st(100, 2, "S", "futex_wait_queue");
    let r = report(vec![n1, n2, n3]);
    assert!(r.verdict.starts_with("UNDECIDED (collective hang): the lines name no lagging rank: ranks 0-2 enqueued collective 42 and none completed it"), "{}", r.verdict);
    assert!(!r.verdict.contains("model side"), "{}", r.verdict);
    assert!(
        r.verdict.contains("in 2 groups: ranks 0, 2 (n1, n3): main thread S in futex_wait_queue; rank 1 (n2): main thread S in ep_poll; outside the largest group: rank 1"),
        "{}",
        r.verdict
    );
    assert_eq!(r.node, None);
    assert_eq!(r.family, "collective hang");
}

/// A hang after the job's first NaN is what the NaN did: the NaN stays the answer.
#[test]
fn a_hang_after_the_nan_is_its_consequence() {
    let mut e1 = healthy("n1", true);
    e1.push(json!({ "time": at(0.0), "source": "log", "pid": 100, "job": true, "line": "step 300 | loss nan", "step": 300, "loss": "NaN", "nonfinite": true }));
    e1.extend([line(30.0, R0_TIMEOUT), line(30.1, R0)]);
    let n1 = node("n1", e1, 0.0, true, "n[1-2]");
    let n2 = node(
        "n2",
        [healthy("n2", false), vec![line(30.8, R1)]].concat(),
        0.0,
        false,
        "n[1-2]",
    );
    let r = report(vec![n1, n2]);
    assert!(!r.verdict.contains("stopped first"), "{}", r.verdict);
    assert!(r.verdict.starts_with("NOT THE MACHINE"), "{}", r.verdict);
}

/// NCCL RAS's view (the whole job's, asked at one node's trigger) goes with the hang's
/// answer in the job report: the dead rank it names, and on which node it was asked. The
/// text is NCCL's own format (see `report::ras_tests`).
#[test]
fn the_hang_says_what_nccl_ras_saw_and_where_it_was_asked() {
    let ras = "NCCL version 2.26.2+cuda12.8 compiled with CUDA 12.8\n\nJob summary\n===========\n\n  Nodes  Processes         GPUs  Processes     GPUs\n(total)   per node  per process    (total)  (total)\n      3          1            1          3        3\n\nCommunicators... (2.013s)\n=============\n\nGroup     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n    0         1         3         1         3         3   RUNNING  INCOMPLETE\n\nErrors\n======\n\nDEAD\n  1 job process is considered dead (unreachable via the RAS network)\n  Process 100 on node 10.0.0.2 managing GPU 0\n\n#0-0 (27a079b828ff1a75) INCOMPLETE\n  Missing communicator data from 1 rank\n  Rank 1 -- GPU 0 managed by process 100 on node 10.0.0.2\n\n";
    let section = json!({ "pid": 100, "format": "text", "output": ["(cut)"], "view": crate::collect::nccl_ras::from_text(ras) });
    let mut n1 = node(
        "n1",
        [
            healthy("n1", true),
            vec![line(-0.2, R0_TIMEOUT), line(-0.1, R0)],
        ]
        .concat(),
        0.0,
        false,
        "n[1-3]",
    );
    n1.snapshot["nccl_ras"] = section;
    let n2 = node(
        "n2",
        [healthy("n2", false), vec![line(0.8, R1)]].concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let n3 = node(
        "n3",
        [
            healthy("n3", false),
            vec![line(-0.1, R2_TIMEOUT), line(0.0, R2)],
        ]
        .concat(),
        0.0,
        false,
        "n[1-3]",
    );
    let mut nodes = vec![n1, n2, n3];
    ranks(&mut nodes[0], 0);
    ranks(&mut nodes[1], 1);
    ranks(&mut nodes[2], 2);
    let r = report(nodes);
    assert!(
        r.verdict.contains("rank 1 on n2 stopped first"),
        "{}",
        r.verdict
    );
    assert!(r.verdict.contains("NCCL RAS"), "{}", r.verdict);
    assert!(r.verdict.contains("DEAD"), "{}", r.verdict);
    assert!(r.verdict.contains("(asked on n1)"), "{}", r.verdict);
}

/// A watchdog line's `PG ID` is torch's local id, a Flight Recorder entry's `pg_id`; the
/// dumps' `pg_name` is the group's GUID. With a gloo group made first, the NCCL default
/// group's GUID and id differ from another group's: the ranks' table shows the hang's group's
/// collective (42), not the collective of the group whose GUID reads like the lines' id
/// (review: pg_name was compared with the lines' id).
#[test]
fn the_flight_recorder_columns_are_of_the_group_the_lines_name_by_its_id() {
    let entry = |pg_id: i64, guid: &str, seq: i64, op: &str, state: &str| json!({ "pg_id": pg_id, "pg_name": guid, "pg_desc": "", "collective_seq_id": seq, "profiling_name": op, "time_created_ns": 1_000 + seq, "state": state, "input_sizes": [], "input_dtypes": [], "output_sizes": [], "output_dtypes": [] });
    let section = |rank: u32| {
        let entries = vec![
            entry(0, "1", 41, "nccl:all_reduce", "completed"),
            entry(0, "1", 42, "nccl:all_reduce", "started"),
            entry(1, "0", 7, "nccl:broadcast", "completed"),
        ];
        json!({ "sources": [], "read": { "schema": crate::collect::flight::SCHEMA, "ranks_read": 1, "ranks": [{ "rank": rank, "pid": 100, "status": "read", "path": "/tmp/fr", "dump": { "version": "2.10", "entries_total": 3, "entries_not_kept": 0, "entries": entries } }] } })
    };
    let mut nodes = Vec::new();
    for (i, (name, lines)) in [
        ("n1", vec![line(-0.2, R0_TIMEOUT), line(-0.1, R0)]),
        ("n2", vec![line(0.8, R1)]),
        ("n3", vec![line(-0.1, R2_TIMEOUT), line(0.0, R2)]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut n = node(name, [healthy(name, i == 0), lines].concat(), 0.0, false, "n[1-3]");
        ranks(&mut n, i as u64);
        if i != 1 {
            n.snapshot["flight_recorder"] = section(i as u32);
        }
        nodes.push(n);
    }
    let r = report(nodes);
    assert!(r.verdict.contains("rank 1 on n2 stopped first"), "{}", r.verdict);
    let md = super::markdown(&r);
    let table = &md[md.find("## The hang: where each rank stood").expect(&md)..];
    for rank in [0, 2] {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("| {rank} |")))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(
            row.contains("| 42 nccl:all_reduce started | 41 |"),
            "rank {rank}: {row}"
        );
    }
}
