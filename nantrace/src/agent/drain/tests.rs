use std::os::unix::fs::PermissionsExt as _;

use super::*;
use crate::agent::trust::check_writer;

fn dumped(
    verdict: &str,
    family: &str,
    signal: &'static str,
    action: Option<&'static str>,
    top: &str,
) -> Dumped {
    Dumped {
        dir: None,
        verdict: Some(verdict.into()),
        family: Some(family.into()),
        top_suspect: Some(top.into()),
        top_signal: Some(signal),
        top_action: action,
        top_kernel_lines: Vec::new(),
        top_unforgeable: true,
        gpus: Vec::new(),
        faults: Vec::new(),
        gpu_witnesses: Vec::new(),
        trigger: "xid".into(),
    }
}

const XID79: &str = "Xid 79 (GPU has fallen off the bus) on 0000:3b:00.0, a GPU of this job, 4.1 s before the first NaN";

#[test]
fn only_unforgeable_evidence_that_needs_service_drains() {
    let ok = decide(
        &dumped(
            "PROBABLY THE MACHINE (GPU): Xid 79 ...",
            "GPU",
            "gpu_fallen_off_bus",
            Some("reboot the node"),
            XID79,
        ),
        "nantrace-host-20261201T101010Z-xid",
    );
    assert_eq!(ok.as_deref(), Ok("nantrace: GPU Xid 79 (GPU has fallen off the bus) on 0000:3b:00.0 nantrace-host-20261201T101010Z-xid"));
    // Xid 13: POSSIBLY (the job's own code can cause it).
    let e = decide(
        &dumped(
            "POSSIBLY THE MACHINE (GPU, or the job's own code): Xid 13 ...",
            "GPU",
            "xid_app_possible",
            None,
            "Xid 13",
        ),
        "i",
    )
    .unwrap_err();
    assert!(e.contains("POSSIBLY THE MACHINE"), "{e}");
    // The job's words alone, even if they read as an Xid 79.
    let e = decide(
        &dumped(
            "PROBABLY THE MACHINE (GPU): job output: ...",
            "GPU (job's words only)",
            "joblog_gpu_hw",
            None,
            "job output: uncorrectable ECC",
        ),
        "i",
    )
    .unwrap_err();
    assert!(e.contains("job's own words"), "{e}");
    let e = decide(
        &dumped(
            "PROBABLY THE MACHINE (GPU): job output: ...",
            "GPU",
            "joblog_gpu_hw",
            None,
            "job output",
        ),
        "i",
    )
    .unwrap_err();
    assert!(e.contains("job's own words"), "{e}");
    // The machine, but nothing a reset or service fixes (an OOM kill of the job, retransmits).
    let e = decide(
        &dumped(
            "PROBABLY THE MACHINE (host memory): OOM kill",
            "host memory",
            "oom_kill_job",
            None,
            "OOM kill of python",
        ),
        "i",
    )
    .unwrap_err();
    assert!(e.contains("does not need a reset"), "{e}");
    for v in [
        "NOT THE MACHINE (software/configuration): x",
        "UNDECIDED (collective hang): x",
        "CANNOT TELL: x",
        "",
    ] {
        assert!(
            decide(&dumped(v, "GPU", "gpu_fallen_off_bus", None, XID79), "i").is_err(),
            "{v}"
        );
    }
    // A critical Xid whose catalog action is only to restart the application: no drain.
    assert!(decide(
        &dumped(
            "PROBABLY THE MACHINE (GPU): Xid",
            "GPU",
            "xid_critical",
            Some(crate::classify::action_text("restart_app")),
            "Xid 999"
        ),
        "i"
    )
    .is_err());
    assert!(decide(
        &dumped(
            "PROBABLY THE MACHINE (GPU): Xid 48",
            "GPU",
            "xid_critical",
            Some(crate::classify::action_text("ecc_workflow")),
            "Xid 48 (Double Bit ECC Error) on 0000:5e:00.0"
        ),
        "i"
    )
    .is_ok());
}

#[test]
fn the_reason_keeps_only_plain_characters() {
    let r = decide(
        &dumped(
            "PROBABLY THE MACHINE (GPU): x",
            "GPU",
            "gpu_fallen_off_bus",
            None,
            "Xid 79 on 0000:3b:00.0 \"; rm -rf / $(x) `y`\nState=RESUME",
        ),
        "inc'1",
    )
    .unwrap();
    assert!(!r.contains(['"', ';', '$', '`', '\n', '\'', '=']), "{r}");
    assert!(r.len() <= 200);
    assert!(
        valid_node_name("gpu-node-017.cluster")
            && !valid_node_name("n1 State=RESUME")
            && !valid_node_name("")
            && !valid_node_name("a\"b")
    );
}

