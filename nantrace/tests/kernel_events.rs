//! Privileged: load the real probes, cause real kernel events, assert what arrived.
mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use common::*;

#[test]
fn xid_written_to_kmsg_arrives_decoded() {
    if !privileged("xid_written_to_kmsg_arrives_decoded") {
        return;
    }
    let w = Watch::start(&[]);
    let t0 = std::time::Instant::now();
    kmsg("NVRM: Xid (PCI:0000:3b:00): 79, pid=31337, name=python3, GPU has fallen off the bus.");
    let (e, _) = w.wait_for("Xid 79 event", Duration::from_secs(10), |v| {
        v["source"] == "xid" && v["xid_pid"] == 31337
    });
    let latency = t0.elapsed();
    assert_eq!(e["xid"], 79);
    assert_eq!(e["pci"], "0000:3b:00.0");
    assert_eq!(e["severity"], "critical");
    assert_eq!(e["xid_process"], "python3");
    assert!(e["time"].as_str().unwrap().ends_with('Z'));
    eprintln!("Xid arrived {latency:?} after the write");
    // An AER line in the newer format, through the same printk path.
    kmsg("pcieport 0000:00:03.1: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)");
    let (a, _) = w.wait_for("AER text event", Duration::from_secs(10), |v| {
        v["source"] == "aer"
    });
    assert_eq!(a["severity"], "error");
    assert_eq!(a["device"], "0000:00:03.1");
    let acct = w.stop();
    assert!(acct["accounting"]["events"]["xid"].as_u64().unwrap() >= 1);
    assert_eq!(acct["accounting"]["kernel_drops"]["kmsg"], 0);
}

