//! The hostile test suite, second part: what hostile or ordinary jobs print, and what it must
//! not do to the verdict, the NaN trigger, the dump or the job (adversarial report cases 1.9,
//! 2.1, 2.5, 2.7, 2.8, 2.13, 3.5, 5.23, 5.25, 6.9, 6.10, 6.12, 6.14b, 7.3-7.5, and the later
//! review). Root is needed for the probe cases; run single-threaded:
//! `cargo test -p nantrace --test hostile_output -- --test-threads=1`.
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bundles, make_bundle, nantrace, privileged, sh_ok, text, Scratch, BIN};

// ---------------------------------------------------------------------------------------------
// Verdicts that hostile or ordinary jobs used to bend (1.9, 3.5, 6.9, 6.10, 6.12, 7.5, 6.14b)
// ---------------------------------------------------------------------------------------------

fn verdict_of(bundle: &Path) -> String {
    std::fs::read_to_string(bundle.join("report.md"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("**"))
        .unwrap_or("")
        .to_string()
}

/// 3.5: an unprivileged process renamed `EDAC MC0: 1 UE` really segfaults (the kernel prints
/// its name first); with the probes loaded, the report says nothing about a machine check.
#[test]
fn r3_5_a_process_named_like_a_kernel_message_forges_no_evidence() {
    if !privileged("r3_5_a_process_named_like_a_kernel_message_forges_no_evidence") {
        return;
    }
    let d = Scratch::new("spoof");
    let src = d.join("spoof.c");
    std::fs::write(&src, "#include <sys/prctl.h>\n#include <unistd.h>\nint main(int c, char **v) { usleep(300000); prctl(PR_SET_NAME, v[1], 0, 0, 0); return *(volatile int *)0; }\n").unwrap();
    sh_ok(&format!(
        "gcc -O0 -o {0}/spoof {1} && chmod 755 {0} {0}/spoof",
        d.0.display(),
        src.display()
    ));
    let exception_trace = std::fs::read_to_string("/proc/sys/debug/exception-trace")
        .unwrap_or_default()
        .trim()
        == "1";
    let out = d.join("o");
    let spoofer = d.join("spoof");
    // The job waits while another user's process crashes under a forged name.
    let job = format!("setpriv --reuid=65534 --regid=65534 --clear-groups {} 'EDAC MC0: 1 UE'; sleep 1; echo 'HOSTILE-spoof step 1 loss nan'; exit 2", spoofer.display());
    if !exception_trace {
        eprintln!("NOTE: debug.exception-trace is 0 here: the kernel prints no segfault line; the line it would print is injected instead");
        let line = "EDAC MC0: 1 UE[20803]: segfault at 0 ip 000055d0c0a0113d sp 00007ffd3b1c0a20 error 6 in spoof[55d0c0a01000+1000]";
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            let _ = std::fs::write("/dev/kmsg", format!("{line}\n"));
        });
    }
    let o = nantrace(
        &[
            "run",
            "--post",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &job,
        ],
        &[],
    );
    let (_, err) = text(&o);
    let b = bundles(&out);
    assert_eq!(b.len(), 1, "{err}");
    let kernel = std::fs::read_to_string(b[0].join("kernel.log")).unwrap();
    assert!(
        kernel.contains("EDAC MC0: 1 UE["),
        "the crash line reached the kernel log: {kernel}"
    );
    let report = std::fs::read_to_string(b[0].join("report.md")).unwrap();
    assert!(!report.contains("machine check"), "{report}");
    assert!(!verdict_of(&b[0]).contains("THE MACHINE (host"), "{report}");
}

/// 7.5: an Xid, then a log flood far over a small memory cap: the Xid stays in the window and
/// in the verdict.
#[test]
fn r7_5_a_log_flood_does_not_evict_the_xid() {
    if !privileged("r7_5_a_log_flood_does_not_evict_the_xid") {
        return;
    }
    let d = Scratch::new("xidflood");
    let out = d.join("o");
    let job = "sleep 1; yes 'HOSTILE-flood step 1 | loss 2.0 | lr 3e-4 | tokens/s 123456' | head -n 1500000; echo 'HOSTILE-flood step 2 loss nan'; exit 1";
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(700));
        let _ = std::fs::write("/dev/kmsg", "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=HOSTILE-flood, Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address\n");
    });
    let o = nantrace(
        &[
            "run",
            "--post",
            "1",
            "--mem-cap-mb",
            "16",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            job,
        ],
        &[],
    );
    let (_, err) = text(&o);
    let b = bundles(&out);
    assert_eq!(b.len(), 1, "{err}");
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(b[0].join("timeline.json")).unwrap())
            .unwrap();
    assert!(
        t["accounting"]["recorder"]["evicted_by_memory_per_source"]["log"]
            .as_u64()
            .unwrap_or(0)
            > 100_000,
        "the flood was evicted: {}",
        t["accounting"]["recorder"]
    );
    assert_eq!(
        t["accounting"]["recorder"]["evicted_by_memory_per_source"]["xid"],
        serde_json::Value::Null,
        "the Xid was not"
    );
    let v = verdict_of(&b[0]);
    assert!(
        v.contains("THE MACHINE (GPU") && v.contains("Xid 13"),
        "{v}"
    );
}

