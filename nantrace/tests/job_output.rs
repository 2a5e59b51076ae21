//! End to end: a job prints a failure line of one family and exits non-zero; the bundle's
//! trigger, timeline event, top suspect and verdict name that family (root: real probes).
mod common;

use std::process::{Command, Stdio};

use common::*;
use serde_json::Value;

/// Runs `sh -c script` under `nantrace run`; returns (exit code, timeline, report.md).
fn run_job(tag: &str, script: &str, extra: &[&str]) -> (Option<i32>, Value, String) {
    let out = out_dir(tag);
    let o = Command::new(BIN)
        .args(["run", "--out", out.to_str().unwrap(), "--post", "1"])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .expect("run nantrace");
    eprintln!("{}", String::from_utf8_lossy(&o.stderr));
    let b = only_bundle(&out);
    let t: Value =
        serde_json::from_str(&std::fs::read_to_string(b.join("timeline.json")).unwrap()).unwrap();
    let r = std::fs::read_to_string(b.join("report.md")).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    (o.status.code(), t, r)
}

fn verdict(report: &str) -> &str {
    report.lines().find(|l| l.starts_with("**")).unwrap_or("")
}

fn fault_events(t: &Value) -> Vec<&Value> {
    t["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["source"] == "log" && e["fault"].is_object())
        .collect()
}

#[test]
fn each_machine_family_printed_by_the_job_names_that_family() {
    if !privileged("each_machine_family_printed_by_the_job_names_that_family") {
        return;
    }
    for (tag, line, family, verdict_family, code) in [
        ("gpu", "RuntimeError: CUDA error: unspecified launch failure", "gpu_hw", "(GPU)", "cudaErrorLaunchFailure (719)"),
        ("net", "node3:2211:2290 [1] NCCL WARN NET/IB : Got completion from peer 10.0.0.5<4711> with status=13 opcode=1 len=0 vendor err 136 (Send)", "network", "(network)", "ibv status 13 (RNR retry counter exceeded (the peer stopped posting receives)), vendor err 136"),
        ("mem", "RuntimeError: DataLoader worker (pid 31337) is killed by signal: Killed.", "host_memory", "(host memory)", "signal Killed"),
        ("io", "OSError: [Errno 116] Stale file handle: '/mnt/nfs/ckpt/step_2000/model.pt'", "storage", "(storage)", "ESTALE (errno 116)"),
    ] {
        let (code_rc, t, r) = run_job(tag, &format!("echo 'step 1 | loss 2.31'; echo \"[rank2]: {line}\" >&2; sleep 0.3; exit 1"), &[]);
        assert_eq!(code_rc, Some(1), "{tag}: the job's exit code is kept");
        assert_eq!(t["trigger"]["kind"], "job-error", "{tag}: the failure line is the trigger: {}", t["trigger"]);
        let f = fault_events(&t);
        assert_eq!(f.len(), 1, "{tag}: {f:?}");
        assert_eq!((f[0]["fault"]["family"].as_str(), f[0]["fault"]["code"].as_str(), f[0]["fault"]["rank"].as_u64()), (Some(family), Some(code), Some(2)), "{tag}");
        assert_eq!(f[0]["stream"], "stderr");
        let v = verdict(&r);
        // The job's words alone, with the kernel log watched and silent: at most POSSIBLY.
        let fam = verdict_family.trim_end_matches(')');
        assert!(v.starts_with(&format!("**POSSIBLY THE MACHINE {fam}), in the job's own words only: ")), "{tag}: {v}");
        assert!(r.contains("1. ["), "{tag}: a ranked suspect:\n{r}");
    }
}

#[test]
fn the_issue_9_job_is_a_gpu_fault_with_the_network_and_hang_listed() {
    if !privileged("the_issue_9_job_is_a_gpu_fault_with_the_network_and_hang_listed") {
        return;
    }
    let script = r#"
echo 'step 1 | loss 2.31'
echo '[rank0]: RuntimeError: CUDA error: uncorrectable ECC error encountered' >&2
echo '[rank1]:[E ProcessGroupNCCL.cpp:563] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=77, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600044 milliseconds before timing out.' >&2
echo 'gpu7:99:120 [0] NCCL WARN NET/IB : Got completion from peer 10.1.1.2<40000> with status=12 opcode=0 len=0 vendor err 129 (Recv)' >&2
echo 'step 2 | loss=nan'
exit 1"#;
    let (rc, t, r) = run_job("issue9", script, &[]);
    assert_eq!(rc, Some(1));
    let v = verdict(&r);
    assert!(v.starts_with("**POSSIBLY THE MACHINE (GPU), in the job's own words only: job output: uncorrectable ECC error"), "{v}");
    assert!(!r.contains("NOT THE MACHINE"), "{r}");
    assert!(
        r.contains("ibv status 12 (transport retry counter exceeded"),
        "{r}"
    );
    assert!(r.contains("ALLREDUCE SeqNum=77 timeout 600000 ms"), "{r}");
    assert_eq!(fault_events(&t).len(), 3);
    assert!(t["first_nan"]["line"]
        .as_str()
        .unwrap()
        .contains("loss=nan"));
}

#[test]
fn a_software_line_never_blames_the_machine_and_the_trigger_can_be_turned_off() {
    if !privileged("a_software_line_never_blames_the_machine_and_the_trigger_can_be_turned_off") {
        return;
    }
    let (rc, t, r) = run_job("sw", "echo 'step 1 | loss 2.3'; echo 'RuntimeError: CUDA error: device-side assert triggered' >&2; echo 'CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.' >&2; exit 3", &[]);
    assert_eq!(rc, Some(3));
    assert_eq!(
        t["trigger"]["kind"], "exit",
        "a software line does not trigger by itself"
    );
    let v = verdict(&r);
    assert!(
        v.starts_with("**NOT THE MACHINE (software/configuration)"),
        "{v}"
    );
    assert_eq!(
        fault_events(&t).len(),
        1,
        "the boilerplate hint is not evidence"
    );
    // --no-trigger job-error: the exit is the trigger, the line is still the evidence.
    let (_, t, r) = run_job(
        "off",
        "echo 'OSError: [Errno 5] Input/output error' >&2; exit 1",
        &["--no-trigger", "job-error"],
    );
    assert_eq!(t["trigger"]["kind"], "exit");
    assert!(
        verdict(&r).starts_with("**POSSIBLY THE MACHINE (storage), in the job's own words only"),
        "{}",
        verdict(&r)
    );
}
