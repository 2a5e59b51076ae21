//! The report against untrusted input (the third adversarial test): what the job prints and
//! what other users' sockets do is never machine evidence by itself.
use serde_json::{json, Value};

use super::tests::{job_line, kmsg, Scenario, ROOT};

/// D-3 of the third adversarial test (`jobs/synstorm.py`): another user's listener that never
/// accepts, 300 connects to it: thousands of retransmits on loopback. Loopback is never the
/// fabric, whoever's sockets they are; the same storm to a real peer still is.
#[test]
fn loopback_retransmits_are_never_network_evidence() {
    for (daddr, saddr) in [
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),
        ("10.0.0.7", "127.0.0.1"),
    ] {
        let mut s = Scenario::healthy();
        for i in 0..300 {
            s = s.with(json!({ "offset_s": -59.0 + f64::from(i) / 10.0, "source": "tcp_retransmit", "daddr": daddr, "dport": 39571, "saddr": saddr, "sport": 40000 + i, "job": i % 2 == 0 }));
        }
        let a = s.analyze();
        assert!(
            a.suspects.iter().all(|f| f.signal != "retransmit_storm"),
            "{daddr}: {}",
            a.verdict
        );
        assert!(
            a.verdict.starts_with("NOT THE MACHINE"),
            "{daddr}: {}",
            a.verdict
        );
    }
    assert!(
        !crate::report::detect::loopback(Some("10.0.0.7"))
            && !crate::report::detect::loopback(Some("fe80::1"))
            && !crate::report::detect::loopback(None)
    );
}

/// D-4 of the third adversarial test: a job that prints the kernel's own Xid line (any user
/// can) is not the kernel saying it. Its words alone are at most POSSIBLY, with a family that
/// says so; the kernel's Xid beside the same words is PROBABLY, with the plain family.
#[test]
fn the_jobs_words_alone_are_at_most_possibly_and_say_so() {
    let fake = "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.";
    let ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered";
    let words = Scenario::healthy()
        .with(job_line(-3.0, fake))
        .with(job_line(-2.0, ecc))
        .analyze();
    assert!(words.machine, "{}", words.verdict);
    assert_eq!(words.family, "GPU (job's words only)", "{}", words.verdict);
    assert!(
        words
            .verdict
            .starts_with("POSSIBLY THE MACHINE (GPU), in the job's own words only: "),
        "{}",
        words.verdict
    );
    assert!(
        words
            .verdict
            .contains("the kernel log, watched, and NVML show no such fault"),
        "{}",
        words.verdict
    );
    assert!(
        words
            .suspects
            .iter()
            .all(|s| s.signal != "gpu_fallen_off_bus" && s.signal != "xid_critical"),
        "the job's imitation became kernel evidence: {:?}",
        words.suspects.iter().map(|s| s.signal).collect::<Vec<_>>()
    );
    // Nothing watched the kernel: the verdict says that nothing could confirm them.
    let mut blind = Scenario::healthy().with(job_line(-2.0, ecc));
    blind.probes = json!([]);
    blind.snapshot["gpu"] = json!({ "available": false, "reason": "no NVML" });
    let blind = blind.analyze();
    assert!(
        blind
            .verdict
            .starts_with("POSSIBLY THE MACHINE (GPU), in the job's own words only: ")
            && blind
                .verdict
                .contains("neither the kernel log nor NVML was watched"),
        "{}",
        blind.verdict
    );
    // The kernel's own Xid on the job's GPU beside the same words: the machine, probably.
    let kernel = Scenario::healthy().with(job_line(-2.0, ecc)).with(kmsg(-2.5, &format!("NVRM: Xid (PCI:0000:3b:00): 79, pid={ROOT}, name=python3, GPU has fallen off the bus."))).analyze();
    assert_eq!(kernel.family, "GPU", "{}", kernel.verdict);
    assert!(
        kernel.verdict.starts_with("PROBABLY THE MACHINE (GPU): "),
        "{}",
        kernel.verdict
    );
}