/// 1.9, 6.12: a helper that exits non-zero at once (`grep -q`, a shim) is not a machine signal;
/// 6.9, 6.10: the job's own SIGSEGV/SIGABRT is a software crash.
#[test]
fn r6_9_r6_10_r6_12_the_jobs_own_failures_are_not_the_machine() {
    if !privileged("r6_9_r6_10_r6_12_the_jobs_own_failures_are_not_the_machine") {
        return;
    }
    let d = Scratch::new("ownfail");
    for (tag, job, want) in [
        (
            "grep",
            "grep -q x /dev/null; echo 'HOSTILE-grep step 1 loss nan'; sleep 0.5",
            "NOT THE MACHINE, as far as nantrace can see",
        ),
        (
            "segv",
            "echo 'HOSTILE-segv step 1 loss 2.0'; kill -SEGV $$",
            "NOT THE MACHINE (software/configuration)",
        ),
        (
            "abrt",
            "echo 'HOSTILE-abrt step 1 loss 2.0'; kill -ABRT $$",
            "NOT THE MACHINE (software/configuration)",
        ),
    ] {
        let out = d.join(tag);
        let o = nantrace(
            &[
                "run",
                "--post",
                "0.5",
                "--out",
                out.to_str().unwrap(),
                "--",
                "sh",
                "-c",
                job,
            ],
            &[],
        );
        let b = bundles(&out);
        assert_eq!(b.len(), 1, "{tag}: {:?}", text(&o));
        let v = verdict_of(&b[0]);
        assert!(v.starts_with(&format!("**{want}")), "{tag}: {v}");
    }
}

/// 6.14 (b): without probes and without NVML, the report does not claim a clean machine.
#[test]
fn r6_14b_without_eyes_the_report_cannot_tell() {
    let d = Scratch::new("noeyes");
    let out = d.join("o");
    let o = nantrace(
        &[
            "run",
            "--no-probes",
            "--post",
            "0.5",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "echo 'HOSTILE-noeyes step 1 loss nan'",
        ],
        &[],
    );
    let b = bundles(&out);
    assert_eq!(b.len(), 1, "{:?}", text(&o));
    let snap = std::fs::read_to_string(b[0].join("snapshot.json")).unwrap();
    if snap.contains("\"available\": true") {
        eprintln!("NOTE: NVML is available here: the report has eyes, the CANNOT TELL verdict does not apply");
        return;
    }
    assert!(
        verdict_of(&b[0]).starts_with("**CANNOT TELL"),
        "{}",
        verdict_of(&b[0])
    );
}

// ---------------------------------------------------------------------------------------------
// The NaN trigger (2.1, 2.5)
// ---------------------------------------------------------------------------------------------

/// 2.1: a NaN at the end of a 200 KiB line; 2.5: a NaN inside colour codes.
#[test]
fn r2_1_r2_5_a_nan_after_64k_or_inside_colour_codes_is_seen() {
    let d = Scratch::new("nanshape");
    for (tag, job) in [
        ("long", "head -c 200000 /dev/zero | tr '\\0' x; echo ' HOSTILE-long step 9 loss: nan'; sleep 0.5"),
        ("ansi", "printf 'HOSTILE-ansi step 2 | loss: \\033[31mnan\\033[0m\\n'; sleep 0.5"),
    ] {
        let out = d.join(tag);
        let o = nantrace(&["run", "--no-probes", "--post", "0.5", "--out", out.to_str().unwrap(), "--", "sh", "-c", job], &[]);
        let b = bundles(&out);
        assert_eq!(b.len(), 1, "{tag}: {:?}", text(&o));
        let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(b[0].join("timeline.json")).unwrap()).unwrap();
        assert_eq!(t["trigger"]["kind"], "nan", "{tag}");
    }
}

// ---------------------------------------------------------------------------------------------
// The dump: bounded memory, never blocking the job (2.8, 7.3, 7.4, 5.25)
// ---------------------------------------------------------------------------------------------

