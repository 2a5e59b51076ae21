//! Collectors on this machine's real /proc and /sys: values that can be checked.
mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn snapshot(pid: u32) -> Value {
    let o = Command::new(BIN)
        .args(["snapshot", "--pid", &pid.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("snapshot is JSON")
}

#[test]
fn cgroup_limit_and_the_oom_kill_it_provokes() {
    if !privileged("cgroup_limit_and_the_oom_kill_it_provokes") {
        return;
    }
    let cg = MemCgroup::new(
        &format!("nantrace-test-snap-{}", std::process::id()),
        40 << 20,
    );
    let procs = cg.procs();
    let mut job = Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {}; exec sleep 30", procs.display()))
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let s = snapshot(job.id());
    assert_eq!(s["schema"], "nantrace.snapshot/1");
    let mem = &s["scheduler"]["cgroup"]["memory"];
    let limit = mem["limit_bytes"].clone();
    assert_eq!(limit.as_u64(), Some(40u64 << 20), "limit {limit} in {mem}");
    let before = if cg.v2 {
        mem["oom_kill"].as_u64().unwrap_or(0)
    } else {
        mem["oom_kill"].as_u64().unwrap()
    };
    assert_eq!(before, 0);
    // The sleeping job appears in the top-like table with its RSS, marked as the job.
    let rows = s["system"]["top"]["job_processes"].as_array().unwrap();
    assert!(
        rows.iter()
            .any(|r| r["pid"].as_u64() == Some(u64::from(job.id()))
                && r["comm"] == "sleep"
                && r["rss_kb"].as_u64().unwrap() > 0),
        "{rows:?}"
    );
    // Provoke an OOM kill inside the same cgroup.
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}; exec tail /dev/zero",
            procs.display()
        ))
        .status()
        .unwrap();
    assert!(!st.success(), "tail should have been OOM-killed");
    let s2 = snapshot(job.id());
    assert_eq!(
        s2["scheduler"]["cgroup"]["memory"]["oom_kill"].as_u64(),
        Some(1),
        "{}",
        s2["scheduler"]["cgroup"]
    );
    let _ = job.kill();
    let _ = job.wait();
}

#[test]
fn snapshot_has_every_family_and_says_why_when_there_is_no_gpu() {
    let me = std::process::id();
    let s = snapshot(me);
    // Without a GPU (CI) the reason is given; on a GPU node the devices are listed.
    if s["gpu"]["available"] == true {
        assert!(s["gpu"]["device_count"].as_u64().unwrap() >= 1);
        assert!(s["gpu"]["devices"][0]["pci"].as_str().unwrap().len() == 12);
    } else {
        assert!(s["gpu"]["reason"]
            .as_str()
            .unwrap()
            .starts_with("NVML unavailable"));
    }
    assert!(s["system"]["free"]["mem_total_kb"].as_u64().unwrap() > 0);
    assert!(s["system"]["top"]["processes"].as_u64().unwrap() > 1);
    assert!(s["network"]["tcp_since_boot"]["out_segs"]
        .as_u64()
        .is_some());
    assert!(s["software"]["kernel"].as_str().unwrap().len() > 3);
    assert!(s["scheduler"]["cgroup"]["paths"].as_array().is_some());
}

/// The GPU sampling benchmark's helpers (scripts/gpu-perf.sh): on a GPU node they measure;
/// without a driver (CI) they say what is missing and measure nothing.
#[test]
fn gpu_cost_helpers_measure_or_say_why_not() {
    let bench = |args: &[&str]| -> Value {
        let o = Command::new(BIN)
            .arg("bench-internal")
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let nvml = bench(&["nvml-cost", "--seconds", "0.3"]);
    if nvml["available"] == true {
        assert!(
            nvml["gpus"].as_u64().unwrap() >= 1 && nvml["rounds"].as_u64().unwrap() >= 1,
            "{nvml}"
        );
        assert!(
            nvml["cpu_us_per_gpu_per_sample"].as_f64().unwrap() > 0.0,
            "{nvml}"
        );
    } else {
        assert!(nvml["error"].as_str().unwrap().contains("NVML"), "{nvml}");
    }
    let steps = bench(&["cuda-steps", "--seconds", "0.3", "--n", "1000"]);
    if steps["available"] == true {
        assert!(
            steps["steps"].as_u64().unwrap() >= 1
                && steps["step_ms"]["median"].as_f64().unwrap() > 0.0,
            "{steps}"
        );
    } else {
        assert!(
            steps["error"].as_str().unwrap().contains("libcuda"),
            "{steps}"
        );
    }
}

#[test]
fn snapshot_works_unprivileged() {
    if !privileged("snapshot_works_unprivileged") {
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("SKIPPED snapshot_works_unprivileged: setpriv (util-linux) not installed");
        return;
    }
    let o = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "snapshot",
            "--pid",
            "1",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(s["system"]["free"]["mem_total_kb"].as_u64().unwrap() > 0);
    // Another user's environment cannot be read: said, not hidden.
    let errs = s["software"]["errors"].as_array().unwrap();
    assert!(
        errs.iter().any(|e| e.as_str().unwrap().contains("environ")),
        "{errs:?}"
    );
}