/// redteam4 D-14, for the verdict: an Xid line that `/dev/kmsg` recorded as written from user
/// space (root's `echo > /dev/kmsg`, journald's `ForwardToKMsg` relaying a user's text) is
/// words anyone could write: POSSIBLY, the writer said, the family marked as such (so no
/// drain, no history), never PROBABLY. The same line the kernel wrote (not listed) stays
/// PROBABLY; a dump that could not check (no list) reads as before.
#[test]
fn a_kernel_log_line_written_from_user_space_is_at_most_possibly() {
    let line = format!("NVRM: Xid (PCI:0000:3b:00): 79, pid={ROOT}, name=python3, GPU has fallen off the bus.");
    let mut e = kmsg(-2.5, &line);
    e["mono_ns"] = json!(1_000_000_123u64);
    let mut s = Scenario::healthy().with(e);
    s.writers = json!({ "checked": 1, "not_the_kernels": [
        { "mono_ns": 1_000_000_123u64, "text": line, "writer": "written into /dev/kmsg from user space (facility 1), not by the kernel" }
    ] });
    let a = s.analyze();
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (GPU), on a kernel log line not the kernel's only: ")
            && a.verdict.contains("written into /dev/kmsg from user space (facility 1)"),
        "{}",
        a.verdict
    );
    assert_eq!(a.family, format!("GPU{}", super::rules::JOB_WORDS_SUFFIX));
    assert!(super::implicated_gpus(&a, &s.snapshot).is_empty(), "the history never counts it");
    // Listed at another time than the line's: not this line; the kernel's own, PROBABLY.
    s.writers["not_the_kernels"][0]["mono_ns"] = json!(7u64);
    let b = s.analyze();
    assert!(b.verdict.starts_with("PROBABLY THE MACHINE (GPU): "), "{}", b.verdict);
    // Not checked: as before.
    s.writers = Value::Null;
    assert!(s.analyze().verdict.starts_with("PROBABLY THE MACHINE (GPU): "));
}

/// The second review of 2026-12-04: every kernel-log detector reads who wrote its lines (a
/// forged hung task was PROBABLY (kernel)); a forged line never speaks for the machine over
/// real evidence beside it (a forged Xid and a real OOM kill of the user's own process: the
/// verdict was PROBABLY (GPU)); a dump that could not check every line leaves a finding with
/// an unchecked line and none the kernel's unverified.
#[test]
fn forged_lines_of_every_detector_and_beside_real_evidence_are_not_the_kernels() {
    let user = "written into /dev/kmsg from user space (facility 1), not by the kernel";
    let forged = |t: f64, ns: u64, text: &str| {
        let mut e = kmsg(t, text);
        e["mono_ns"] = json!(ns);
        (e, json!({ "mono_ns": ns, "text": text, "writer": user }))
    };
    let (hung, w) = forged(-3.0, 11, "INFO: task python3:4242 blocked for more than 120 seconds.");
    let mut s = Scenario::healthy().with(hung);
    s.writers = json!({ "checked": 1, "not_the_kernels": [w] });
    let a = s.analyze();
    assert!(!a.verdict.starts_with("PROBABLY"), "{}", a.verdict);
    assert!(a.verdict.contains(user), "{}", a.verdict);
    // A forged Xid beside a real OOM kill (the tracepoint's record) of another process.
    let (xid, w) = forged(-2.0, 12, &format!("NVRM: Xid (PCI:0000:3b:00): 79, pid={ROOT}, name=python3, GPU has fallen off the bus."));
    let mut s = Scenario::healthy()
        .with(xid)
        .with(json!({ "offset_s": -1.0, "source": "oom", "victim_pid": 777, "victim_comm": "hog", "victim_job": false, "anon_rss_kb": 1_048_576, "pid": 777 }));
    s.writers = json!({ "checked": 1, "not_the_kernels": [w] });
    let a = s.analyze();
    assert!(
        !a.verdict.contains("THE MACHINE (GPU)"),
        "the forged Xid spoke for the machine: {}",
        a.verdict
    );
    // More lines than a dump checks: the Xid unchecked, none of its lines the kernel's.
    let line = format!("NVRM: Xid (PCI:0000:3b:00): 79, pid={ROOT}, name=python3, GPU has fallen off the bus.");
    let mut e = kmsg(-2.0, &line);
    e["mono_ns"] = json!(13u64);
    let mut s = Scenario::healthy().with(e);
    s.writers = json!({ "checked": 64, "not_checked": 40, "the_kernels": [], "not_the_kernels": [] });
    let a = s.analyze();
    assert!(
        a.verdict.starts_with("POSSIBLY THE MACHINE (GPU), on a kernel log line not the kernel's only")
            && a.verdict.contains("not checked: the dump could not check every kernel log line"),
        "{}",
        a.verdict
    );
    // The same with the line found the kernel's: PROBABLY.
    s.writers["the_kernels"] = json!([{ "mono_ns": 13u64, "text": line }]);
    assert!(s.analyze().verdict.starts_with("PROBABLY THE MACHINE (GPU): "));
}

