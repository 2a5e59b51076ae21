//! A hung job's ranks at the moment of the hang (docs/hangs.md): the trigger's snapshot takes
//! every job thread's state, wait channel and kernel stack twice, and the report names the
//! rank blocked on storage. Real kernel state: rank 1 really sits in D state on a block device
//! its cgroup throttles (blkio on cgroup v1, io.max on v2); rank 0 prints torch's watchdog
//! lines (recorded wording, no torch). Privileged: cgroups, loop devices, /proc/PID/stack.
mod common;

use std::path::Path;

use common::*;
use serde_json::Value;

#[test]
fn a_rank_blocked_on_storage_at_the_hang_is_named_with_its_stack() {
    if !privileged("a_rank_blocked_on_storage_at_the_hang_is_named_with_its_stack") {
        return;
    }
    let dir = Scratch::new("hang-io");
    let lo = LoopDev::new(&dir.join("disk.img"), "16M", None);
    let majmin = format!("7:{}", lo.minor);
    let th = Throttle::new(
        &format!("nantrace-hang-{}", std::process::id()),
        &majmin,
        512,
    );
    let out = out_dir("hang-io");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hang/ranks.py");
    let flag = dir.join("rank0-gave-up");
    let o = nantrace(
        &[
            "run",
            "--post",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--",
            "python3",
            script.to_str().unwrap(),
            &lo.dev,
            th.0.to_str().unwrap(),
            flag.to_str().unwrap(),
        ],
        &[],
    );
    let (_, se) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{se}");
    // The hang's bundle (the first; the job's exit may write another once every rank is gone).
    let mut bundles: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("snapshot.json").is_file())
        .collect();
    bundles.sort();
    let b = bundles
        .first()
        .unwrap_or_else(|| panic!("no bundle: {se}"))
        .clone();
    let snap: Value =
        serde_json::from_slice(&std::fs::read(b.join("snapshot.json")).unwrap()).unwrap();
    let st = &snap["stacks"];
    let r1 = st["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["rank"] == 1 && p["rank_main"] == true)
        .unwrap_or_else(|| panic!("rank 1 in the stacks: {st:#}"));
    let main = &r1["threads"][0];
    assert_eq!(main["tid"], r1["pid"], "{r1:#}");
    assert_eq!(main["state"], serde_json::json!(["D", "D"]), "{r1:#}");
    let frames: Vec<&str> = main["kernel_stack"]
        .as_array()
        .unwrap_or_else(|| panic!("a kernel stack: {main:#}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        frames
            .iter()
            .any(|f| f.contains("blkdev") || f.contains("bio")),
        "the block layer in rank 1's kernel stack: {frames:?}"
    );
    assert_eq!(
        r1["io"]["read_bytes"][0], r1["io"]["read_bytes"][1],
        "no read completed between the samples: {r1:#}"
    );
    let report = std::fs::read_to_string(b.join("report.md")).unwrap();
    let verdict = report
        .lines()
        .find(|l| l.contains("THE MACHINE"))
        .unwrap_or("");
    assert!(
        verdict.contains("POSSIBLY THE MACHINE (storage"),
        "the verdict: {verdict}\n{report}"
    );
    assert!(
        report.contains(&format!(
            "rank 1 (pid {}, python3): main thread in D state in",
            r1["pid"]
        )),
        "rank 1 named with its stack:\n{report}"
    );
    assert!(report.contains("waiting on storage"), "{report}");
    let _ = std::fs::remove_dir_all(&out);
}

/// The stall trigger: a job that logged training steps and then stops making progress is
/// dumped after `--hang-after` seconds while it still runs, its stacks taken then (here its
/// main thread asleep in the kernel), once per stall.
#[test]
fn a_job_that_stops_making_progress_is_dumped_while_it_hangs() {
    if !privileged("a_job_that_stops_making_progress_is_dumped_while_it_hangs") {
        return;
    }
    let out = out_dir("stall");
    let o = nantrace(
        &[
            "run",
            "--hang-after",
            "2",
            "--post",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            "import time\nfor i in range(3):\n    print(f'step {i} | loss {2.0 - i / 10:.3f}', flush=True)\n    time.sleep(0.2)\ntime.sleep(8)\n",
        ],
        &[],
    );
    let (_, se) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{se}");
    let b = only_bundle(&out);
    let t: Value =
        serde_json::from_slice(&std::fs::read(b.join("timeline.json")).unwrap()).unwrap();
    assert_eq!(t["trigger"]["kind"], "stall", "{:#}", t["trigger"]);
    assert!(
        t["trigger"]["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("no training progress for 2 s")),
        "{:#}",
        t["trigger"]
    );
    let snap: Value =
        serde_json::from_slice(&std::fs::read(b.join("snapshot.json")).unwrap()).unwrap();
    let py = snap["stacks"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["comm"].as_str().is_some_and(|c| c.starts_with("python")))
        .unwrap_or_else(|| panic!("the job's python in the stacks: {:#}", snap["stacks"]));
    assert_eq!(py["threads"][0]["state"][0], "S", "{py:#}");
    assert!(
        py["threads"][0]["wchan"][0]
            .as_str()
            .is_some_and(|w| w.contains("sleep") || w.contains("hrtimer")),
        "{py:#}"
    );
    let report = std::fs::read_to_string(b.join("report.md")).unwrap();
    assert!(
        report.contains("UNDECIDED (collective hang): the job stopped making progress (no training progress for"),
        "{report}"
    );
    assert!(!report.contains("model side"), "{report}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A silent job still writing is not a stall (issue 34: no progress means no step line and
/// no I/O progress of the ranks): a job that prints steps, then writes a checkpoint for 6 s
/// (16 MiB/s, synced) without a line, then hangs, is dumped once, after the writes stopped,
/// and the stall's reason says it saw no storage progress (before: dumped 2 s into the
/// checkpoint).
#[test]
fn a_job_writing_a_checkpoint_is_no_stall_until_its_writes_stop() {
    if !privileged("a_job_writing_a_checkpoint_is_no_stall_until_its_writes_stop") {
        return;
    }
    let out = out_dir("ckpt");
    let ckpt = out.join("ckpt.bin");
    std::fs::create_dir_all(&out).unwrap();
    let prog = format!(
        "import os, time\nfor i in range(3):\n    print(f'step {{i}} | loss {{2.0 - i / 10:.3f}}', flush=True)\n    time.sleep(0.2)\nt0 = time.time()\nwith open({:?}, 'wb') as f:\n    while time.time() - t0 < 6:\n        f.write(b'x' * (4 << 20))\n        f.flush()\n        os.fsync(f.fileno())\n        f.seek(0)\n        time.sleep(0.25)\nprint('checkpoint written', flush=True)\ntime.sleep(8)\n",
        ckpt.display().to_string()
    );
    let o = nantrace(
        &[
            "run",
            "--hang-after",
            "2",
            "--post",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            &prog,
        ],
        &[],
    );
    let (_, se) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{se}");
    assert!(
        se.contains("read or written in the last") && se.contains("not a stall while the job reads or writes"),
        "the deferral is said: {se}"
    );
    let _ = std::fs::remove_file(&ckpt);
    let b = only_bundle(&out);
    let t: Value =
        serde_json::from_slice(&std::fs::read(b.join("timeline.json")).unwrap()).unwrap();
    assert_eq!(t["trigger"]["kind"], "stall", "{:#}", t["trigger"]);
    let reason = t["trigger"]["reason"].as_str().unwrap_or_default();
    let silent_s: f64 = reason
        .strip_prefix("no training progress for ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{reason}"));
    assert!(
        silent_s >= 6.0,
        "dumped {silent_s} s after the last step: during the 6-s checkpoint: {reason}"
    );
    assert!(
        reason.contains("no I/O progress by the job's"),
        "{reason}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
