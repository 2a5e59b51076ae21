//! A real PyTorch distributed job (issue 34, docs/hangs.md "Proven with a real job"): torch
//! 2.15 on CPU with the gloo backend, three ranks as processes in three network and UTS
//! namespaces ("nodes" n1, n2, n3 on a private bridge), each under its own `nantrace run`
//! with the no-progress trigger and py-spy, as an agent runs on every node. Rank 1 (n2) is
//! made to stop before collective 6: (a) in Python, a rank-only branch; (b) in D state,
//! reading a block device its cgroup throttles. The other ranks wait in the all_reduce until
//! gloo's timeout, print torch's error and dump torch's Flight Recorder; the test then stops
//! rank 1 as a launcher would (SIGTERM). `nantrace report` over the three nodes' bundles must
//! name rank 1 on n2 and its stack, and call (a) the job's code and (b) storage.
//!
//! torch comes from PyPI (the CUDA build: its ~3 GB of nvidia-* wheels install but are not
//! used on CPU) into a venv that `cargo xtask test` makes (`NANTRACE_TORCH_VENV`, default
//! /var/cache/nantrace-tests/torch-2.15.0-debian, root-owned, with py-spy, on Debian's python so
//! that the ranks run as nobody). Without it: fails in CI,
//! skips loudly elsewhere. Privileged: namespaces, probes, cgroups, loop devices.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const VENV_DEFAULT: &str = "/var/cache/nantrace-tests/torch-2.15.0-debian";
/// gloo's collective timeout in the job; the no-progress trigger fires well before it.
const TIMEOUT_S: &str = "12";
const HANG_AFTER_S: &str = "4";

/// The venv with torch and py-spy, or None (skipped) outside CI.
fn venv(test: &str) -> Option<PathBuf> {
    let v = std::env::var_os("NANTRACE_TORCH_VENV")
        .map_or_else(|| PathBuf::from(VENV_DEFAULT), PathBuf::from);
    if v.join("bin/python").is_file() && v.join("bin/py-spy").is_file() {
        return Some(v);
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "{test}: no torch venv at {} (cargo xtask test makes it)",
            v.display()
        );
    }
    eprintln!(
        "SKIPPED {test}: no torch venv at {} (cargo xtask test makes it; NANTRACE_TORCH_VENV)",
        v.display()
    );
    None
}

/// Three network namespaces on a bridge of their own: node i = 10.214.0.i.
struct Nodes {
    tag: String,
}

impl Nodes {
    fn new(tag: &str) -> Self {
        let n = Nodes {
            tag: tag.to_string(),
        };
        n.remove();
        let br = n.ns("br");
        let mut cmd = format!(
            "ip netns add {br} && ip -n {br} link add br0 type bridge && ip -n {br} link set br0 up"
        );
        for i in 1..=3 {
            let ns = n.ns(&format!("n{i}"));
            cmd += &format!(
                " && ip netns add {ns} && ip link add tj{i} netns {ns} type veth peer name tb{i} netns {br} \
                 && ip -n {br} link set tb{i} master br0 && ip -n {br} link set tb{i} up \
                 && ip -n {ns} addr add 10.214.0.{i}/24 dev tj{i} && ip -n {ns} link set tj{i} up \
                 && ip -n {ns} link set lo up"
            );
        }
        sh_ok(&cmd);
        n
    }

    fn ns(&self, what: &str) -> String {
        format!("ntt-{}-{what}", self.tag)
    }

    fn remove(&self) {
        for w in ["n1", "n2", "n3", "br"] {
            let _ = sh(&format!("ip netns del {} 2>/dev/null", self.ns(w)));
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        self.remove();
    }
}

/// How rank 1 stops.
enum Stop<'a> {
    Sleep,
    Read { dev: &'a str, cgroup: &'a Path },
}

