//! The job's first failure on any node (`report::order` on the merged clock): one rank's
//! own error on n1, then the other nodes' ranks lose it; the job report blames the error, not
//! the network the other nodes' lines name.
use serde_json::{json, Value};

use super::scale_tests::report;
use super::tests::{at, healthy, node};

fn job_line(t: f64, line: &str) -> Value {
    let mut l = json!({ "time": at(t), "source": "log", "pid": 100, "job": true, "line": line });
    let f = crate::joblog::classify(line)
        .unwrap_or_else(|| panic!("a failure line of the job: {line}"));
    l["fault"] = serde_json::to_value(f).unwrap();
    l
}

#[test]
fn one_ranks_error_on_n1_then_broken_connections_on_n2_and_n3_is_the_error() {
    let mut e1 = healthy("n1", true);
    e1.push(job_line(-20.0, "[rank3]: KeyError: 'input_ids'"));
    let mut e2 = healthy("n2", false);
    e2.push(job_line(-12.0, "[rank9]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:24145"));
    let mut e3 = healthy("n3", false);
    e3.push(job_line(-11.0, "[rank17]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote process exited or there was a network error, NCCL version 2.21.5"));
    let r = report(vec![
        node("n1", e1, 0.0, false, "n[1-3]"),
        node("n2", e2, 0.5, false, "n[1-3]"),
        node("n3", e3, 0.6, false, "n[1-3]"),
    ]);
    assert!(
        r.verdict
            .starts_with("NOT THE MACHINE (software/configuration): n1: "),
        "{}",
        r.verdict
    );
    assert!(r.verdict.contains("KeyError"), "{}", r.verdict);
    assert!(r.verdict.contains("After the job's first failure (n1, rank 3: Python exception in the job's code), consequences, not the cause: n2: "), "{}", r.verdict);
    assert!(r.verdict.contains("n3: "), "{}", r.verdict);
    assert_eq!(r.node, None);
    let c = r.first_failure.as_ref().expect("the job's first failure");
    assert_eq!(
        (c.cause_node.as_deref(), c.cause_rank),
        (Some("n1"), Some(3))
    );
    let md = super::markdown(&r);
    assert!(
        md.contains("## Cause and consequences")
            && md.contains("the job's first failure, on n1, rank 3"),
        "{md}"
    );
}

#[test]
fn the_network_failing_first_on_n2_keeps_n2_named() {
    let mut e1 = healthy("n1", true);
    e1.push(job_line(-10.0, "[rank3]: KeyError: 'input_ids'"));
    let mut e2 = healthy("n2", false);
    e2.push(job_line(-20.0, "n2:311:402 [0] NCCL WARN NET/IB : Got completion from peer 10.0.3.9<52431> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.3.7"));
    let r = report(vec![
        node("n1", e1, 0.0, false, "n[1-3]"),
        node("n2", e2, 0.5, false, "n[1-3]"),
        node("n3", healthy("n3", false), 0.6, false, "n[1-3]"),
    ]);
    assert!(r.first_failure.is_none(), "{:?}", r.first_failure);
    assert!(
        r.verdict
            .starts_with("POSSIBLY THE MACHINE (network), in the job's own words only: n2: "),
        "{}",
        r.verdict
    );
}