#[test]
fn exit_code_and_sigkill_of_job_processes() {
    if !privileged("exit_code_and_sigkill_of_job_processes") {
        return;
    }
    // The root waits for a go file so that nantrace has seeded its pid before it forks.
    let go = std::env::temp_dir().join(format!("nt-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut root = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("while [ ! -e {0} ]; do sleep 0.05; done; sh -c 'exit 3'; sleep 30 & echo $! > {0}.kid; kill -9 $!; wait; exit 0", go.display()))
        .spawn()
        .unwrap();
    let root_pid = root.id().to_string();
    let w = Watch::start(&["--pid", &root_pid]);
    std::fs::write(&go, "").unwrap();
    let (e3, _) = w.wait_for("exit code 3", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["exit_code"] == 3
    });
    assert_eq!(e3["job"], true);
    // The exiting task's name and ids in the header (read from the task on the BTF path).
    assert_eq!(e3["comm"], "sh", "{e3}");
    assert_eq!(e3["tid"], e3["pid"], "{e3}");
    let (k, _) = w.wait_for("SIGKILL exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["signal"] == "SIGKILL"
    });
    let kid: u64 = std::fs::read_to_string(format!("{}.kid", go.display()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(k["pid"].as_u64(), Some(kid));
    assert_eq!(k["job"], true);
    assert_eq!(k["exit_code"], serde_json::Value::Null);
    let (s, _) = w.wait_for("SIGKILL signal", Duration::from_secs(10), |v| {
        v["source"] == "signal" && v["target_pid"].as_u64() == Some(kid)
    });
    assert_eq!(s["signal"], "SIGKILL");
    assert_eq!(s["job"], true);
    // kill(2) from the shell: SI_USER (0), and the target's own name (the background job is
    // killed at once, often before its fork has exec'd sleep).
    assert_eq!(s["si_code"], 0, "{s}");
    assert!(
        s["target_comm"] == "sleep" || s["target_comm"] == "sh",
        "{s}"
    );
    assert_eq!(root.wait().unwrap().code(), Some(0));
    let (r, _) = w.wait_for("root exit 0", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(u64::from(root.id()))
    });
    assert_eq!(r["exit_code"], 0);
    // Forks of the job are attributed: the `sh -c 'exit 3'` child and the sleep.
    let forks = w.all(|v| v["source"] == "fork" && v["pid"].as_u64() == Some(u64::from(root.id())));
    assert!(forks.len() >= 2, "forks of the root: {forks:?}");
    assert!(forks.iter().any(|f| f["child_pid"].as_u64() == Some(kid)));
    assert_probe_path(
        &w.stop(),
        &["sched:sched_process_fork", "sched:sched_process_exit"],
    );
    let _ = std::fs::remove_file(&go);
    let _ = std::fs::remove_file(format!("{}.kid", go.display()));
}

#[test]
fn oom_kill_in_memory_limited_cgroup_is_a_job_event() {
    if !privileged("oom_kill_in_memory_limited_cgroup_is_a_job_event") {
        return;
    }
    let cg = MemCgroup::new(
        &format!("nantrace-test-oom-{}", std::process::id()),
        48 << 20,
    );
    let go = std::env::temp_dir().join(format!("nt-oom-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    // The root (watched) forks a shell that joins the cgroup and becomes `tail /dev/zero`,
    // which buffers an endless line until the OOM killer takes it.
    let mut root = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while [ ! -e {go} ]; do sleep 0.05; done; sh -c 'echo $$ > {procs}; echo $$ > {go}.kid; exec tail /dev/zero'; exit 0",
            go = go.display(),
            procs = cg.procs().display()
        ))
        .spawn()
        .unwrap();
    let w = Watch::start(&["--pid", &root.id().to_string()]);
    std::fs::write(&go, "").unwrap();
    let (o, _) = w.wait_for("OOM victim", Duration::from_secs(30), |v| {
        v["source"] == "oom"
    });
    let kid: u64 = std::fs::read_to_string(format!("{}.kid", go.display()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(o["victim_pid"].as_u64(), Some(kid));
    assert_eq!(o["victim_job"], true);
    // Before 5.14 the record is the pid alone (no name, no sizes): the name is read from
    // /proc while the victim dies (it can be gone already), and the size is the kernel line's.
    let format = std::fs::read_to_string("/sys/kernel/tracing/events/oom/mark_victim/format")
        .unwrap_or_default();
    let full_record = format.contains("anon_rss");
    let rss = o["anon_rss_kb"].as_u64().unwrap_or(0);
    if full_record {
        assert_eq!(o["victim_comm"], "tail");
        // The victim's RSS is in kB and fits the 48 MiB limit (it was 4x too large when the
        // tracepoint's kB values were taken for pages).
        assert!(
            rss > 20_000 && rss <= 48 * 1024,
            "victim RSS {rss} kB, limit 49152 kB: {o}"
        );
    } else {
        assert!(o["victim_comm"] == "tail" || o["victim_comm"] == "", "{o}");
        eprintln!(
            "oom:mark_victim has the pid only on this kernel; victim_comm from /proc: {}",
            o["victim_comm"]
        );
    }
    let (x, _) = w.wait_for("victim's exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(kid)
    });
    assert_eq!(x["signal"], "SIGKILL");
    // The kernel's own OOM report line also arrives through printk.
    let (line, _) = w.wait_for("OOM kill line", Duration::from_secs(10), |v| {
        v["class"] == "oom_kill" && v["victim_pid"].as_u64() == Some(kid)
    });
    // Two witnesses of one kill agree on its size: the kernel's own line prints anon-rss in kB.
    let text = line["text"].as_str().unwrap_or("");
    // Either of the kernel's two lines of the kill names the victim.
    assert!(
        text.contains("(tail)") || text.contains("task=tail,"),
        "{line}"
    );
    let kb = text
        .split("anon-rss:")
        .nth(1)
        .and_then(|r| r.split("kB").next())
        .and_then(|n| n.trim().parse::<u64>().ok());
    if let (Some(kb), true) = (kb, full_record) {
        assert!(
            kb.abs_diff(rss) * 10 <= kb.max(1),
            "tracepoint {rss} kB vs kernel line {kb} kB"
        );
    }
    let _ = root.wait();
    let _ = std::fs::remove_file(&go);
    let _ = std::fs::remove_file(format!("{}.kid", go.display()));
}

#[test]
fn odirect_writes_to_a_loop_device_give_block_events_with_latency() {
    if !privileged("odirect_writes_to_a_loop_device_give_block_events_with_latency") {
        return;
    }
    let img = std::env::temp_dir().join(format!("nt-loop-{}.img", std::process::id()));
    let lo = LoopDev::new(&img, "32M", None);
    let (dev, minor) = (lo.dev.clone(), lo.minor);
    let mut root = Gated::new(
        "dd",
        &format!("dd if=/dev/zero of={dev} bs=4k count=64 oflag=direct,dsync 2>/dev/null"),
    );
    // --slow-io-ms 0: every completed request is an event, so the test sees each one.
    let w = Watch::start(&["--pid", &root.id().to_string(), "--slow-io-ms", "0"]);
    root.go();
    assert!(root.wait().unwrap().success());
    let want = format!("7:{minor}");
    let (b, _) = w.wait_for(
        "block event on the loop device",
        Duration::from_secs(10),
        |v| v["source"] == "block" && v["dev"] == want.as_str(),
    );
    assert_eq!(b["comm"], "dd");
    assert_eq!(b["job"], true);
    assert_eq!(b["error"], 0);
    assert!(b["latency_ms"].as_f64().unwrap() > 0.0);
    assert!(b["rwbs"].as_str().unwrap().starts_with('W'), "{b}");
    // The rest of the 64 follow; a slow machine (a TCG guest) delivers them over seconds.
    let is_write = |v: &serde_json::Value| {
        v["source"] == "block" && v["dev"] == want.as_str() && v["bytes"] == 4096
    };
    let t0 = std::time::Instant::now();
    while w.all(is_write).len() < 64 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let writes = w.all(is_write);
    assert!(
        writes.len() >= 60,
        "expected ~64 4 KiB writes on {want}, got {}",
        writes.len()
    );
    assert!(
        writes.iter().all(|v| v["job"] == true && v["comm"] == "dd"),
        "a write not attributed to the job's dd: {writes:?}"
    );
    let acct = w.stop();
    // Every completion is in the device's histogram, and nothing was given up.
    let hist: u64 = acct["accounting"]["io_latency_histograms_log2_us"][want.as_str()]
        .as_array()
        .unwrap_or_else(|| panic!("no histogram for {want}: {acct}"))
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .sum();
    assert!(
        hist >= writes.len() as u64,
        "{hist} completions in the histogram of {want}, {} write events",
        writes.len()
    );
    assert_eq!(
        acct["accounting"]["block_losses"]["job_requests_not_attributed"], 0,
        "{acct}"
    );
    assert_eq!(
        acct["accounting"]["block_losses"]["completions_not_in_histograms"], 0,
        "{acct}"
    );
    assert!(
        acct["accounting"]["block_losses"]["runs_skipped_nested"].is_u64(),
        "the kernel's recursion_misses of the block programs: {acct}"
    );
    assert_probe_path(&acct, &["block:block_rq_issue", "block:block_rq_complete"]);
}

/// No silent gap on the BTF path: a completion that finds no issuer entry on a device the
/// job wrote to in the last 2 s is counted (`completions_without_issuer_on_job_devices`),
/// because it may be the job's (7.3's known gap, docs/kernel-matrix.md). Here 100 writes of
/// another process right after the job's on the same device, which are not the job's: they
/// are counted (an over-count the accounting's doc says), and not attributed. The tracefs
/// path records every issuer and counts nothing.
#[test]
fn completions_without_issuer_on_a_job_device_are_counted() {
    if !privileged("completions_without_issuer_on_a_job_device_are_counted") {
        return;
    }
    let img = std::env::temp_dir().join(format!("nt-gap-{}.img", std::process::id()));
    let lo = LoopDev::new(&img, "32M", None);
    let dev = lo.dev.clone();
    let want = format!("7:{}", lo.minor);
    // The job keeps writing until told to stop, so the other writes fall in its window
    // however slow the machine (a TCG guest).
    let stop = img.with_extension("stop");
    let _ = std::fs::remove_file(&stop);
    let mut root = Gated::new(
        "gapjob",
        &format!(
            "while [ ! -e {s} ]; do dd if=/dev/zero of={dev} bs=4k count=8 oflag=direct 2>/dev/null; sleep 0.05; done",
            s = stop.display()
        ),
    );
    let w = Watch::start(&["--pid", &root.id().to_string(), "--slow-io-ms", "0"]);
    root.go();
    let is_job_write = |v: &serde_json::Value| {
        v["source"] == "block" && v["dev"] == want.as_str() && v["job"] == true
    };
    w.wait_for("the job's writes", Duration::from_secs(10), is_job_write);
    // Another process (not the job's), on the same device, within the window.
    sh_ok(&format!(
        "dd if=/dev/zero of={dev} bs=4k count=100 seek=4000 oflag=direct 2>/dev/null"
    ));
    std::fs::write(&stop, "").unwrap();
    assert!(root.wait().unwrap().success());
    let _ = std::fs::remove_file(&stop);
    let is_other = |v: &serde_json::Value| {
        v["source"] == "block" && v["dev"] == want.as_str() && v["job"] == false
    };
    let t0 = std::time::Instant::now();
    while w.all(is_other).len() < 100 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let acct = w.stop();
    let counted = acct["accounting"]["block_losses"]["completions_without_issuer_on_job_devices"]
        .as_u64()
        .unwrap_or_else(|| panic!("the counter in the accounting: {acct}"));
    if expect_btf_for("block:block_rq_complete") {
        assert!(
            counted >= 100,
            "{counted} counted, 100 completions without issuer: {acct}"
        );
    } else {
        assert_eq!(counted, 0, "the tracefs path: {acct}");
    }
    assert_probe_path(&acct, &["block:block_rq_issue", "block:block_rq_complete"]);
}

/// Two devices written at the same offsets at the same time (as RAID1 members are): the
/// in-flight requests of both share sectors and often driver tags, and each completion must
/// still be the job's, on its own device, with nothing given up.
/// Whether two requests overlap is up to timing: with the in-flight table keyed by sector and
/// tag alone (session 12's first version) it failed about one run in three.
#[test]
fn the_same_sectors_on_two_devices_at_once_are_each_the_jobs() {
    if !privileged("the_same_sectors_on_two_devices_at_once_are_each_the_jobs") {
        return;
    }
    let base = std::env::temp_dir().join(format!("nt-twin-{}", std::process::id()));
    let (l1, l2) = (
        LoopDev::new(&base.with_extension("1.img"), "32M", None),
        LoopDev::new(&base.with_extension("2.img"), "32M", None),
    );
    // One writer per device, in step: both devices have a request in flight at the same
    // offset, usually with the same driver tag, most of the time.
    let dd =
        |dev: &str| format!("dd if=/dev/zero of={dev} bs=4k count=1024 oflag=direct 2>/dev/null");
    let mut root = Gated::new("twin", &format!("{} & {} & wait", dd(&l1.dev), dd(&l2.dev)));
    let w = Watch::start(&["--pid", &root.id().to_string(), "--slow-io-ms", "0"]);
    root.go();
    assert!(root.wait().unwrap().success());
    let want = [format!("7:{}", l1.minor), format!("7:{}", l2.minor)];
    for d in &want {
        w.wait_for("writes on both devices", Duration::from_secs(10), |v| {
            v["source"] == "block" && v["dev"] == d.as_str()
        });
    }
    let mut unattributed = 0u64;
    for d in &want {
        let is_write = |v: &serde_json::Value| {
            v["source"] == "block" && v["dev"] == d.as_str() && v["bytes"] == 4096
        };
        let t0 = std::time::Instant::now();
        while w.all(is_write).len() < 1024 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let writes = w.all(is_write);
        assert!(
            writes.len() >= 1020,
            "expected 1024 4 KiB writes on {d}, got {}",
            writes.len()
        );
        let not_job: Vec<_> = writes
            .iter()
            .filter(|v| v["job"] != true || v["comm"] != "dd")
            .collect();
        // Never another process's: a write not the job's is one whose completion found no
        // issuer (pid 0, the completion's context). A few of those are a known gap on 7.3's
        // BTF path under single-threaded TCG (4 and 13 of 1024 in the clean-clone run of
        // 2026-12-02 01:14, 1 of 1024 under multi-threaded TCG; never on 5.10-6.18 or the
        // host): docs/kernel-matrix.md. More than 2 % is a failure, and so is one not counted
        // in the accounting (below).
        assert!(
            not_job.iter().all(|v| v["pid"] == 0 && v["job"] == false),
            "a write on {d} attributed to another process: {not_job:?}"
        );
        if !not_job.is_empty() {
            eprintln!(
                "KNOWN GAP: {} of {} writes on {d} completed without their issuer (pid 0): {:?}",
                not_job.len(),
                writes.len(),
                not_job.first()
            );
        }
        assert!(
            not_job.len() * 50 <= writes.len(),
            "{} of {} writes on {d} not attributed to the job's dd: {:?}",
            not_job.len(),
            writes.len(),
            not_job.first()
        );
        unattributed += not_job.len() as u64;
    }
    let acct = w.stop();
    let losses = &acct["accounting"]["block_losses"];
    assert_eq!(losses["job_requests_not_attributed"], 0, "{acct}");
    // No silent gap: every write whose completion found no issuer is counted in the bundle's
    // accounting (and `nantrace_block_losses_total`) as a completion without issuer on a
    // device the job used (0 on the tracefs path, which has no such write).
    assert!(
        losses["completions_without_issuer_on_job_devices"]
            .as_u64()
            .is_some_and(|c| c >= unattributed),
        "{unattributed} writes not attributed, not all counted: {losses}"
    );
    assert_probe_path(&acct, &["block:block_rq_issue", "block:block_rq_complete"]);
}

/// A real block I/O error: a loop device over a sparse file on a 1 MiB tmpfs. Writing 4 MiB
/// through it fills the tmpfs; the loop driver completes the requests it cannot back with
/// BLK_STS_NOSPC, which the probes must report as errors (-ENOSPC), with the issuer.
#[test]
fn writes_past_a_full_backing_store_give_block_errors() {
    if !privileged("writes_past_a_full_backing_store_give_block_errors") {
        return;
    }
    let mnt = std::env::temp_dir().join(format!("nt-full-{}", std::process::id()));
    std::fs::create_dir_all(&mnt).unwrap();
    sh_ok(&format!(
        "mount -t tmpfs -o size=1M nantrace-test {}",
        mnt.display()
    ));
    let lo = LoopDev::new(
        &mnt.join("disk.img"),
        "16M",
        Some(format!("umount {0} && rmdir {0}", mnt.display())),
    );
    let (dev, minor) = (lo.dev.clone(), lo.minor);
    let mut root = Gated::new(
        "full",
        &format!("dd if=/dev/zero of={dev} bs=64k count=64 oflag=direct 2>/dev/null; exit 0"),
    );
    let w = Watch::start(&["--pid", &root.id().to_string()]);
    root.go();
    assert!(root.wait().unwrap().success());
    let want = format!("7:{minor}");
    let (b, _) = w.wait_for(
        "block error on the loop device",
        Duration::from_secs(10),
        |v| v["source"] == "block" && v["dev"] == want.as_str() && v["error"] != 0,
    );
    // ENOSPC from the full tmpfs; 5.10's loop driver completes such a write with
    // BLK_STS_IOERR, which the kernel's own tracefs record shows as -5 too.
    assert!(
        b["error"] == -28 || b["error"] == -5,
        "ENOSPC (or EIO before 5.12) from the full tmpfs: {b}"
    );
    assert_eq!(b["job"], true, "the job's dd issued it: {b}");
    assert_eq!(b["comm"], "dd");
    assert!(b["rwbs"].as_str().unwrap().starts_with('W'), "{b}");
    assert_probe_path(&w.stop(), &["block:block_rq_complete"]);
}

/// The guests' hang of 12-01 (5.10 twice, 7.3 once, 6.12): `nantrace watch` made a new
/// `ctrl_c()` future at every turn of its loop, so a SIGINT that came while it was writing a
/// batch had no listener and was lost; once the job was over the watch idled forever and the
/// test waited on it. Made certain here: nobody reads the watch's stdout while the job floods
/// it with events, so the watch is blocked writing a batch when the SIGINT comes; then the
/// flood ends and the reading goes on. The watch must then exit by itself (the lost SIGINT:
/// it never did, in every run before the fix).
#[test]
fn a_sigint_while_watch_is_blocked_writing_still_stops_it() {
    if !privileged("a_sigint_while_watch_is_blocked_writing_still_stops_it") {
        return;
    }
    let scratch = Scratch::new("sigint");
    let stop = scratch.join("stop");
    let mut root = Gated::new(
        "sigint",
        &format!(
            "i=0; while [ $i -lt 200000 ] && [ ! -e {} ]; do /bin/true; i=$((i+1)); done; exit 0",
            stop.display()
        ),
    );
    let mut w = Watch::start(&["--pid", &root.id().to_string()]);
    root.go();
    w.wait_for("the flood's first exec", Duration::from_secs(30), |v| {
        v["source"] == "exec"
    });
    w.shrink_stdout_pipe();
    w.pause_reading(true);
    // Blocked: one of the watch's threads waits in a pipe write (a page of lines unread).
    let t0 = std::time::Instant::now();
    let blocked = loop {
        let in_write = std::fs::read_dir(format!("/proc/{}/task", w.pid()))
            .map(|rd| {
                rd.flatten().any(|t| {
                    std::fs::read_to_string(t.path().join("wchan"))
                        .is_ok_and(|c| c.contains("pipe_write"))
                        || std::fs::read_to_string(t.path().join("stack"))
                            .is_ok_and(|c| c.contains("pipe_write"))
                })
            })
            .unwrap_or(false);
        if in_write || t0.elapsed() > Duration::from_secs(60) {
            break in_write;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        blocked,
        "the watch never blocked writing with its stdout unread; its threads:\n{}",
        stacks(w.pid())
    );
    // SAFETY: signalling our own child.
    unsafe { libc::kill(w.pid() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(&stop, "").unwrap();
    assert!(root.wait().unwrap().success());
    w.pause_reading(false);
    if !w.exits_within(Duration::from_secs(60)) {
        panic!(
            "the SIGINT sent while the watch was writing was lost: it did not exit within 60 s; its threads:\n{}",
            stacks(w.pid())
        );
    }
    let t0 = std::time::Instant::now();
    let acct = loop {
        if let Some(a) = w.all(|v| v.get("accounting").is_some()).pop() {
            break a;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no accounting line after the SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let execs = acct["accounting"]["events"]["exec"].as_u64().unwrap_or(0);
    assert!(execs >= 1, "the flood's execs counted: {acct}");
}

#[test]
fn dropped_packets_between_namespaces_give_tcp_retransmits() {
    if !privileged("dropped_packets_between_namespaces_give_tcp_retransmits") {
        return;
    }
    let net = NetPair::new(&format!("{}", std::process::id() % 100_000));
    let port = 29_500u16;
    // The drop rule goes in only once the server holds the connection and has read the
    // client's first bytes: put in earlier (a slow guest's softirq can hold the handshake's
    // last ACK while `nft` runs), it dropped that ACK, the connection never left SYN_RECV and
    // `accept` waited forever (the 5.10 guest's hang of 12-02: the test joining this thread,
    // `nantrace watch` idle). Every wait here has a limit.
    // The server holds the connection open until the test has its retransmits (`done`), not
    // for a read timeout: under load the client's three `nft` calls took longer than the 6 s
    // the server once read for, the server closed, and the retransmits came in CLOSE_WAIT
    // (5.10 guest with a busy CPU, 12-02).
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let server = NetPair::in_ns(&net.b, move || {
        let l = TcpListener::bind(("10.213.0.2", port)).unwrap();
        l.set_nonblocking(true).unwrap();
        let t0 = std::time::Instant::now();
        let mut s = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(
                        t0.elapsed() < Duration::from_secs(60),
                        "no connection within 60 s"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
        let mut hello = [0u8; 5];
        s.read_exact(&mut hello).expect("the client's hello");
        let _ = ready_tx.send(());
        let _ = done_rx.recv_timeout(Duration::from_secs(120));
        drop(s);
    });
    std::thread::sleep(Duration::from_millis(200));
    let w = Watch::start(&[]);
    let b = net.b.clone();
    let client = NetPair::in_ns(&net.a, move || {
        let mut s = TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([10, 213, 0, 2], port)),
            Duration::from_secs(60),
        )
        .unwrap();
        s.write_all(b"hello").unwrap();
        let local = s.local_addr().unwrap().port();
        ready_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server accepted and read the hello");
        // Drop everything the server side receives from now on.
        sh_ok(&format!(
            "ip netns exec {b} nft add table inet nt && ip netns exec {b} nft add chain inet nt in '{{ type filter hook input priority 0; }}' && ip netns exec {b} nft add rule inet nt in tcp dport {port} drop"
        ));
        s.write_all(&[7u8; 1000]).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        local
    });
    let sport = client.join().unwrap();
    // This connection's own retransmits, by its source port: a connection left by an earlier
    // run of this test (same addresses, in a namespace the kernel is still tearing down) can
    // still be retransmitting, and this watch sees the whole machine.
    let ours = |v: &serde_json::Value| {
        v["source"] == "tcp_retransmit"
            && v["dport"] == port
            && v["sport"].as_u64() == Some(u64::from(sport))
    };
    let (r, _) = w.wait_for("TCP retransmit", Duration::from_secs(10), ours);
    assert_eq!(r["saddr"], "10.213.0.1");
    assert_eq!(r["daddr"], "10.213.0.2");
    assert_eq!(r["state"], "ESTABLISHED");
    assert!(
        w.all(ours).len() >= 2,
        "RTO backoff should give several retransmits in 1.5 s"
    );
    let _ = done_tx.send(());
    let _ = server.join();
    drop(net);
}

/// Threads are not processes: a job process that starts three threads makes no fork events
/// of its own (the BTF fork program reads the child's tgid; the tracefs path marks threads in
/// `task:task_newtask`), while the fork that created it is one.
#[test]
fn a_jobs_threads_are_not_reported_as_forks() {
    if !privileged("a_jobs_threads_are_not_reported_as_forks") {
        return;
    }
    // A script first: exec's path is the script's (`bprm->filename`), not its interpreter's.
    let scratch = Scratch::new("script");
    let script = scratch.join("nt-script.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut root = Gated::new("thr", &format!("{}; {BIN} bench-internal synth-gen --rate 3000 --seconds 0.3 --burst 1 --threads 3 >/dev/null; exit 0", script.display()));
    let root_pid = u64::from(root.id());
    let w = Watch::start(&["--pid", &root_pid.to_string()]);
    let went = mono_ns();
    root.go();
    assert!(root.wait().unwrap().success());
    let (x, _) = w.wait_for(
        "exec of the threaded process",
        Duration::from_secs(10),
        |v| {
            v["source"] == "exec"
                && v["filename"]
                    .as_str()
                    .is_some_and(|f| f.ends_with("/nantrace"))
        },
    );
    let gen = x["pid"].as_u64().unwrap();
    // The header carries the name after exec.
    assert_eq!(x["comm"], "nantrace", "{x}");
    assert_eq!(x["filename"], BIN, "{x}");
    let (sx, _) = w.wait_for("exec of the script", Duration::from_secs(10), |v| {
        v["source"] == "exec"
            && v["comm"]
                .as_str()
                .is_some_and(|c| c.starts_with("nt-script"))
    });
    assert_eq!(
        sx["filename"],
        script.to_str().unwrap(),
        "the script's path, not /bin/sh: {sx}"
    );
    let (f, _) = w.wait_for("the fork that made it", Duration::from_secs(10), |v| {
        v["source"] == "fork" && v["child_pid"].as_u64() == Some(gen)
    });
    assert_eq!(f["pid"].as_u64(), Some(root_pid));
    assert_eq!(f["tid"].as_u64(), Some(root_pid), "{f}");
    assert_eq!(f["comm"], "sh", "{f}");
    assert_eq!(f["child_comm"], "sh", "{f}");
    // The fork's time (the child's `start_time` on the BTF path) is on the clock of the other
    // events: after the go, before the child's exec.
    let (tf, tx) = (
        f["mono_ns"].as_u64().unwrap(),
        x["mono_ns"].as_u64().unwrap(),
    );
    assert!(went <= tf && tf <= tx, "go {went}, fork {tf}, exec {tx}");
    let (e, _) = w.wait_for("its exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(gen)
    });
    assert_eq!(e["exit_code"], 0, "{e}");
    assert_eq!(e["comm"], "nantrace", "{e}");
    std::thread::sleep(Duration::from_millis(200));
    let thread_forks = w.all(|v| v["source"] == "fork" && v["pid"].as_u64() == Some(gen));
    assert!(
        thread_forks.is_empty(),
        "threads reported as forks: {thread_forks:?}"
    );
    assert_probe_path(
        &w.stop(),
        &[
            "sched:sched_process_fork",
            "sched:sched_process_exec",
            "sched:sched_process_exit",
        ],
    );
}

/// A real fault: the kernel's own siginfo (SEGV_MAPERR, 1) reaches the signal event through
/// the siginfo pointer on the BTF path and the record on the tracefs path, and the exit says
/// SIGSEGV.
#[test]
fn a_segfault_is_a_fatal_signal_with_its_kernel_siginfo() {
    if !privileged("a_segfault_is_a_fatal_signal_with_its_kernel_siginfo") {
        return;
    }
    let go = std::ffi::CString::new(format!("/tmp/nt-segv-go-{}", std::process::id())).unwrap();
    let _ = std::fs::remove_file(go.to_str().unwrap());
    // Where cores land in the working directory, the child dumps one into a scratch
    // directory, keeping only what it must (coredump_filter 0: no memory mappings, so the
    // fork of the test harness gives a tiny core). Elsewhere (a pipe to systemd-coredump, a
    // crash directory) it keeps its inherited core limit and the test only compares.
    let core_dir = Scratch::new("core");
    let local = cores_land_in_cwd();
    let core_dir_c = std::ffi::CString::new(core_dir.0.to_str().unwrap()).unwrap();
    // SAFETY: the child only calls async-signal-safe functions (open, write, close, chdir,
    // the setrlimit syscall, access, usleep) and then faults; the parent waits for it.
    let child = unsafe { libc::fork() };
    if child == 0 {
        unsafe {
            if local {
                let f = libc::open(c"/proc/self/coredump_filter".as_ptr(), libc::O_WRONLY);
                if f >= 0 {
                    libc::write(f, c"0".as_ptr().cast(), 1);
                    libc::close(f);
                }
                let unlimited = libc::rlimit {
                    rlim_cur: libc::RLIM_INFINITY,
                    rlim_max: libc::RLIM_INFINITY,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &unlimited);
                libc::chdir(core_dir_c.as_ptr());
            }
            while libc::access(go.as_ptr(), libc::F_OK) != 0 {
                libc::usleep(20_000);
            }
            std::ptr::read_volatile(std::ptr::null::<u8>().wrapping_add(8));
            libc::_exit(0);
        }
    }
    assert!(child > 0);
    let w = Watch::start(&["--pid", &child.to_string()]);
    std::fs::write(go.to_str().unwrap(), "").unwrap();
    let mut status = 0;
    // SAFETY: our own child.
    unsafe { libc::waitpid(child, &mut status, 0) };
    assert!(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
        "status {status:#x}"
    );
    let (s, _) = w.wait_for("SIGSEGV signal", Duration::from_secs(10), |v| {
        v["source"] == "signal" && v["target_pid"].as_i64() == Some(i64::from(child))
    });
    assert_eq!(s["signal"], "SIGSEGV");
    assert_eq!(s["si_code"], 1, "SEGV_MAPERR: {s}");
    assert_eq!(s["job"], true);
    let (x, _) = w.wait_for("its exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_i64() == Some(i64::from(child))
    });
    assert_eq!(x["signal"], "SIGSEGV", "{x}");
    // The core dump is what wait(2) says (WCOREDUMP) on the BTF path; the tracefs path does
    // not know, and says nothing.
    let dumped = libc::WCOREDUMP(status);
    if local {
        assert!(dumped, "cores land in the working directory and RLIMIT_CORE is unlimited, yet no core: status {status:#x}");
    }
    eprintln!("core dumped: {dumped} (cores in the working directory: {local})");
    if expect_btf_for("sched:sched_process_exit") {
        assert_eq!(x["core_dumped"].as_bool().unwrap_or(false), dumped, "{x}");
    } else {
        assert!(x.get("core_dumped").is_none(), "{x}");
    }
    let _ = std::fs::remove_file(go.to_str().unwrap());
    assert_probe_path(
        &w.stop(),
        &["signal:signal_generate", "sched:sched_process_exit"],
    );
}

/// A process whose main thread ends first (pthread_exit in the main thread; the old leader's
/// end when another thread execs is the same exit) stays the job's: the forks, execs and exit
/// of its other threads are still the job's. The exit program used to unmark the leader's pid,
/// which is the process's, and the rest of the process left the job.
#[test]
fn a_process_whose_main_thread_ended_stays_the_jobs() {
    if !privileged("a_process_whose_main_thread_ended_stays_the_jobs") {
        return;
    }
    let mut root = Gated::new("leader", &format!("exec {BIN} bench-internal leader-exit"));
    let root_pid = u64::from(root.id());
    let w = Watch::start(&["--pid", &root_pid.to_string()]);
    root.go();
    assert_eq!(root.wait().unwrap().code(), Some(5));
    let (x, _) = w.wait_for(
        "the exec of /bin/true after the main thread ended",
        Duration::from_secs(10),
        |v| v["source"] == "exec" && v["filename"].as_str().is_some_and(|f| f.ends_with("/true")),
    );
    assert_eq!(x["job"], true);
    let kid = x["pid"].as_u64().unwrap();
    let (f, _) = w.wait_for(
        "the fork by the remaining thread",
        Duration::from_secs(10),
        |v| v["source"] == "fork" && v["child_pid"].as_u64() == Some(kid),
    );
    assert_eq!(f["pid"].as_u64(), Some(root_pid), "{f}");
    // The forking thread is not the leader: the header's tid is its own.
    assert!(
        f["tid"].as_u64().is_some_and(|t| t != root_pid && t > 0),
        "{f}"
    );
    let (e, _) = w.wait_for("the process's exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(root_pid)
    });
    assert_eq!(e["exit_code"], 5, "{e}");
    assert_eq!(e["job"], true);
    assert_probe_path(
        &w.stop(),
        &["sched:sched_process_fork", "sched:sched_process_exit"],
    );
}

/// No exit_group: the main thread ends with the exit syscall (code 0), then the last thread
/// with code 7. The BTF exit program must report what wait(2) reports, computed as the
/// kernel's `wait_task_zombie` does: since 6.0 the last thread's exit starts a group exit
/// with its code (`synchronize_group_exit`), so 7 here; older kernels reported the leader's
/// 0. The tracefs path has no code for such an exit (no exit_group).
#[test]
fn the_exit_code_is_what_wait_reports_when_the_last_thread_is_not_the_leader() {
    if !privileged("the_exit_code_is_what_wait_reports_when_the_last_thread_is_not_the_leader") {
        return;
    }
    let mut root = Gated::new(
        "lastthread",
        &format!("exec {BIN} bench-internal thread-exit-last"),
    );
    let root_pid = u64::from(root.id());
    let w = Watch::start(&["--pid", &root_pid.to_string()]);
    root.go();
    let code = root
        .wait()
        .unwrap()
        .code()
        .expect("an exit code, not a signal");
    eprintln!("wait(2) reports exit code {code}");
    let (e, _) = w.wait_for("the process's exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(root_pid)
    });
    assert_eq!(e["job"], true);
    assert_eq!(e["signal"], serde_json::Value::Null, "{e}");
    // The last thread out is not the leader: the header's tid is its own.
    assert!(
        e["tid"].as_u64().is_some_and(|t| t != root_pid && t > 0),
        "{e}"
    );
    if expect_btf_for("sched:sched_process_exit") {
        assert_eq!(e["exit_code"], code, "{e}");
    } else {
        assert_eq!(
            e["exit_code"],
            serde_json::Value::Null,
            "no exit_group, no code on tracefs: {e}"
        );
    }
    assert_probe_path(&w.stop(), &["sched:sched_process_exit"]);
}

/// No job given: abnormal exits anywhere on the machine are reported (a code, an uncaught
/// signal), a clean exit is not, and neither is a process that caught the fatal signal and
/// then exited 0 (the signal was sent, but it is not how the process ended).
#[test]
fn machine_wide_abnormal_exits_and_a_caught_signal() {
    if !privileged("machine_wide_abnormal_exits_and_a_caught_signal") {
        return;
    }
    let dir = out_dir("wide");
    let w = Watch::start(&[]);
    let script = format!(
        "cd {d}; sh -c 'exit 7' & echo $! > seven; wait; \
         sh -c 'trap \"exit 0\" TERM; kill -TERM $$; sleep 0.2; exit 9' & echo $! > caught; wait; \
         sh -c 'exit 0' & echo $! > clean; wait; \
         sleep 30 & echo $! > term; kill -TERM $!; wait; exit 0",
        d = dir.display()
    );
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .status()
        .unwrap();
    assert!(st.success());
    let pid = |name: &str| u64::from(pid_from(&dir.join(name), name));
    let (seven, caught, clean, term) = (pid("seven"), pid("caught"), pid("clean"), pid("term"));
    let (e, _) = w.wait_for("exit 7 outside any job", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(seven)
    });
    assert_eq!(e["exit_code"], 7, "{e}");
    assert_eq!(e["job"], false, "{e}");
    let (t, _) = w.wait_for("the SIGTERM exit", Duration::from_secs(10), |v| {
        v["source"] == "exit" && v["pid"].as_u64() == Some(term)
    });
    assert_eq!(t["signal"], "SIGTERM", "{t}");
    assert_eq!(t["exit_code"], serde_json::Value::Null, "{t}");
    // Both came after these two processes had ended: a wrong event for them is in by now.
    let wrong = w.all(|v| {
        v["source"] == "exit"
            && (v["pid"].as_u64() == Some(caught) || v["pid"].as_u64() == Some(clean))
    });
    assert!(
        wrong.is_empty(),
        "exits reported for a clean exit or a caught SIGTERM: {wrong:?}"
    );
    let sig = w.all(|v| v["source"] == "signal" && v["target_pid"].as_u64() == Some(caught));
    assert!(
        sig.iter().any(|s| s["signal"] == "SIGTERM"),
        "the caught SIGTERM was still sent: {sig:?}"
    );
    assert_probe_path(&w.stop(), &["sched:sched_process_exit"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// CLOCK_MONOTONIC now, in ns: the clock of the events' `mono_ns`.
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
