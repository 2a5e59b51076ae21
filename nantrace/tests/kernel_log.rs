//! Privileged: the kernel log, whatever the kernel and its console settings: an Xid with a
//! quiet console from either source (printk:console, /dev/kmsg), and kernel text a user
//! controls (a file name in a segfault report) never becoming evidence.
mod common;

use std::time::Duration;

use common::*;

/// A quiet console (`dmesg -n 1`, as many servers run): the Xid at level 4 is printed on no
/// console and must arrive anyway, through the source the startup check chose (on 5.10
/// `printk:console` fires only for printed records, so there it is /dev/kmsg), and then
/// through /dev/kmsg forced, so that reader runs on every kernel. The event's time is the
/// record's own, on the probes' clock: between the write and its arrival.
#[test]
fn an_xid_arrives_with_a_quiet_console_from_either_kernel_log_source() {
    if !privileged("an_xid_arrives_with_a_quiet_console_from_either_kernel_log_source") {
        return;
    }
    let _quiet = ConsoleLevel::set(1);
    for (pid, env) in [(4242, &[][..]), (4243, &[("NANTRACE_KLOG", "kmsg")][..])] {
        let w = Watch::start_env(&[], env);
        let before = mono_ns();
        kmsg(&format!(
            "NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python3, GPU has fallen off the bus."
        ));
        let (e, _) = w.wait_for(
            "Xid 79 event with a quiet console",
            Duration::from_secs(10),
            |v| v["source"] == "xid" && v["xid_pid"] == pid,
        );
        let after = mono_ns();
        assert_eq!(e["xid"], 79);
        assert_eq!(e["pci"], "0000:3b:00.0");
        assert_eq!(e["xid_process"], "python3");
        let t = e["mono_ns"].as_u64().unwrap();
        // 5 ms of slack: /dev/kmsg's clock is fitted to the monotonic one on a marker.
        assert!(
            t + 5_000_000 >= before && t <= after + 5_000_000,
            "event time {t} outside the write {before}..{after}: {e}"
        );
        let acct = w.stop();
        let src = &acct["accounting"]["kernel_log"];
        eprintln!("kernel log source: {src}");
        if env.is_empty() {
            assert!(
                src["source"] == "printk:console" || src["source"] == "/dev/kmsg",
                "{src}"
            );
        } else {
            assert_eq!(src["source"], "/dev/kmsg", "{src}");
            assert_eq!(
                acct["accounting"]["kernel_drops"]["kmsg_overwritten"], 0,
                "{acct}"
            );
            let attached = acct["accounting"]["probes_attached"].as_array().unwrap();
            assert!(
                attached.iter().any(|p| p == "/dev/kmsg")
                    && !attached.iter().any(|p| p == "printk:console"),
                "one source only: {attached:?}"
            );
        }
        // One event per line: the two sources never both deliver it.
        assert_eq!(w_count_xid(&acct), 1, "{acct}");
    }
}

fn w_count_xid(acct: &serde_json::Value) -> u64 {
    acct["accounting"]["events"]["xid"].as_u64().unwrap_or(0)
}