/// A flood far over the cap, then the NaN: the job is not slowed by more than the scan itself,
/// nantrace's memory stays near the cap during the dump, the bundle is written, and what was
/// passed through unscanned (if anything) is counted and said.
#[test]
fn r2_8_r7_3_r7_4_a_flood_and_its_dump_stay_bounded_and_never_block_the_job() {
    let d = Scratch::new("flooddump");
    let out = d.join("o");
    let stamps = d.join("stamps");
    let job = format!("date +%s.%N > {0}; yes 'HOSTILE-dump step 1 | loss 2.0 | lr 3e-4 | tokens/s 123456 | mfu 41.2%' | head -n 2000000; echo 'HOSTILE-dump step 2 loss nan'; date +%s.%N >> {0}; sleep 1; exit 1", stamps.display());
    let job = job.as_str();
    let t = Instant::now();
    sh_ok(&format!(
        "sh -c \"{}\" >/dev/null || true",
        job.replace('"', "\\\"")
    ));
    let alone = t.elapsed().as_secs_f64();
    let cap = 32u64;
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--no-probes",
            "--post",
            "0.5",
            "--mem-cap-mb",
            &cap.to_string(),
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            job,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = format!("/proc/{}/status", child.id());
    let t = Instant::now();
    let mut peak_kb = 0u64;
    while child.try_wait().unwrap().is_none() {
        if let Some(kb) = std::fs::read_to_string(&status).ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        }) {
            peak_kb = peak_kb.max(kb);
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "nantrace did not finish"
        );
    }
    let under = t.elapsed().as_secs_f64();
    // The job's own time under nantrace, from its own clock: its output never waited.
    let st: Vec<f64> = std::fs::read_to_string(&stamps)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let job_s = st[1] - st[0];
    assert!(
        job_s <= alone * 3.0 + 2.0,
        "the job took {job_s:.2} s under nantrace, {alone:.2} s alone"
    );
    let mut err = String::new();
    use std::io::Read as _;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let b = bundles(&out);
    assert_eq!(b.len(), 1, "{err}");
    // The job's own duration is in app.log: from its first line to its last.
    let app = std::fs::read_to_string(b[0].join("app.log")).unwrap();
    assert!(
        app.contains("HOSTILE-dump step 1"),
        "the flood is in app.log"
    );
    eprintln!("flood: job alone {alone:.2} s, job under nantrace {job_s:.2} s, nantrace until the bundle {under:.2} s, peak RSS {} MiB, cap {cap} MiB", peak_kb / 1024);
    // Memory: the cap, plus the scan queue and the dump's bounded digest, over the start.
    // A debug build's own footprint is ~40 MiB; the release figure is in docs/performance.md.
    assert!(
        peak_kb / 1024 <= cap + 64 + 48,
        "peak RSS {} MiB, cap {cap} MiB",
        peak_kb / 1024
    );
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(b[0].join("timeline.json")).unwrap())
            .unwrap();
    let not_scanned = t["accounting"]["log_bytes_not_scanned"]
        .as_u64()
        .expect("counted");
    let report = std::fs::read_to_string(b[0].join("report.md")).unwrap();
    if not_scanned > 0 {
        assert!(
            report.contains("without the full scan"),
            "the report says lines were not fully scanned: {report}"
        );
    }
    assert!(
        t["accounting"]["digest"]["analysed"].as_u64().unwrap()
            <= nantrace::bundle::DIGEST_MAX as u64
    );
    // `nantrace report` reads the big timeline line by line (5.25).
    let o = nantrace(&["report", b[0].to_str().unwrap()], &[]);
    assert!(o.status.success(), "{:?}", text(&o));
}

/// 2.7: with nantrace's stdout and stderr in one file (`2>&1`), the job's two streams keep
/// their order (one pipe for both).
#[test]
fn r2_7_two_streams_into_one_file_keep_their_order() {
    let d = Scratch::new("interleave");
    let out = d.join("o");
    let f = std::fs::File::create(d.join("both.txt")).unwrap();
    let st = Command::new(BIN)
        .args([
            "run",
            "--no-probes",
            "--post",
            "0.3",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "for i in 1 2 3 4 5 6 7 8; do echo HOSTILE-out$i; echo HOSTILE-err$i >&2; done; exit 1",
        ])
        .env_remove("SUDO_UID")
        .stdin(Stdio::null())
        .stdout(Stdio::from(f.try_clone().unwrap()))
        .stderr(Stdio::from(f))
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(1));
    let both = std::fs::read_to_string(d.join("both.txt")).unwrap();
    let order: Vec<&str> = both.lines().filter(|l| l.starts_with("HOSTILE-")).collect();
    let want: Vec<String> = (1..=8)
        .flat_map(|i| [format!("HOSTILE-out{i}"), format!("HOSTILE-err{i}")])
        .collect();
    assert_eq!(order, want.iter().map(String::as_str).collect::<Vec<_>>());
    let b = bundles(&out);
    let app = std::fs::read_to_string(b[0].join("app.log")).unwrap();
    assert!(app.contains("[stdout+stderr] HOSTILE-err1"), "{app}");
}