struct Fake {
    dir: PathBuf,
}

impl Fake {
    /// A stand-in scontrol: answers `show node` with the state in STATE, records every call,
    /// and an `update ... State=DRAIN` sets the state.
    fn new(tag: &str, state: &str) -> Fake {
        let dir = std::env::temp_dir().join(format!("nt-drain-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(dir.join("STATE"), state).unwrap();
        let d = dir.display();
        std::fs::write(dir.join("scontrol"), format!("#!/bin/sh\necho \"$@\" >> {d}/calls\ncase \"$1\" in show) echo \"NodeName=n1 Arch=x86_64 State=$(cat {d}/STATE) Reason=none\" ;; update) echo IDLE+DRAIN > {d}/STATE ;; esac\n")).unwrap();
        std::fs::set_permissions(dir.join("scontrol"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        Fake { dir }
    }

    fn drainer(&self, cap: u32) -> Drainer {
        Drainer {
            mode: Mode::Slurm,
            node: "n1".into(),
            cap,
            ledger: Some(Ledger::open(&self.dir, "this node").unwrap()),
            scontrol: self.dir.join("scontrol"),
            user_written_kmsg: false,
        }
    }

    fn calls(&self) -> String {
        std::fs::read_to_string(self.dir.join("calls")).unwrap_or_default()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_drain_runs_once_per_incident_within_the_cap_and_never_on_a_drained_node() {
    let f = Fake::new("once", "IDLE");
    let d = f.drainer(1);
    let now = 1_796_000_000;
    let o = d.act(
        Ok("nantrace: GPU Xid 79 on 0000:3b:00.0 inc1".into()),
        "inc1",
        now,
    );
    assert_eq!(o.action, "drained", "{o:?}");
    assert!(
        f.calls().contains(
            "update NodeName=n1 State=DRAIN Reason=nantrace: GPU Xid 79 on 0000:3b:00.0 inc1"
        ),
        "{}",
        f.calls()
    );
    // A person resumes the node: the same incident does not drain it again.
    std::fs::write(f.dir.join("STATE"), "IDLE").unwrap();
    let o = d.act(
        Ok("nantrace: GPU Xid 79 on 0000:3b:00.0 inc1".into()),
        "inc1",
        now + 60,
    );
    assert_eq!(o.action, "already_drained", "{o:?}");
    // Another incident in the same hour: held back by the cap, with the command to run.
    let o = d.act(
        Ok("nantrace: GPU Xid 79 on 0000:5e:00.0 inc2".into()),
        "inc2",
        now + 120,
    );
    assert_eq!(o.action, "held_by_cap", "{o:?}");
    assert!(
        o.text
            .contains("run by hand if right: scontrol update NodeName=n1 State=DRAIN"),
        "{}",
        o.text
    );
    assert_eq!(f.calls().matches("update").count(), 1, "{}", f.calls());
    // The next hour: a slot again. But the node is DRAIN already (someone else drained it).
    std::fs::write(f.dir.join("STATE"), "MIXED+DRAIN").unwrap();
    let o = d.act(Ok("r".into()), "inc3", now + 3600);
    assert_eq!(o.action, "already_drained", "{o:?}");
    assert!(o.text.contains("already MIXED+DRAIN"), "{}", o.text);
    std::fs::write(f.dir.join("STATE"), "IDLE").unwrap();
    assert_eq!(d.act(Ok("r".into()), "inc4", now + 3600).action, "drained");
    // Not needed, and recommend mode: scontrol never runs.
    let before = f.calls();
    assert_eq!(
        d.act(
            Err("the verdict is POSSIBLY THE MACHINE".into()),
            "inc5",
            now
        )
        .action,
        "not_needed"
    );
    let rec = Drainer {
        mode: Mode::Recommend,
        ..f.drainer(1)
    };
    let o = rec.act(Ok("nantrace: GPU x inc6".into()), "inc6", now);
    assert_eq!(
        (o.action, o.command.as_deref()),
        (
            "recommended",
            Some("scontrol update NodeName=n1 State=DRAIN Reason=\"nantrace: GPU x inc6\"")
        )
    );
    assert_eq!(f.calls(), before);
}

#[test]
fn two_agents_racing_for_the_last_slot_get_one() {
    let f = Fake::new("race", "IDLE");
    let l = Ledger::open(&f.dir, "the cluster").unwrap();
    let a = l.claim(5, 1, &json!({ "incident": "a" })).unwrap();
    let b = l.claim(5, 1, &json!({ "incident": "b" })).unwrap();
    assert!(a.is_some() && b.is_none());
    assert!(l.drained("a") && !l.drained("b"));
    // Old slots go; the record of recent ones stays.
    l.prune(5 + LEDGER_KEEP_HOURS + 1);
    assert!(!l.drained("a"));
    // Only a slot's own name is pruned (redteam4 D-4: `10-victim.conf` went from the
    // directory `.drains` pointed to).
    std::fs::write(f.dir.join(".drains/5-victim.conf"), "{}").unwrap();
    l.prune(5 + LEDGER_KEEP_HOURS + 1);
    assert!(f.dir.join(".drains/5-victim.conf").exists());
}

#[test]
fn a_failing_or_hung_scontrol_is_said_and_frees_its_slot() {
    let f = Fake::new("fail", "IDLE");
    std::fs::write(f.dir.join("scontrol"), "#!/bin/sh\ncase \"$1\" in show) echo 'NodeName=n1 State=IDLE' ;; update) echo 'slurm_update error: Access/permission denied' >&2; exit 1 ;; esac\n").unwrap();
    let d = f.drainer(1);
    let o = d.act(Ok("r".into()), "inc1", 7200);
    assert_eq!(o.action, "failed");
    assert!(o.text.contains("Access/permission denied"), "{}", o.text);
    // The slot was given back: a later drain in the hour can still happen.
    std::fs::write(
        f.dir.join("scontrol"),
        "#!/bin/sh\ncase \"$1\" in show) echo 'NodeName=n1 State=IDLE' ;; esac\n",
    )
    .unwrap();
    assert_eq!(d.act(Ok("r".into()), "inc2", 7200).action, "drained");
    let missing = Drainer {
        scontrol: f.dir.join("no-such-scontrol"),
        ..f.drainer(1)
    };
    let o = missing.act(Ok("r".into()), "inc3", 7200);
    assert_eq!(o.action, "failed");
    assert!(o.text.contains("unknown"), "{}", o.text);
}

/// redteam4 D-1, D-2, D-14: a drain rests on what the kernel wrote. A line written into
/// /dev/kmsg from user space (a relay of a user's text), a line inside another record or no
/// longer in the buffer never drains; the kernel's own line does, and so does a finding NVML or
/// a tracepoint also saw, whatever the log says. Root's injected lines drain only with
/// `trust_user_written_kmsg`.
#[test]
fn a_drain_rests_on_a_line_the_kernel_wrote() {
    use crate::klog::Writer;
    let xid =
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.".to_string();
    let lines = vec![crate::klog::Line::new(xid.clone(), 5, None)];
    let says = |w: Writer| move |l: &[crate::klog::Line]| Ok(vec![w; l.len()]);
    assert_eq!(
        check_writer(&lines, false, false, says(Writer::Kernel)),
        Ok(())
    );
    let e = check_writer(
        &lines,
        false,
        false,
        says(Writer::UserSpace { facility: 1 }),
    )
    .unwrap_err();
    assert!(
        e.contains("from user space (facility 1), not by the kernel") && e.contains("NVRM: Xid"),
        "{e}"
    );
    assert_eq!(
        check_writer(&lines, false, true, says(Writer::UserSpace { facility: 1 })),
        Ok(())
    );
    let e = check_writer(&lines, false, true, says(Writer::OtherTime)).unwrap_err();
    assert!(e.contains("only at other times"), "{e}");
    let e = check_writer(&lines, false, true, says(Writer::NotFound)).unwrap_err();
    assert!(e.contains("not found at a record's start"), "{e}");
    let e = check_writer(&lines, false, false, |_: &[crate::klog::Line]| {
        Err(std::io::Error::from_raw_os_error(libc::EACCES))
    })
    .unwrap_err();
    assert!(e.contains("cannot be checked"), "{e}");
    assert!(check_writer(&[], false, false, says(Writer::Kernel)).is_err());
    // NVML's or a tracepoint's record: nothing to check in the log.
    assert_eq!(
        check_writer(&[], true, false, says(Writer::NotFound)),
        Ok(())
    );
    // One of the lines the kernel's: the fault is real.
    let two = vec![
        crate::klog::Line::new(xid.clone(), 5, None),
        crate::klog::Line::new(xid, 6, None),
    ];
    assert_eq!(
        check_writer(&two, false, false, |_: &[crate::klog::Line]| Ok(vec![
            Writer::UserSpace { facility: 1 },
            Writer::Kernel
        ])),
        Ok(())
    );
}