/// D-1 of the third adversarial test: any user can make the kernel print a line of their
/// choosing inside a segfault report (` in <file name>[...]`, a KERN_CONT continuation of the
/// `comm[pid]: segfault at ...` record), and a file name may hold newlines. A program named
/// `x\nNVRM: Xid (...): 79, ...` that faults, run as nobody in no job: the forged text reaches
/// the kernel log (checked), and no Xid event comes of it, on either kernel log source.
#[test]
fn an_xid_forged_in_a_file_name_is_not_an_xid() {
    if !privileged("an_xid_forged_in_a_file_name_is_not_an_xid") {
        return;
    }
    let dir = Scratch::new("forge");
    sh_ok(&format!("chmod 755 {}", dir.0.display()));
    let src = dir.0.join("segv.c");
    std::fs::write(&src, "int main(void) { return *(volatile int *)0; }\n").unwrap();
    let forged =
        "x\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n";
    let exe = dir.0.join(forged);
    gcc(&src, &exe, &[]);
    // Segfault reports are printed when debug.exception-trace is 1 (the default).
    let trace = std::fs::read_to_string("/proc/sys/debug/exception-trace").unwrap_or_default();
    for env in [&[][..], &[("NANTRACE_KLOG", "kmsg")][..]] {
        let w = Watch::start_env(&[], env);
        let st = std::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(&exe)
            .status()
            .unwrap();
        assert!(!st.success(), "the forger did not fault: {st}");
        if trace.trim() == "1" {
            w.wait_for(
                "the forged text in the kernel log",
                Duration::from_secs(10),
                |v| {
                    v["source"] == "kmsg"
                        && v["text"]
                            .as_str()
                            .is_some_and(|t| t.contains("GPU has fallen off the bus"))
                },
            );
        }
        std::thread::sleep(Duration::from_millis(500));
        let xids = w.all(|v| v["source"] == "xid");
        assert!(
            xids.is_empty(),
            "a forged Xid became evidence ({env:?}): {xids:?}"
        );
        let acct = w.stop();
        assert_eq!(acct["accounting"]["events"].get("xid"), None, "{acct}");
    }
}

/// D-2 of the fourth adversarial test: a newline inside one printk call. Any user can mount a
/// tmpfs in their own user+mount namespace with an option named `x\nNVRM: Xid ... 79 ...`, and
/// the kernel logs `tmpfs: Unknown parameter 'x` and the forged line in one call (unescaped
/// in `printk:console` mode). Done here as root in a private mount namespace (the same kernel
/// message): the forged text is first seen to reach the kernel log, then no Xid comes of it,
/// on either source.
#[test]
fn an_xid_forged_in_a_mount_option_is_not_an_xid() {
    if !privileged("an_xid_forged_in_a_mount_option_is_not_an_xid") {
        return;
    }
    let dir = Scratch::new("mntforge");
    let line = "NVRM: Xid (PCI:0000:00:03): 79 GPU has fallen off the bus.";
    for env in [&[][..], &[("NANTRACE_KLOG", "kmsg")][..]] {
        let w = Watch::start_env(&[], env);
        let o = std::process::Command::new("unshare")
            .args([
                "-m",
                "sh",
                "-c",
                "mount -t tmpfs -o \"$(printf 'x\\n%s' \"$1\")\" none \"$2\"; true",
                "sh",
                line,
            ])
            .arg(&dir.0)
            // util-linux 2.39 and later mount through fsconfig(2), which may reject or log
            // the option otherwise: the classic mount(2), whose tmpfs logs the option whole.
            .env("LIBMOUNT_FORCE_MOUNT2", "always")
            .output()
            .expect("unshare (util-linux)");
        assert!(o.status.success(), "{o:?}");
        w.wait_for(
            "the forged mount option in the kernel log",
            Duration::from_secs(10),
            // As a kernel line, or (the defect) as the Xid it was taken for.
            |v| {
                let t = v.to_string();
                t.contains("Unknown parameter") && t.contains("fallen off the bus")
            },
        );
        std::thread::sleep(Duration::from_millis(500));
        let xids = w.all(|v| v["source"] == "xid");
        assert!(
            xids.is_empty(),
            "a forged Xid became evidence ({env:?}): {xids:?}"
        );
        let acct = w.stop();
        assert_eq!(acct["accounting"]["events"].get("xid"), None, "{acct}");
    }
}

