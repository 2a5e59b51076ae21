//! Unit tests of the parent module (real line shapes; see also tests/corpus.rs).
use super::*;

fn xid(line: &str) -> (u32, String, Option<u32>, Option<String>, Severity) {
    match classify(line) {
        Some(KmsgClass::Xid {
            xid,
            pci,
            xid_pid,
            xid_process,
            severity,
            ..
        }) => (xid, pci, xid_pid, xid_process, severity),
        other => panic!("not an Xid: {line:?} -> {other:?}"),
    }
}

#[test]
fn xid_with_pid_and_name() {
    let (x, pci, pid, name, sev) =
        xid("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.");
    assert_eq!(
        (x, pci.as_str(), pid, name.as_deref(), sev),
        (
            79,
            "0000:3b:00.0",
            Some(1234),
            Some("python3"),
            Severity::Critical
        )
    );
}

#[test]
fn xid_with_unknown_pid_and_older_shapes() {
    let (x, pci, pid, name, _) = xid("NVRM: Xid (PCI:0000:b3:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.");
    assert_eq!(
        (x, pci.as_str(), pid, name),
        (48, "0000:b3:00.0", None, None)
    );
    let (x, pci, pid, name, sev) = xid("NVRM: Xid (PCI:0000:17:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address");
    assert_eq!(
        (x, pci.as_str(), pid, name, sev),
        (13, "0000:17:00.0", None, None, Severity::Error)
    );
    let (x, _, pid, _, sev) = xid("NVRM: Xid (PCI:0000:ca:00): 63, pid=2897, Row Remapper: New row marked for remapping, reset gpu to activate.");
    assert_eq!((x, pid, sev), (63, Some(2897), Severity::Warning));
    let (x, _, _, _, sev) = xid("[  123.456] NVRM: Xid (PCI:0000:41:00): 119, pid=911, name=python, Timeout after 6s of waiting for RPC response from GPU0 GSP!");
    assert_eq!((x, sev), (119, Severity::Critical));
}

#[test]
fn every_listed_xid_has_a_meaning_and_fatal_ones_are_critical() {
    for x in [
        13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 149, 154,
    ] {
        assert!(!xid_info(x).0.starts_with("unlisted"), "Xid {x}");
    }
    for x in [48, 62, 64, 74, 79, 95, 119, 120, 140] {
        assert_eq!(xid_info(x).1, Severity::Critical, "Xid {x}");
    }
    assert_eq!(xid_info(43).1, Severity::Info);
}

#[test]
fn fallen_off_bus_without_xid() {
    let c = classify("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330)\nNVRM: installed in this system has fallen off the bus and is not responding to commands.");
    assert_eq!(
        c,
        Some(KmsgClass::GpuFallenOffBus {
            pci: "0000:b3:00.0".into(),
            severity: Severity::Critical
        })
    );
}