/// D-14 of the third adversarial test: a bundle (anyone's, read by root's `report`) whose
/// window says 1e300 seconds is not printed as a 300-digit number of minutes; a real window is.
#[test]
fn an_absurd_window_is_not_printed_as_a_number() {
    for bad in [json!(1e300), json!(-5.0), json!("600"), json!(1e9)] {
        let a = Scenario::healthy().analyze_window(bad.clone());
        let longest = a
            .verdict
            .split(|c: char| !c.is_ascii_digit())
            .map(str::len)
            .max()
            .unwrap_or(0);
        assert!(longest < 8, "{bad}: {}", a.verdict);
        assert!(
            a.verdict.contains("in the window before") && a.verdict.contains("not a valid one"),
            "{bad}: {}",
            a.verdict
        );
    }
    assert!(Scenario::healthy()
        .analyze_window(json!(1800.0))
        .verdict
        .contains("in the 30 minutes before"));
    assert!(
        Scenario::healthy()
            .analyze_window(json!(172_800.0))
            .verdict
            .contains("in the 2880 minutes before"),
        "run --window allows a week"
    );
    assert!(
        Scenario::healthy()
            .analyze_window(json!(null))
            .verdict
            .contains("in the 10 minutes before"),
        "an old bundle without a window: the default"
    );
}

/// The VM cluster's xid-on-n2 case, on n2's own report: the Xid 79 5.5 s before the NaN, then
/// (1.1 s after it) the rank's `connection to rank 0 lost` once rank 0 stopped. The broken
/// connection is what the NaN did; it never outranks the Xid (it did, and n2's report said
/// PROBABLY THE MACHINE (network)), and it says it is a consequence.
#[test]
fn a_broken_connection_after_the_nan_never_outranks_what_came_before() {
    let a = Scenario::healthy()
        .with(kmsg(-5.5, "NVRM: Xid (PCI:0000:5e:00): 79, pid=2214, name=python3, GPU has fallen off the bus."))
        .with(job_line(1.1, "rank 1 step 26 | connection to rank 0 lost: ConnectionResetError(104, 'Connection reset by peer')"))
        .analyze();
    assert_eq!(a.family, "GPU", "{}", a.verdict);
    assert!(
        a.verdict.starts_with("PROBABLY THE MACHINE (GPU)"),
        "{}",
        a.verdict
    );
    let net = a
        .suspects
        .iter()
        .find(|s| s.signal.starts_with("joblog_network"))
        .expect("the broken connection is listed");
    assert!(
        net.text
            .ends_with("(after it: a consequence, not its cause)"),
        "{}",
        net.text
    );
    // Before the NaN, the same line is a cause like any other.
    let before = Scenario::healthy().with(job_line(-1.1, "rank 1 step 26 | connection to rank 0 lost: ConnectionResetError(104, 'Connection reset by peer')")).analyze();
    assert!(
        before
            .suspects
            .iter()
            .any(|s| s.signal.starts_with("joblog_network") && !s.text.contains("consequence")),
        "{:?}",
        before.suspects
    );
}

/// Issue 24's start-up warning: a transport the job then did without (NCCL found no IB device
/// and ran on over sockets for minutes) is context, not evidence; the same line near the NaN,
/// with no training after it, is evidence as before.
#[test]
fn a_warning_the_job_ran_on_after_is_context_not_evidence() {
    let warn = "NCCL WARN NET/IB : Got completion from peer 10.0.0.2<54321> with status=12 opcode=0 len=0 vendor err 129 (Recv)";
    let early = Scenario::healthy().with(job_line(-500.0, warn)).analyze();
    assert!(
        early.verdict.starts_with("NOT THE MACHINE"),
        "{}",
        early.verdict
    );
    assert!(
        early
            .suspects
            .iter()
            .all(|s| !s.signal.starts_with("joblog_network")),
        "{:?}",
        early.suspects
    );
    let said = early
        .checked
        .iter()
        .find(|c| c.starts_with("context, not evidence: job output"))
        .unwrap_or_else(|| panic!("{:?}", early.checked));
    assert!(
        said.contains("500 s before the first NaN; the job ran on after it: ")
            && said.contains("training steps logged"),
        "{said}"
    );
    let late = Scenario::healthy().with(job_line(-3.0, warn)).analyze();
    assert!(
        late.suspects
            .iter()
            .any(|s| s.signal.starts_with("joblog_network")),
        "{}",
        late.verdict
    );
    assert!(
        late.verdict.starts_with("POSSIBLY THE MACHINE (network)"),
        "{}",
        late.verdict
    );
}