/// D-1 of the fourth adversarial test: a network device's rename is logged as
/// `<new>: renamed from <old>`, both names the user's (any user can rename a device in their
/// own user+network namespace). Renamed `fatal` -> `mce_notify_irq` and `failed` -> `mlx5_0`
/// here as root in a namespace of the test's: each record is first seen in the kernel log,
/// then neither is a machine check nor a NIC error, on either source.
#[test]
fn a_renamed_network_device_is_not_machine_evidence() {
    if !privileged("a_renamed_network_device_is_not_machine_evidence") {
        return;
    }
    let ns = format!("ntrn-{}", std::process::id() % 100_000);
    let _ = sh(&format!("ip netns del {ns} 2>/dev/null"));
    sh_ok(&format!("ip netns add {ns}"));
    for (i, env) in [&[][..], &[("NANTRACE_KLOG", "kmsg")][..]]
        .into_iter()
        .enumerate()
    {
        let w = Watch::start_env(&[], env);
        sh_ok(&format!(
            "ip -n {ns} link add fatal type veth peer name ntrp{i} && ip -n {ns} link set fatal name mce_notify_irq && \
             ip -n {ns} link add failed type veth peer name ntrq{i} && ip -n {ns} link set failed name mlx5_0 && \
             ip -n {ns} link del mce_notify_irq && ip -n {ns} link del mlx5_0"
        ));
        for what in [
            "mce_notify_irq: renamed from fatal",
            "mlx5_0: renamed from failed",
        ] {
            w.wait_for(what, Duration::from_secs(10), |v| {
                v.to_string().contains(what)
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        let classed = w.all(|v| v.to_string().contains("renamed from") && !v["class"].is_null());
        assert!(
            classed.is_empty(),
            "a device's name became evidence ({env:?}): {classed:?}"
        );
        w.stop();
    }
    let _ = sh(&format!("ip netns del {ns}"));
}

/// redteam4 D-14, what a drain checks (`agent::drain::check_writer`): `/dev/kmsg` says who
/// wrote a line. A line root writes into /dev/kmsg (as this suite injects faults, and as
/// journald's `ForwardToKMsg` relays a user's text) is user space's, facility 1 (LOG_USER, set
/// by the kernel); a record the kernel wrote itself (a device renamed here) is the kernel's;
/// a line after a newline inside one record is no record's start.
#[test]
fn who_wrote_a_line_is_what_dev_kmsg_says() {
    use nantrace::klog::{who_wrote, Writer};
    if !privileged("who_wrote_a_line_is_what_dev_kmsg_says") {
        return;
    }
    let n = std::process::id() % 100_000;
    let forged = format!(
        "NVRM: Xid (PCI:0000:3b:00): 79, pid={n}, name=whowrote, GPU has fallen off the bus."
    );
    kmsg(&format!("<3>{forged}"));
    let quoted = format!(
        "NVRM: Xid (PCI:0000:3b:00): 79, pid={n}, name=quoted, GPU has fallen off the bus."
    );
    kmsg(&format!("<3>tmpfs: Unknown parameter 'x\n{quoted}'"));
    let ns = format!("ntww-{n}");
    let _ = sh(&format!("ip netns del {ns} 2>/dev/null"));
    sh_ok(&format!(
        "ip netns add {ns} && ip -n {ns} link add ntwa{n} type veth peer name ntwp{n} && \
         ip -n {ns} link set ntwa{n} name ntwb{n}"
    ));
    let renamed = format!("ntwb{n}: renamed from ntwa{n}");
    let now = mono_ns();
    let lines = [
        nantrace::klog::Line::new(forged, now, None),
        nantrace::klog::Line::new(renamed, now, None),
        nantrace::klog::Line::new(quoted, now, None),
    ];
    let t0 = std::time::Instant::now();
    let got = loop {
        let got = who_wrote(&lines).expect("read /dev/kmsg");
        if got[1] == Writer::Kernel || t0.elapsed() > Duration::from_secs(5) {
            break got;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = sh(&format!("ip netns del {ns}"));
    assert_eq!(
        got,
        [
            Writer::UserSpace { facility: 1 },
            Writer::Kernel,
            Writer::NotFound
        ],
        "who wrote {lines:?}"
    );
}

fn mono_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut t) },
        0
    );
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}
