//! Which rank stopped, on torch's real line formats (tests/corpus and the cases).
use super::*;

fn j(lines: &[&str], world: Option<u32>) -> Hang {
    judge(lines.iter().map(|l| (None, *l)), world, None).expect("a hang")
}

/// The three nodes: ranks 0 and 2 wait in 42, rank 1 never enqueued it.
#[test]
fn a_rank_that_never_enqueued_the_collective_stopped_first() {
    let h = j(&[
        "[rank0]:[E1202 04:54:03.1 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 0] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.",
        "[rank2]:[E1202 04:54:03.2 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 2] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.",
        "[rank1]:[E1202 04:54:04.0 ProcessGroupNCCL.cpp:1590] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL work: 41.",
    ], Some(3));
    assert_eq!(h.kind, Kind::CpuSide);
    assert_eq!(h.ranks, vec![1]);
    assert_eq!(h.collective, Some(42));
    let s = h.sentence(&|r| (r == 1).then(|| "n2".to_string()));
    assert!(
        s.starts_with("rank 1 on n2 stopped first: it never enqueued collective 42 (PG 0)"),
        "{s}"
    );
    assert!(
        s.contains("its last enqueued 41 while ranks 0, 2 wait in 42"),
        "{s}"
    );
    assert!(s.contains("a strong hint, not proof"), "{s}");
}

#[test]
fn a_rank_whose_completed_lags_is_the_gpu_side() {
    let h = j(&[
        "[rank0]:[PG 0 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 10, last enqueued NCCL work: 10, last completed NCCL work: 9.",
        "[rank1]:[PG 0 Rank 1] Exception (either an error or timeout) detected by watchdog at work: 8, last enqueued NCCL work: 10, last completed NCCL work: 7.",
        "[rank2]:[PG 0 Rank 2] Exception (either an error or timeout) detected by watchdog at work: 10, last enqueued NCCL work: 10, last completed NCCL work: 9.",
    ], None);
    // Rank 1 timed out in 8 (the lowest): nobody is behind 8 in enqueueing; its
    // completed lags by two (one would be the watchdog's poll timing).
    assert_eq!(h.kind, Kind::GpuSide, "{h:?}");
    assert_eq!(h.ranks, vec![1]);
    assert_eq!(h.collective, Some(8));
}

#[test]
fn every_rank_at_minus_one_froze_before_the_first_collective() {
    let h = j(&[
        "[rank0]:[PG 0 Rank 0] Received a dump signal from this local rank and will start to dump the debug info. Last enqueued NCCL work: -1, last completed NCCL work: -1.",
        "[rank1]:[PG 0 Rank 1] Received a dump signal from this local rank and will start to dump the debug info. Last enqueued NCCL work: -1, last completed NCCL work: -1.",
    ], None);
    assert_eq!(h.kind, Kind::BeforeFirst);
}

#[test]
fn one_collective_of_two_kinds_is_the_jobs_code() {
    let h = j(&[
        "[rank0]:[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.",
        "[rank1]:[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600011 milliseconds before timing out.",
        "[rank2]:[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.",
    ], None);
    assert_eq!(h.kind, Kind::Mismatch);
    assert_eq!(h.ranks, vec![2]);
    let s = h.sentence(&|_| None);
    assert!(s.contains("rank 2 BROADCAST of 1024 elements"), "{s}");
}

/// tests/corpus/incidents/006.log: ranks 2 and 3 time out in 493, ranks 0 and 1 of four
/// print nothing: they were not in it (rank 0 was consolidating a checkpoint). With eight
/// ranks in the world and two seen, the lines are merely incomplete: nobody named.
#[test]
fn ranks_silent_while_the_others_wait_are_named_and_too_few_lines_name_nobody() {
    let lines = [
        "[rank2]:[E109 22:46:25.933527530 ProcessGroupNCCL.cpp:632] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=493, OpType=ALLGATHER, NumelIn=1, NumelOut=4, Timeout(ms)=60000) ran for 60044 milliseconds before timing out.",
        "[rank2]:[E109 22:46:25.933593122 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank 2]  failure detected by watchdog at work sequence id: 493 PG status: last enqueued work: 493, last completed work: 492",
        "[rank3]:[E109 22:46:25.936329218 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=493, OpType=ALLGATHER, NumelIn=1, NumelOut=4, Timeout(ms)=60000) ran for 60046 milliseconds before timing out.",
        "[rank3]:[E109 22:46:25.936370069 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank 3]  failure detected by watchdog at work sequence id: 493 PG status: last enqueued work: 493, last completed work: 492",
    ];
    for world in [Some(4), None] {
        let h = j(&lines, world);
        assert_eq!(h.kind, Kind::Silent, "{world:?}");
        assert_eq!(h.ranks, vec![0, 1]);
        let s = h.sentence(&|_| None);
        assert!(
            s.starts_with("ranks 0, 1 printed nothing while the others waited in collective 493 (ALLGATHER, PG 0) (ranks 2, 3 timed out waiting in it, they printed no watchdog line"),
            "{s}"
        );
        assert!(s.contains("collective timeout to 60 s"), "{s}");
    }
    let h = j(&lines, Some(8));
    assert_eq!(h.kind, Kind::Unnamed);
    assert_eq!(h.missing, vec![0, 1, 4, 5, 6, 7]);
    let s = h.sentence(&|_| None);
    assert!(
        s.contains("ranks 2, 3 enqueued collective 493 and none completed it"),
        "{s}"
    );
    assert!(
        s.contains("ranks 0, 1, 4-7 of the world printed no watchdog line"),
        "{s}"
    );
}