/// 5.23: the same bundle merged twice is merged once, with a warning.
#[test]
fn r5_23_the_same_bundle_twice_is_merged_once() {
    let d = Scratch::new("mergetwice");
    let b = make_bundle(&d, "in");
    let out = d.join("m");
    let o = nantrace(
        &[
            "merge",
            b.to_str().unwrap(),
            b.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("same incident") && err.contains("merged once"),
        "{err}"
    );
    let single: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(b.join("timeline.json")).unwrap()).unwrap();
    let merged: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("timeline.json")).unwrap()).unwrap();
    assert_eq!(
        merged["events"].as_array().unwrap().len(),
        single["events"].as_array().unwrap().len()
    );
}

/// 2.13: a line written 30 ms before a copytruncate rotation is not lost (inotify wakes the
/// follower at the write, not at the next 100 ms poll).
#[test]
fn r2_13_a_line_just_before_copytruncate_is_kept() {
    use std::io::Write as _;
    let d = Scratch::new("copytrunc");
    let out = d.join("o");
    let log = d.join("train.log");
    std::fs::write(&log, "HOSTILE-ct step 0 | loss 3.0\n").unwrap();
    let mut job = Command::new("sleep").arg("30").spawn().unwrap();
    let mut nt = Command::new(BIN)
        .args([
            "attach",
            "--no-probes",
            "--pid",
            &job.id().to_string(),
            "--log",
            log.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--post",
            "0.5",
        ])
        .env_remove("SUDO_UID")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let append = |s: &str| {
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(s.as_bytes()).unwrap();
    };
    for round in 1..=5 {
        append(&format!(
            "HOSTILE-ct step {round} | loss 2.{round} (written just before the rotation)\n"
        ));
        std::thread::sleep(Duration::from_millis(30));
        // copytruncate: copy, then truncate in place.
        std::fs::copy(&log, d.join(&format!("train.log.{round}"))).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&log)
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    append("HOSTILE-ct step 6 | loss nan\n");
    let t0 = Instant::now();
    while bundles(&out).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "no bundle");
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = job.kill();
    let _ = job.wait();
    let _ = nt.wait();
    let app = std::fs::read_to_string(bundles(&out)[0].join("app.log")).unwrap();
    for round in 1..=5 {
        assert!(
            app.contains(&format!("HOSTILE-ct step {round} |")),
            "step {round} lost:\n{app}"
        );
    }
}

/// Review: after a first incident's bundle, the next incident keeps its history (the dump
/// hands the window back): an IB error 3 s before the NaN is still in the NaN's bundle.
#[test]
fn review_the_second_incident_keeps_the_history_of_the_first() {
    let d = Scratch::new("twoinc");
    let out = d.join("o");
    let job = "echo 'HOSTILE-two step 1 | loss 2.0'; echo 'node1:1:1 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1234> with status=12 opcode=0 len=0 vendor err 129 (Recv)' >&2; sleep 3; echo 'HOSTILE-two step 6 loss: nan'; sleep 0.5";
    let o = nantrace(
        &[
            "run",
            "--no-probes",
            "--post",
            "0.5",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            job,
        ],
        &[],
    );
    let b = bundles(&out);
    assert_eq!(b.len(), 2, "{:?}", text(&o));
    let second = b
        .iter()
        .map(|p| {
            (
                p.clone(),
                std::fs::read_to_string(p.join("timeline.json")).unwrap(),
            )
        })
        .find(|(_, t)| t.contains("\"kind\": \"nan\""))
        .expect("the NaN bundle")
        .0;
    let v = verdict_of(&second);
    assert!(v.contains("THE MACHINE (network)"), "{v}");
    let app = std::fs::read_to_string(second.join("app.log")).unwrap();
    assert!(
        app.contains("HOSTILE-two step 1"),
        "the history before the first bundle is kept: {app}"
    );
}

/// Review: a NaN printed without a trailing newline, then a hang: the trigger fires within
/// seconds, not when the job ends.
#[test]
fn review_a_nan_without_its_newline_triggers_while_the_job_hangs() {
    let d = Scratch::new("nonewline");
    let out = d.join("o");
    let t = Instant::now();
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--no-probes",
            "--post",
            "0.5",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "printf 'HOSTILE-nl step 5 loss: nan'; sleep 30",
        ])
        .env_remove("SUDO_UID")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while bundles(&out).is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no bundle while the job hangs"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let tl: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(bundles(&out)[0].join("timeline.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(tl["trigger"]["kind"], "nan");
}
