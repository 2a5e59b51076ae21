//! The incident's order (`order.rs`): the first failure on any rank explains the network and
//! hang lines after it; a network failure first keeps its weight.
use super::tests::{job_line, Scenario};

/// One rank's own error, then every other rank's view of it (the shape of most multi-rank
/// pastes: pytorch/pytorch threads where one rank's IndexError ends in broken pipes and a
/// watchdog timeout on the rest).
fn one_rank_dies_then_the_rest_lose_it(first: &str) -> Scenario {
    Scenario::healthy()
        .with(job_line(-40.0, "[rank3]: Traceback (most recent call last):"))
        .with(job_line(-40.0, "[rank3]:   File \"train.py\", line 88, in <module>"))
        .with(job_line(-39.9, first))
        .with(job_line(-30.0, "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.4]:24145"))
        .with(job_line(-29.0, "[rank1]: torch.distributed.DistBackendError: [1] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') got error: Connection reset by peer"))
        .with(job_line(-20.0, "[rank2]:[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."))
}

#[test]
fn a_ranks_own_error_then_the_others_broken_pipes_is_the_error() {
    let a = one_rank_dies_then_the_rest_lose_it(
        "[rank3]: IndexError: index 8192 is out of bounds for dimension 0 with size 8192",
    )
    .analyze();
    assert!(
        a.verdict
            .starts_with("NOT THE MACHINE (software/configuration)"),
        "{}",
        a.verdict
    );
    assert!(a.verdict.contains("IndexError"), "{}", a.verdict);
    assert!(!a.machine, "{:?}", a.suspects);
    let o = a.order.as_ref().expect("an order");
    assert_eq!(o.cause_rank, Some(3));
    assert!(
        (o.cause_rel_s - -39.9).abs() < 1e-9 && (o.first_consequence_rel_s - -30.0).abs() < 1e-9,
        "{o:?}"
    );
    // Both network findings and the hang are listed as consequences, and ranked below.
    assert_eq!(o.consequences.len(), 2, "{:?}", o.consequences);
    let cons: Vec<_> = a.suspects.iter().filter(|s| s.consequence).collect();
    assert_eq!(cons.len(), 2, "{:?}", a.suspects);
    assert!(
        cons.iter().all(
            |s| s.text.contains("a consequence, not its cause") && s.text.contains("on rank 3")
        ),
        "{cons:?}"
    );
    assert_eq!(a.suspects[0].signal, "joblog_software");
    let md = super::markdown(&a, &serde_json::json!({}));
    let sec = md
        .split("## Cause and consequences")
        .nth(1)
        .expect("the section")
        .split("## Ranked suspects")
        .next()
        .unwrap();
    assert!(sec.contains("the job's first failure on rank 3, Python exception in the job's code (39.9 s before the first NaN)"), "{sec}");
    assert!(sec.contains("from 9.9 s later"), "{sec}");
    assert_eq!(sec.matches("- consequence: ").count(), 2, "{sec}");
}

#[test]
fn a_gpu_fault_first_is_the_cause_and_keeps_its_family() {
    let a = one_rank_dies_then_the_rest_lose_it(
        "[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    )
    .analyze();
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (GPU)"),
        "{}",
        a.verdict
    );
    assert!(
        a.suspects
            .iter()
            .all(|s| s.consequence == (s.signal != "joblog_gpu_hw")),
        "{:?}",
        a.suspects
    );
}

#[test]
fn the_network_failing_first_is_not_a_consequence() {
    // The IB error precedes the exception it causes: nothing is demoted.
    let a = one_rank_dies_then_the_rest_lose_it("[rank3]: IndexError: index 8192 is out of bounds for dimension 0 with size 8192")
        .with(job_line(-45.0, "node7:311:402 [0] NCCL WARN NET/IB : Got completion from peer 10.0.3.9<52431> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.3.7"))
        .analyze();
    assert!(a.order.is_none(), "{:?}", a.order);
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (network)"),
        "{}",
        a.verdict
    );
    assert!(a.suspects.iter().all(|s| !s.consequence));
}

#[test]
fn an_error_the_job_outlived_explains_nothing() {
    // A start-up error the job ran on after for minutes (an optional import), then a real
    // connection loss: the connection loss stands.
    let a = Scenario::healthy()
        .with(job_line(-500.0, "ModuleNotFoundError: No module named 'apex'"))
        .with(job_line(-10.0, "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.4]:24145"))
        .analyze();
    assert!(a.order.is_none(), "{:?}", a.order);
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (network)"),
        "{}",
        a.verdict
    );
}