/// gloo numbers no collective: ranks 0 and 2 timed out (a real torch 2.15 job,
/// tests/torch_job.rs), rank 1 printed nothing: it is named, the collective unnamed. One
/// rank's timeout alone of three names nobody.
#[test]
fn gloos_ranks_that_timed_out_name_the_silent_one() {
    let lines = [
        "[rank0]: collective 6 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete",
        "[rank2]: collective 6 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send operation to complete",
    ];
    let h = j(&lines, Some(3));
    assert_eq!(
        (h.kind, h.ranks.clone(), h.collective),
        (Kind::Silent, vec![1], None)
    );
    let s = h.sentence(&|r| (r == 1).then(|| "n2".to_string()));
    assert!(
        s.starts_with("rank 1 on n2 printed nothing while the others waited in a collective of PG 0 (ranks 0, 2 timed out waiting in it, it printed no watchdog line"),
        "{s}"
    );
    assert!(s.contains("collective timeout to 10 s"), "{s}");
    assert_eq!(j(&lines[..1], Some(3)).kind, Kind::Unnamed);
    // Rank 2 printed only gloo's "closed by peer" (rank 0's abort reached it first): it was
    // in the collective, not silent; rank 1 alone is named (review of 2026-12-04: rank 2 was
    // counted silent too).
    let lines = [
        lines[0],
        "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.214.0.1]:29533",
    ];
    let h = j(&lines, Some(3));
    assert_eq!((h.kind, h.ranks.clone()), (Kind::Silent, vec![1]));
}

/// One node's ranks 8-15 of 16 all wait: ranks 0-7 are another node's, whose silence in
/// this node's output says nothing.
#[test]
fn another_nodes_ranks_are_not_silent_here() {
    let lines: Vec<String> = (8..16).map(|r| format!("[rank{r}]:[PG ID 0 PG GUID 0(default_pg) Rank {r}]  failure detected by watchdog at work sequence id: 7 PG status: last enqueued work: 7, last completed work: 6")).collect();
    let local: BTreeSet<u32> = (8..16).collect();
    let h = judge(
        lines.iter().map(|l| (None, l.as_str())),
        Some(16),
        Some(&local),
    )
    .unwrap();
    assert_eq!(h.kind, Kind::Unnamed, "{h:?}");
    let h = judge(lines.iter().map(|l| (None, l.as_str())), Some(16), None).unwrap();
    assert_eq!(
        h.kind,
        Kind::Silent,
        "the job's view: ranks 0-7 printed nothing"
    );
}

#[test]
fn torchs_desync_report_is_taken_as_it_names_ranks() {
    let h = j(&[
        "[rank0]:[PG 0 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.",
        "[rank0]:  - [3] finished collective #41, but didn't join collective #42",
    ], None);
    assert_eq!(
        (h.kind, h.ranks.clone(), h.collective),
        (Kind::CpuSide, vec![3], Some(42))
    );
}

#[test]
fn no_watchdog_line_no_hang() {
    assert!(judge(
        [(None, "step 1 loss 2.0"), (Some("n1"), "loss nan")],
        Some(2),
        None
    )
    .is_none());
}

#[test]
fn rank_lists_read_as_people_write_them() {
    assert_eq!(rank_list(&[3, 0, 1, 2, 7, 9, 10]), "0-3, 7, 9, 10");
    assert_eq!(rank_list(&[5]), "5");
}