/// The job: one `nantrace run` per node, each in its node's namespaces with hostname nI,
/// running rank I-1. Returns the incident directory (`<out>/nI/<bundle>`) and each node's
/// nantrace stderr.
fn run_job(tag: &str, venv: &Path, stop: &Stop) -> (PathBuf, Vec<String>) {
    let nodes = Nodes::new(tag);
    let work = Scratch::new(&format!("torch-{tag}"));
    let out = out_dir(&format!("torch-{tag}"));
    let flag = work.join("rank1-may-go");
    // The job is a user's (nobody), as jobs are: its script where that user can read it.
    let script = work.join("torch_train.py");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hang/torch_train.py"),
        &script,
    )
    .unwrap();
    if let Stop::Read { dev, .. } = stop {
        sh_ok(&format!("chmod o+r {dev}"));
    }
    let how = match stop {
        Stop::Sleep => "sleep".to_string(),
        Stop::Read { dev, .. } => format!("read:{dev}"),
    };
    let python = venv.join("bin/python");
    let pyspy = venv.join("bin/py-spy");
    let mut kids: Vec<Child> = (1..=3)
        .map(|i| {
            let node = format!("n{i}");
            let node_out = out.join(&node);
            std::fs::create_dir_all(&node_out).unwrap();
            // Each node's own /tmp-like place for the Flight Recorder's files.
            let fr = work.join(&node);
            std::fs::create_dir_all(&fr).unwrap();
            chown_nobody(&fr);
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &nodes.ns(&node),
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                ])
                .arg(format!("hostname {node} && exec \"$0\" \"$@\""))
                .arg(BIN)
                .args([
                    "run",
                    "--user",
                    "nobody",
                    "--hang-after",
                    HANG_AFTER_S,
                    "--post",
                    "15",
                    "--out",
                ])
                .arg(&node_out)
                .arg("--")
                .arg(&python)
                .arg(&script)
                .env("RANK", (i - 1).to_string())
                .env("LOCAL_RANK", "0")
                .env("WORLD_SIZE", "3")
                .env("MASTER_ADDR", "10.214.0.1")
                .env("MASTER_PORT", "29533")
                .env("GLOO_SOCKET_IFNAME", format!("tj{i}"))
                .env("TIMEOUT_S", TIMEOUT_S)
                .env("STOP_RANK", "1")
                .env("STOP_STEP", "5")
                .env("STOP_HOW", &how)
                .env("FLAG", &flag)
                .env("TORCH_FR_BUFFER_SIZE", "2000")
                .env("TORCH_FR_DUMP_TEMP_FILE", fr.join("fr_trace_rank_"))
                // nobody's HOME (/nonexistent) has no cache directory torch could make.
                .env("XDG_CACHE_HOME", &fr)
                .env("TORCH_HOME", &fr)
                .env("NANTRACE_PYSPY", &pyspy)
                .env_remove("SUDO_UID")
                .env_remove("SUDO_GID")
                .env_remove("SUDO_USER")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("ip netns exec ... nantrace run")
        })
        .collect();
    // Ranks 0 and 2 time out (TIMEOUT_S after rank 1 stopped), dump and exit; their nodes'
    // nantrace ends after its post-window. Then the launcher stops rank 1.
    // Rank 1 into the cgroup that throttles its device, from here: `ip netns exec` mounts
    // a sysfs of its own, without the cgroup tree.
    if let Stop::Read { cgroup, .. } = stop {
        let t = Instant::now();
        let pid = loop {
            let py = descendants(kids[1].id()).into_iter().find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.starts_with("python"))
            });
            if let Some(p) = py {
                break p;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "rank 1's python never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("rank 1 (pid {pid}) into {}: {e}", cgroup.display()));
    }
    let t0 = Instant::now();
    let mut done = [false; 3];
    while !(done[0] && done[2]) {
        for i in [0, 2] {
            if !done[i] {
                done[i] = kids[i].try_wait().unwrap().is_some();
            }
        }
        if t0.elapsed() > Duration::from_secs(180) {
            let mut why = String::new();
            for k in &kids {
                for p in descendants(k.id()) {
                    why += &stacks(p);
                }
            }
            for k in &mut kids {
                let _ = k.kill();
            }
            panic!("ranks 0 and 2 did not end within 180 s:\n{why}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::fs::write(&flag, "").unwrap();
    for p in descendants(kids[1].id()) {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        if comm.starts_with("python") {
            // SAFETY: a signal to a pid of this test's own job.
            unsafe { libc::kill(p as i32, libc::SIGTERM) };
        }
    }
    let errs: Vec<String> = kids
        .into_iter()
        .map(|k| {
            let o = k.wait_with_output().unwrap();
            String::from_utf8_lossy(&o.stderr).into_owned()
        })
        .collect();
    drop(nodes);
    (out, errs)
}

/// `nantrace report` over the job's bundles: (its stdout, the report file's text).
fn job_report(out: &Path, errs: &[String]) -> String {
    let o = nantrace(&["report", out.to_str().unwrap()], &[]);
    let (so, se) = text(&o);
    assert!(
        o.status.success(),
        "nantrace report: {se}\nnodes' stderr:\n{}",
        errs.join("\n----\n")
    );
    so
}

/// The verdict line of a report.
fn verdict(report: &str) -> &str {
    report
        .lines()
        .find(|l| l.contains("THE MACHINE") || l.contains("UNDECIDED"))
        .unwrap_or("")
}

/// Every bundle of the job, by node.
fn node_bundles(out: &Path) -> Vec<(String, PathBuf)> {
    let mut v = Vec::new();
    for i in 1..=3 {
        let node = format!("n{i}");
        for b in bundles(&out.join(&node)) {
            v.push((node.clone(), b));
        }
    }
    v
}

fn json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

/// Checks both scenarios share: every node dumped while the job hung (the stall trigger),
/// its host name is its namespace's, and rank 1's stacks were taken with py-spy.
fn check_the_nodes(out: &Path) -> Value {
    let all = node_bundles(out);
    for i in 1..=3 {
        let node = format!("n{i}");
        let stalled = all.iter().filter(|(n, _)| *n == node).any(|(_, b)| {
            let t = json(&b.join("timeline.json"));
            t["host"]["hostname"] == node.as_str() && t["trigger"]["kind"] == "stall"
        });
        assert!(
            stalled,
            "{node}: a bundle of the stall trigger with host {node}: {all:?}"
        );
    }
    let (_, b) = all
        .iter()
        .find(|(n, b)| n == "n2" && json(&b.join("timeline.json"))["trigger"]["kind"] == "stall")
        .unwrap();
    let snap = json(&b.join("snapshot.json"));
    let r1 = snap["stacks"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["rank"] == 1 && p["rank_main"] == true)
        .unwrap_or_else(|| panic!("rank 1 in n2's stacks: {:#}", snap["stacks"]))
        .clone();
    r1
}

#[test]
fn a_rank_stopped_in_python_is_named_with_its_node_and_frame_as_the_jobs_code() {
    let t = "a_rank_stopped_in_python_is_named_with_its_node_and_frame_as_the_jobs_code";
    if !privileged(t) {
        return;
    }
    let Some(venv) = venv(t) else { return };
    let (out, errs) = run_job("py", &venv, &Stop::Sleep);
    let r1 = check_the_nodes(&out);
    let report = job_report(&out, &errs);
    let v = verdict(&report);
    eprintln!("rank 1 at the trigger: {r1:#}\n{report}");
    assert!(
        v.contains("NOT THE MACHINE (software"),
        "the verdict: {v}\n{report}"
    );
    assert!(
        v.contains("rank 1") && v.contains("n2"),
        "rank 1 on n2 named: {v}"
    );
    assert!(v.contains("wait_for_the_flag"), "its frame named: {v}");
    assert!(
        v.contains("waited in collective 6 (gloo:all_reduce, PG 0)"),
        "the collective, from the Flight Recorder dumps that agree: {v}"
    );
    // torch's Flight Recorder: rank 0 (n1) dumped at its timeout, read into n1's bundle with
    // collective 6 its newest entry; rank 1 (n2) was stopped before it could dump.
    let fr = |node: &str| -> Vec<Value> {
        node_bundles(&out)
            .into_iter()
            .filter(|(n, _)| n == node)
            .filter_map(|(_, b)| std::fs::read(b.join("flight_recorder.json")).ok())
            .flat_map(|b| {
                let v: Value = serde_json::from_slice(&b).unwrap();
                v["ranks"].as_array().cloned().unwrap_or_default()
            })
            .collect()
    };
    let r0 = fr("n1");
    let r0 = r0
        .iter()
        .find(|r| r["rank"] == 0 && r["status"] == "read")
        .unwrap_or_else(|| panic!("rank 0's dump read on n1: {r0:#?}"));
    let last = r0["dump"]["entries"]
        .as_array()
        .and_then(|e| e.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (&last["collective_seq_id"], &last["profiling_name"]),
        (&serde_json::json!(6), &serde_json::json!("gloo:all_reduce")),
        "{r0:#}"
    );
    assert!(
        fr("n2")
            .iter()
            .any(|r| r["rank"] == 1 && r["status"] == "no_file"),
        "rank 1 wrote no dump: {:#?}",
        fr("n2")
    );
    // `NANTRACE_TORCH_KEEP=1`: the bundles stay (data/demo-hang is such a recording).
    if std::env::var_os("NANTRACE_TORCH_KEEP").is_some() {
        eprintln!("KEPT the job's bundles: {}", out.display());
        return;
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_rank_stopped_in_d_state_on_storage_is_named_with_its_node_and_stack_as_storage() {
    let t = "a_rank_stopped_in_d_state_on_storage_is_named_with_its_node_and_stack_as_storage";
    if !privileged(t) {
        return;
    }
    let Some(venv) = venv(t) else { return };
    let dir = Scratch::new("torch-io");
    let lo = LoopDev::new(&dir.join("shard.img"), "16M", None);
    let th = Throttle::new(
        &format!("nantrace-torch-{}", std::process::id()),
        &format!("7:{}", lo.minor),
        512,
    );
    let (out, errs) = run_job(
        "io",
        &venv,
        &Stop::Read {
            dev: &lo.dev,
            cgroup: &th.0,
        },
    );
    let r1 = check_the_nodes(&out);
    assert_eq!(
        r1["threads"][0]["state"],
        serde_json::json!(["D", "D"]),
        "{r1:#}"
    );
    let report = job_report(&out, &errs);
    let v = verdict(&report);
    eprintln!("{report}");
    assert!(
        v.contains("POSSIBLY THE MACHINE (storage"),
        "the verdict: {v}\n{report}"
    );
    assert!(
        v.contains("rank 1") && v.contains("n2"),
        "rank 1 on n2 named: {v}"
    );
    assert!(v.contains("load_shard"), "its frame named: {v}");
    drop(th);
    let _ = std::fs::remove_dir_all(&out);
}