#[test]
fn a_hang_alone_says_where_to_look_and_what_a_short_timeout_means() {
    // NVIDIA-NeMo/Automodel#1038's shape: every rank's watchdog on one ALLGATHER, 60 s timeout.
    let a = Scenario::healthy()
        .with(job_line(-3.0, "[rank2]:[E109 22:46:25.933527530 ProcessGroupNCCL.cpp:632] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=493, OpType=ALLGATHER, NumelIn=1, NumelOut=4, Timeout(ms)=60000) ran for 60044 milliseconds before timing out."))
        .analyze();
    assert!(
        a.verdict.starts_with("UNDECIDED (collective hang)"),
        "{}",
        a.verdict
    );
    assert!(
        a.verdict
            .contains("the job set its collective timeout to 60 s (torch's default is 600 s)"),
        "{}",
        a.verdict
    );
    assert!(
        a.verdict.contains("py-spy dump the stuck ranks"),
        "{}",
        a.verdict
    );
    // The default timeout is not remarked on.
    let b = Scenario::healthy()
        .with(job_line(-3.0, "[rank1]:[E ProcessGroupNCCL.cpp:523] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600659 milliseconds before timing out."))
        .analyze();
    assert!(
        !b.verdict.contains("set its collective timeout"),
        "{}",
        b.verdict
    );
}

#[test]
fn a_peers_connection_loss_189_ms_after_the_nan_is_after_it() {
    // The VM cluster's xid-on-n2, n1's view: no delivery slack for a consequence.
    let a = Scenario::healthy()
        .with(job_line(0.189, "rank 1 step 26 | connection to rank 0 lost: ConnectionResetError(104, 'Connection reset by peer')"))
        .analyze();
    let s = a
        .suspects
        .iter()
        .find(|s| s.signal == "joblog_network")
        .expect("the network line");
    assert!(
        s.text.ends_with("(after it: a consequence, not its cause)"),
        "{}",
        s.text
    );
}

#[test]
fn an_ambiguous_gpu_error_after_an_ib_failure_is_its_consequence() {
    // nccl-tests#24 (corpus 041): IB completion errors (a RoCE GID index), then NCCL's CUDA
    // illegal memory access once the transfers failed.
    let a = Scenario::healthy()
        .with(job_line(-3.0, "gpu5:35917:35994 [0] transport/net_ib.cu:788 NCCL WARN NET/IB : Got completion with error 12, opcode 1, len 0, vendor err 129"))
        .with(job_line(-1.5, "gpu5:35917:35917 [1] init.cu:194 NCCL WARN Cuda failure 'an illegal memory access was encountered'"))
        .analyze();
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (network)"),
        "{}",
        a.verdict
    );
    let o = a.order.as_ref().expect("an order");
    assert!(
        o.cause_what
            .contains("InfiniBand/RoCE work completion error"),
        "{o:?}"
    );
    let g = a
        .suspects
        .iter()
        .find(|s| s.signal == "joblog_gpu_ambiguous")
        .expect("the CUDA error");
    assert!(
        g.consequence && g.text.contains("a consequence, not its cause"),
        "{}",
        g.text
    );
    // A GPU hardware error after it is not explained away.
    let b = Scenario::healthy()
        .with(job_line(-3.0, "gpu5:35917:35994 [0] transport/net_ib.cu:788 NCCL WARN NET/IB : Got completion with error 12, opcode 1, len 0, vendor err 129"))
        .with(job_line(-1.5, "RuntimeError: CUDA error: uncorrectable ECC error encountered"))
        .analyze();
    assert!(
        b.suspects.iter().all(|s| !s.consequence),
        "{:?}",
        b.suspects
    );
}

#[test]
fn a_network_failure_long_after_an_explained_one_is_its_own() {
    // A crash-free error and the peer's reset right after it (explained), then 390 training
    // steps, then a real IB failure: the IB failure is evidence, not a consequence.
    let ib = "node7:311:402 [0] NCCL WARN NET/IB : Got completion from peer 10.0.3.9<52431> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.3.7";
    let a = Scenario::healthy()
        .with(job_line(-400.0, "[rank3]: KeyError: 'input_ids'"))
        .with(job_line(-395.0, "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.4]:24145"))
        .with(job_line(-1.0, ib))
        .analyze();
    let ibf = a
        .suspects
        .iter()
        .find(|s| s.text.contains("InfiniBand/RoCE"))
        .expect("the IB failure");
    assert!(!ibf.consequence, "{}", ibf.text);
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (network)"),
        "{}",
        a.verdict
    );
    // The early reset, 395 s before the NaN with training after it, is context.
    assert!(
        a.checked
            .iter()
            .any(|c| c.starts_with("context, not evidence")
                && c.contains("Connection closed by peer")),
        "{:?}",
        a.checked
    );
}

#[test]
fn the_same_ib_error_before_and_after_the_nan_is_not_a_consequence() {
    // Two ranks print the same IB failure, one 0.8 s before the NaN, one 0.3 s after: the
    // finding's earliest line is before it.
    let ib = |r: u32| {
        format!("[rank{r}]: node7:311:402 [0] NCCL WARN NET/IB : Got completion from peer 10.0.3.9<52431> with status=12 opcode=0 len=0 vendor err 129 (Recv)")
    };
    let a = Scenario::healthy()
        .with(job_line(-0.8, &ib(2)))
        .with(job_line(0.3, &ib(5)))
        .analyze();
    let s = a
        .suspects
        .iter()
        .find(|s| s.text.contains("InfiniBand/RoCE"))
        .expect("the IB failure");
    assert!(
        !s.text.contains("a consequence") && !s.consequence,
        "{}",
        s.text
    );
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (network)"),
        "{}",
        a.verdict
    );
}