#[test]
fn nvswitch_sxid() {
    match classify("nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)") {
        Some(KmsgClass::Sxid { sxid, pci, severity, .. }) => assert_eq!((sxid, pci.as_str(), severity), (12028, "0000:05:00.0", Severity::Warning)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn aer_old_and_new_formats() {
    let old = classify("pcieport 0000:00:1c.5: PCIe Bus Error: severity=Corrected, type=Physical Layer, id=00e5(Receiver ID)");
    assert_eq!(
        old,
        Some(KmsgClass::Aer {
            severity: "corrected".into(),
            error_type: Some("Physical Layer".into()),
            device: "0000:00:1c.5".into(),
            driver: "pcieport".into()
        })
    );
    let new = classify("pcieport 0000:00:03.1: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)");
    assert_eq!(new.as_ref().map(KmsgClass::severity), Some(Severity::Error));
    let gpu = classify("nvidia 0000:81:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Inaccessible, (Unregistered Agent ID)");
    match gpu {
        Some(KmsgClass::Aer {
            severity,
            device,
            driver,
            ..
        }) => assert_eq!(
            (severity.as_str(), device.as_str(), driver.as_str()),
            ("uncorrected_fatal", "0000:81:00.0", "nvidia")
        ),
        other => panic!("{other:?}"),
    }
    let recv = classify(
        "pcieport 0000:00:03.1: AER: Correctable error message received from 0000:00:00.0",
    );
    assert_eq!(
        recv.as_ref().map(KmsgClass::severity),
        Some(Severity::Warning)
    );
    let recv_old = classify("pcieport 0000:00:1c.5: AER: Corrected error received: id=00e5");
    assert!(matches!(recv_old, Some(KmsgClass::Aer { .. })));
}

#[test]
fn oom_hung_mce_link() {
    assert_eq!(
        classify("Memory cgroup out of memory: Killed process 4711 (pt_data_worker) total-vm:1234kB, anon-rss:1000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:40kB oom_score_adj:0"),
        Some(KmsgClass::OomKill { victim_pid: 4711, victim_comm: "pt_data_worker".into(), memcg: true })
    );
    assert!(matches!(
        classify("Out of memory: Killed process 99 (python3) total-vm:1kB"),
        Some(KmsgClass::OomKill {
            victim_pid: 99,
            memcg: false,
            ..
        })
    ));
    assert_eq!(
        classify("INFO: task python3:5123 blocked for more than 122 seconds."),
        Some(KmsgClass::HungTask {
            task: "python3".into(),
            task_pid: 5123,
            seconds: 122
        })
    );
    assert!(matches!(
        classify("mce: [Hardware Error]: Machine check events logged"),
        Some(KmsgClass::MachineCheck { .. })
    ));
    assert!(matches!(
        classify("EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"),
        Some(KmsgClass::MachineCheck { .. })
    ));
    assert_eq!(
        classify("mlx5_core 0000:3b:00.0 ib0: Link is Down"),
        Some(KmsgClass::LinkDown {
            iface: "ib0".into()
        })
    );
    assert_eq!(
        classify("e1000e: eth0 NIC Link is Up 1000 Mbps Full Duplex"),
        Some(KmsgClass::LinkUp {
            iface: "eth0".into()
        })
    );
}

#[test]
fn informational_lines_are_not_errors() {
    for l in [
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
        "nvidia-nvlink: Nvlink Core is being initialized, major device number 234",
        "pcieport 0000:00:01.0: AER: enabled with IRQ 26",
        "EXT4-fs (vda): mounted filesystem with ordered data mode",
        "",
    ] {
        assert_eq!(classify(l), None, "{l}");
    }
}

#[test]
fn old_driver_mig_and_chained_xids() {
    let (x, pci, pid, _, _) =
        xid("NVRM: Xid (0000:01:00): 31, Ch 00000010, engmask 00000101, intr 10000000");
    assert_eq!((x, pci.as_str(), pid), (31, "0000:01:00.0", None));
    match classify("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 31, pid=1234, name=python, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2d_1a000000.") {
        Some(KmsgClass::Xid { xid, gpu_instance, implicates, .. }) => assert_eq!((xid, gpu_instance, implicates), (31, Some(5), "hardware_or_application")),
        other => panic!("{other:?}"),
    }
    match classify("NVRM: Xid (PCI:0000:41:00): 45, pid=911, name=python, Ch 00000010, caused by previous Xid 79") {
        Some(KmsgClass::Xid { previous_xid, action, .. }) => assert_eq!((previous_xid, action), (Some(79), "none")),
        other => panic!("{other:?}"),
    }
    match classify(
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
    ) {
        Some(KmsgClass::Xid { action, .. }) => assert_eq!(action_text(action), "reboot the node"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_catalog_covers_every_documented_code() {
    for x in 1..=172 {
        assert!(
            xid_entry(x).is_some() || [].contains(&x),
            "Xid {x} missing from data/xid-catalog.tsv"
        );
    }
    assert!(xid_maybe_application(13) && xid_maybe_application(31) && xid_maybe_application(43));
    assert!(!xid_maybe_application(48) && !xid_maybe_application(79) && !xid_maybe_application(95));
    assert!(sxid_entry(12028).is_some());
}

#[test]
fn older_oom_wording() {
    assert!(matches!(
        classify("Out of memory: Kill process 3021 (python) score 912 or sacrifice child"),
        Some(KmsgClass::OomKill {
            victim_pid: 3021,
            memcg: false,
            ..
        })
    ));
    assert!(matches!(classify("Killed process 3021 (python) total-vm:71234552kB, anon-rss:61234000kB, file-rss:0kB, shmem-rss:0kB"), Some(KmsgClass::OomKill { victim_pid: 3021, .. })));
    assert!(matches!(classify("Memory cgroup out of memory: Kill process 77 (pt_main_thread) score 1000 or sacrifice child"), Some(KmsgClass::OomKill { victim_pid: 77, memcg: true, .. })));
}

#[test]
fn new_kernel_classes() {
    let c = |l: &str| classify(l).unwrap_or_else(|| panic!("unclassified: {l}"));
    assert_eq!(
        c("nfs: server storage01 not responding, still trying"),
        KmsgClass::NetFsDown {
            server: "storage01".into(),
            fs: "nfs".into()
        }
    );
    assert_eq!(
        c("nfs: server storage01 OK"),
        KmsgClass::NetFsOk {
            server: "storage01".into(),
            fs: "nfs".into()
        }
    );
    assert!(matches!(
        c("watchdog: BUG: soft lockup - CPU#3 stuck for 22s! [python:1234]"),
        KmsgClass::SoftLockup {
            cpu: 3,
            seconds: 22
        }
    ));
    assert_eq!(
        c("rcu: INFO: rcu_sched detected stalls on CPUs/tasks:"),
        KmsgClass::RcuStall
    );
    assert!(matches!(c("python[8812]: segfault at 10 ip 00007f3a1c2b4d5e sp 00007ffd1a2b3c40 error 4 in libcuda.so.535.104.05[7f3a1b000000+1e00000]"), KmsgClass::Segfault { crashed_pid: 8812, gpu_library: true, .. }));
    assert!(matches!(c("python3[77]: segfault at 0 ip 0000000000401000 sp 00007ffc0 error 6 in python3.10[400000+1000]"), KmsgClass::Segfault { gpu_library: false, .. }));
    assert!(matches!(
        c("CPU3: Core temperature above threshold, cpu clock throttled (total events = 1)"),
        KmsgClass::CpuThermal { cpu: 3, .. }
    ));
    assert!(matches!(c("mce: CPU7: Package temperature above threshold, cpu clock throttled (total events = 12)"), KmsgClass::CpuThermal { cpu: 7, .. }));
    assert!(matches!(c("mlx5_core 0000:3b:00.0: mlx5_cmd_out_err:838:(pid 0): health compromised - reached miss count"), KmsgClass::NicError { .. }));
    assert!(matches!(
        c("infiniband mlx5_0: dump_cqe:272:(pid 0): dump error cqe"),
        KmsgClass::NicError { .. }
    ));
    assert_eq!(c("blk_update_request: I/O error, dev sdb, sector 123456 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0"), KmsgClass::BlockError { dev: "sdb".into(), kind: "io_error".into() });
    assert_eq!(c("I/O error, dev nvme0n1, sector 98765 op 0x1:(WRITE) flags 0x8800 phys_seg 1 prio class 2"), KmsgClass::BlockError { dev: "nvme0n1".into(), kind: "io_error".into() });
    assert_eq!(
        c("nvme nvme0: I/O 123 QID 4 timeout, aborting"),
        KmsgClass::BlockError {
            dev: "nvme0".into(),
            kind: "nvme_timeout".into()
        }
    );
    assert_eq!(
        c("nvme nvme1: controller is down; will reset: CSTS=0x3, PCI_STATUS=0x10"),
        KmsgClass::BlockError {
            dev: "nvme1".into(),
            kind: "nvme_reset".into()
        }
    );
    assert!(matches!(
        c("Buffer I/O error on dev sda1, logical block 0, async page read"),
        KmsgClass::BlockError { .. }
    ));
    assert!(matches!(
        c("CMCI storm detected: switching to poll mode"),
        KmsgClass::MachineCheck {
            uncorrected: false,
            ..
        }
    ));
    assert!(matches!(
        c("EDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"),
        KmsgClass::MachineCheck {
            uncorrected: true,
            ..
        }
    ));
    assert!(matches!(
        c("EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"),
        KmsgClass::MachineCheck {
            uncorrected: false,
            ..
        }
    ));
    assert!(matches!(
        c("[ 1234.567890] mce: [Hardware Error]: Machine check events logged"),
        KmsgClass::MachineCheck { .. }
    ));
    assert!(matches!(
        c("NFS: Stale file handle on server storage01"),
        KmsgClass::StaleHandle { .. }
    ));
}

#[test]
fn process_names_are_never_evidence() {
    // Redteam 3.5: comm is the process's own text; the kernel puts it first.
    for l in [
        "EDAC MC0: 1 UE[20803]: segfault at 0 ip 000055d0c0a0113d sp 00007ffd3b1c0a20 error 6 in spoof[55d0c0a01000+1000]",
        "x Link is Down[777]: segfault at 0 ip 0000000000401000 sp 00007ffc00000000 error 4 in spoof[401000+1000]",
        "NVRM: Xid (PCI:0[42]: segfault at 0 ip 0000000000401000 sp 00007ffc00000000 error 4",
        "traps: mce: [Hardwar[99] general protection fault ip:401000 sp:7ffc0 error:0 in spoof[401000+1000]",
    ] {
        assert!(matches!(classify(l), Some(KmsgClass::Segfault { .. }) | None), "{l}: {:?}", classify(l));
    }
    // A name holding a forged `[pid] trap` does not choose the crashed pid.
    assert!(matches!(
        classify("traps: a[21615] trap x[21624] trap invalid opcode ip:401000 sp:7ffc error:0"),
        Some(KmsgClass::Segfault {
            crashed_pid: 21624,
            ..
        })
    ));
    // A hung task named like an Xid is a hung task.
    assert!(matches!(
        classify("INFO: task NVRM: Xid (PCI:0:42 blocked for more than 120 seconds."),
        Some(KmsgClass::HungTask { .. })
    ));
    // Unanchored text later in a line is not a kernel subsystem's message.
    assert_eq!(
        classify("audit: comm=\"EDAC MC0: 1 UE\" exe=/tmp/spoof"),
        None
    );
    assert_eq!(
        classify("some driver said: NVRM: Xid (PCI:0000:3b:00): 79, fake"),
        None
    );
}

#[test]
fn pci_normalisation() {
    assert_eq!(normalize_pci("00000000:3B:00.0"), "0000:3b:00.0");
    assert_eq!(normalize_pci("0000:3b:00"), "0000:3b:00.0");
    assert_eq!(normalize_pci("3b:00.1"), "0000:3b:00.1");
}

/// redteam4 D-2: one printk call holding a newline arrives in `printk:console` mode as one
/// record of several lines. A mount option `x\nNVRM: Xid ...` in a user namespace made
/// tmpfs's error a kernel Xid 79: a line after the first counts only when it carries the
/// first line's producer.
#[test]
fn a_line_quoted_inside_another_producers_message_is_not_a_kernel_line() {
    for forged in [
        "tmpfs: Unknown parameter 'x\nNVRM: Xid (PCI:0000:00:03): 79, pid=1, GPU has fallen off the bus.'",
        "tmpfs: Unknown parameter 'x\nNVRM: GPU at PCI:0000:00:03: GPU-0 has fallen off the bus.'",
        "tmpfs: Unknown parameter 'x\nmce: [Hardware Error]: Machine check events logged'",
        "tmpfs: Unknown parameter 'x\npcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:00:01.0'",
    ] {
        assert_eq!(classify(forged), None, "{forged:?}");
    }
    // The kernel's own multi-line records still count, every line of one producer.
    let nvrm = "NVRM: GPU at PCI:0000:3b:00: GPU-5f2a\nNVRM: GPU Board Serial Number: 1234\nNVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python, GPU has fallen off the bus.";
    assert!(
        matches!(
            classify(nvrm),
            Some(KmsgClass::Xid { xid: 79, .. } | KmsgClass::GpuFallenOffBus { .. })
        ),
        "{:?}",
        classify(nvrm)
    );
    let off_bus = "NVRM: GPU at PCI:0000:3b:00: GPU-5f2a\nNVRM: GPU has fallen off the bus.";
    assert!(matches!(
        classify(off_bus),
        Some(KmsgClass::GpuFallenOffBus { .. })
    ));
}

/// redteam4 D-1: a record that starts with a name a user chooses is not evidence: a network
/// device renamed in the user's own namespace, a process's name before its pid in the
/// kernel's remarks about it. The real MCE, EDAC and mlx5 records still are.
#[test]
fn a_name_a_user_chooses_at_a_records_start_is_not_evidence() {
    for forged in [
        "mce_notify_irq: renamed from fatal",
        "mlx5_0: renamed from failed",
        "EDAC MC0: 1 UE: renamed from x (while UP)",
        "EDAC 0: UE[1719] misaligned vsyscall (exploit attempt or buggy program) -- look up the vsyscall option in your kernel docs",
        "EDAC 0: UE (2003): /proc/2003/oom_adj is deprecated, please use /proc/2003/oom_score_adj instead.",
        "mce_notify_irq: 3 callbacks suppressed",
    ] {
        assert_eq!(classify(forged), None, "{forged:?}");
    }
    for real in [
        "mce: [Hardware Error]: Machine check events logged",
        "EDAC MC0: 1 UE memory read error on CPU_SrcID#0_MC#0_Chan#1_DIMM#0 (channel:1 slot:0 page:0x12345 offset:0x0 grain:32)",
        "mlx5_core 0000:3b:00.0: mlx5_health_try_recover:327:(pid 1234): health compromised - reached miss count",
    ] {
        assert!(classify(real).is_some(), "{real:?}");
    }
}
