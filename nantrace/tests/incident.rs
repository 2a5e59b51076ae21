//! End to end: `nantrace run` / `attach` on real jobs; the bundle's contents.
mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

fn timeline(bundle: &Path) -> Value {
    let t = std::fs::read_to_string(bundle.join("timeline.json")).expect("timeline.json");
    serde_json::from_str(&t).expect("timeline.json parses")
}

fn run(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let o = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run nantrace");
    (
        o.status,
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn run_finds_the_nan_with_the_xid_before_it_and_the_worker_fork() {
    if !privileged("run_finds_the_nan_with_the_xid_before_it_and_the_worker_fork") {
        return;
    }
    let out = out_dir("nan");
    let script = r#"
for i in $(seq 1 30); do echo "step $i | loss 2.$((50 - i)) | lr 1.0e-3"; sleep 0.02; done
sleep 0.3 &
worker=$!
echo "NVRM: Xid (PCI:0000:3b:00): 79, pid=$$, name=train.sh, GPU has fallen off the bus." > /dev/kmsg
sleep 2
echo "step 31 | loss nan | lr 1.0e-3"
wait $worker
echo "step 32 | loss nan | lr 1.0e-3"
exit 0
"#;
    let (st, stdout, stderr) = run(&[
        "run",
        "--out",
        out.to_str().unwrap(),
        "--no-trigger",
        "xid",
        "--post",
        "2",
        "--",
        "bash",
        "-c",
        script,
    ]);
    eprintln!("{stderr}");
    assert!(st.success(), "nantrace's exit code is the job's (0)");
    // Output passes through unchanged.
    assert!(
        stdout.contains("step 1 | loss 2.49 | lr 1.0e-3\n"),
        "{stdout}"
    );
    assert!(stdout.contains("step 32 | loss nan"));
    let b = only_bundle(&out);
    assert!(b
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("nantrace-"));
    for f in ["timeline.json", "app.log", "kernel.log"] {
        let mode = std::fs::metadata(b.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{f} mode {mode:o}");
    }
    let t = timeline(&b);
    assert_eq!(t["schema"], "nantrace.timeline/1");
    assert_eq!(t["trigger"]["kind"], "nan");
    assert_eq!(t["trigger"]["reason"], "step 31 | loss nan | lr 1.0e-3");
    assert_eq!(t["first_nan"]["step"], 31);
    let events = t["events"].as_array().unwrap();
    let xid = events
        .iter()
        .find(|e| e["source"] == "xid" && e["xid"] == 79)
        .expect("Xid event in the timeline");
    let off = xid["offset_s"].as_f64().unwrap();
    assert!(
        (-3.0..-1.5).contains(&off),
        "Xid about 2 s before the NaN, got {off}"
    );
    let trig = events
        .iter()
        .find(|e| e["source"] == "trigger")
        .expect("trigger event");
    assert_eq!(trig["offset_s"].as_f64(), Some(0.0));
    let root = t["job"]["root_pid"].as_u64().unwrap();
    assert!(
        events.iter().any(|e| e["source"] == "fork"
            && e["pid"].as_u64() == Some(root)
            && e["child_comm"] == "bash"),
        "the worker's fork"
    );
    // Time order.
    let monos: Vec<u64> = events
        .iter()
        .map(|e| e["mono_ns"].as_u64().unwrap())
        .collect();
    assert!(monos.windows(2).all(|w| w[0] <= w[1]));
    let app = std::fs::read_to_string(b.join("app.log")).unwrap();
    assert!(
        app.contains("[stdout] step 1 | loss 2.49"),
        "app.log keeps the lines before the NaN"
    );
    let marker = app.find("FIRST NON-FINITE").expect("marker");
    assert!(app[marker..]
        .lines()
        .nth(1)
        .unwrap()
        .ends_with("step 31 | loss nan | lr 1.0e-3"));
    let klog = std::fs::read_to_string(b.join("kernel.log")).unwrap();
    assert!(klog.contains("NVRM: Xid (PCI:0000:3b:00): 79"));
    // Every probe attached, on either path, but the AER tracepoint this kernel lacks.
    let attached: Vec<&str> = t["accounting"]["probes_attached"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // The kernel log through the probe, or through /dev/kmsg where the probe would miss lines
    // a quiet console does not print (5.10), as the accounting says.
    let klog = t["accounting"]["kernel_log"]["source"]
        .as_str()
        .expect("kernel_log.source in the accounting");
    assert!(
        attached.contains(&klog),
        "the kernel log's source {klog} not attached: {attached:?}"
    );
    for tp in [
        "oom:mark_victim",
        "block:block_rq_issue",
        "block:block_rq_complete",
        "tcp:tcp_retransmit_skb",
        "sched:sched_process_fork",
        "sched:sched_process_exec",
        "sched:sched_process_exit",
        "signal:signal_generate",
    ] {
        assert!(attached.contains(&tp), "{tp} not attached: {attached:?}");
    }
    let not: Vec<&String> = t["accounting"]["probes_not_attached"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "ras:aer_event" && !(klog == "/dev/kmsg" && *k == "printk:console"))
        .collect();
    assert!(not.is_empty(), "not attached: {not:?}");
    // The five families of evidence, each filled or saying why not.
    let snap: Value =
        serde_json::from_str(&std::fs::read_to_string(b.join("snapshot.json")).unwrap()).unwrap();
    assert!(
        snap["gpu"]["available"] == true
            || snap["gpu"]["reason"]
                .as_str()
                .unwrap()
                .starts_with("NVML unavailable")
    );
    assert!(snap["system"]["free"]["mem_total_kb"].as_u64().is_some());
    assert!(snap["network"]["links"].is_object());
    assert_eq!(snap["software"]["job_pid"].as_u64(), Some(root));
    assert!(snap["scheduler"]["cgroup"]["paths"].is_array());
    assert!(
        events
            .iter()
            .any(|e| e["source"] == "system" && e["mem_available_kb"].as_u64().is_some()),
        "system samples in the timeline"
    );
    assert!(stderr.contains("incident bundle written"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn job_killed_by_sigkill_gives_a_signal_bundle() {
    if !privileged("job_killed_by_sigkill_gives_a_signal_bundle") {
        return;
    }
    let out = out_dir("kill");
    let (st, _, stderr) = run(&[
        "run",
        "--out",
        out.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        "echo 'step 1 | loss 1.0'; sleep 0.2; kill -9 $$",
    ]);
    eprintln!("{stderr}");
    assert_eq!(st.code(), Some(128 + 9), "exit code = 128 + SIGKILL");
    let t = timeline(&only_bundle(&out));
    assert_eq!(t["trigger"]["kind"], "signal");
    assert_eq!(t["job"]["exit_signal"], 9);
    let root = t["job"]["root_pid"].as_u64().unwrap();
    let events = t["events"].as_array().unwrap();
    assert!(events.iter().any(|e| e["source"] == "signal"
        && e["target_pid"].as_u64() == Some(root)
        && e["signal"] == "SIGKILL"));
    let _ = std::fs::remove_dir_all(&out);
}

/// A job that dumps a core: wait(2)'s WCOREDUMP in the facts and the report, and the kernel's
/// record of it in the exit event (BTF path).
#[test]
fn a_job_that_dumps_core_says_so() {
    if !privileged("a_job_that_dumps_core_says_so") {
        return;
    }
    if !cores_land_in_cwd() {
        eprintln!("SKIP a_job_that_dumps_core_says_so: core_pattern does not write cores into the working directory here");
        return;
    }
    let out = out_dir("core");
    // Writable by the job whoever it runs as (under sudo, `run` drops to the invoking user).
    let dir = Scratch::new("core-cwd");
    std::fs::set_permissions(&dir.0, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    // coredump_filter 0: no memory mappings in the core, a tiny file.
    let script = format!("echo 0 > /proc/self/coredump_filter; ulimit -c unlimited; cd {}; echo 'step 1 | loss 1.0'; kill -SEGV $$", dir.0.display());
    let (st, _, stderr) = run(&[
        "run",
        "--out",
        out.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        &script,
    ]);
    eprintln!("{stderr}");
    assert_eq!(st.code(), Some(128 + 11), "exit code = 128 + SIGSEGV");
    let bundle = only_bundle(&out);
    let t = timeline(&bundle);
    assert_eq!(t["job"]["exit_signal"], 11);
    assert_eq!(t["job"]["exit_core_dumped"], true, "{}", t["job"]);
    let report = std::fs::read_to_string(bundle.join("report.md")).unwrap();
    assert!(report.contains("signal 11 (core dumped)"), "{report}");
    let root = t["job"]["root_pid"].as_u64().unwrap();
    let exit = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["source"] == "exit" && e["pid"].as_u64() == Some(root))
        .cloned()
        .expect("the job's exit event");
    if expect_btf_for("sched:sched_process_exit") {
        assert_eq!(exit["core_dumped"], true, "{exit}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn job_exiting_1_gives_an_exit_bundle_and_exit_0_none() {
    if !privileged("job_exiting_1_gives_an_exit_bundle_and_exit_0_none") {
        return;
    }
    let out = out_dir("exit");
    let (st, _, _) = run(&[
        "run",
        "--out",
        out.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        "echo 'step 1 | loss 1.0'; exit 1",
    ]);
    assert_eq!(st.code(), Some(1));
    let t = timeline(&only_bundle(&out));
    assert_eq!(t["trigger"]["kind"], "exit");
    assert_eq!(t["job"]["exit_code"], 1);
    assert_eq!(t["first_nan"], Value::Null);
    let out0 = out_dir("exit0");
    let (st, _, stderr) = run(&["run", "--out", out0.to_str().unwrap(), "--", "true"]);
    assert_eq!(st.code(), Some(0));
    assert!(stderr.contains("no incident"));
    assert_eq!(std::fs::read_dir(&out0).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&out0);
}

/// How long a step of these tests may wait for nantrace: seconds on the host, far less than
/// this in the slowest TCG guest.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// A nantrace process whose stderr lines are collected by a thread.
struct Nt {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Nt {
    fn spawn(args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (l, err) = (lines.clone(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        Nt { child, lines }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    fn wait_line(&self, what: &str, pred: impl Fn(&str) -> bool) {
        wait_until(
            what,
            || self.lines.lock().unwrap().iter().any(|l| pred(l)),
            || self.stderr(),
        );
    }

    fn wait(mut self) -> (std::process::ExitStatus, String) {
        let t0 = std::time::Instant::now();
        let st = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if t0.elapsed() > STEP_LIMIT {
                let _ = self.child.kill();
                panic!(
                    "nantrace did not exit; its threads:\n{}\nits stderr:\n{}",
                    stacks(self.pid()),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Its stderr is read to the end once it has exited.
        std::thread::sleep(Duration::from_millis(100));
        (st, self.stderr())
    }
}

impl Drop for Nt {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait for `cond` ([`STEP_LIMIT`] at most); on a timeout, fail with `what` and `evidence()`.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool, evidence: impl Fn() -> String) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < STEP_LIMIT,
            "{what}: not within {STEP_LIMIT:?}\n{}",
            evidence()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where process `pid` stands in `path`: (inode, offset) of each of its descriptors open on
/// that path (from /proc/PID/fd and fdinfo). How a test knows a follower has read what it
/// wrote, without sleeping for it.
fn readers_of(pid: u32, path: &Path) -> Vec<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == path))
        .filter_map(|e| {
            let ino = std::fs::metadata(e.path()).ok()?.ino();
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .ok()?;
            let pos = info
                .lines()
                .find_map(|l| l.strip_prefix("pos:"))?
                .trim()
                .parse()
                .ok()?;
            Some((ino, pos))
        })
        .collect()
}

/// Wait until process `pid` has read `path` to its end (the file it names now, not an older
/// one renamed away).
fn read_to_the_end(pid: u32, path: &Path, what: &str) {
    use std::os::unix::fs::MetadataExt as _;
    wait_until(
        what,
        || {
            let m = std::fs::metadata(path).unwrap();
            readers_of(pid, path).contains(&(m.ino(), m.len()))
        },
        || {
            format!(
                "readers {:?}, file {:?}",
                readers_of(pid, path),
                std::fs::metadata(path).map(|m| (m.ino(), m.len()))
            )
        },
    );
}

/// Not privileged: the log-following path runs without probes (`--no-probes`). Each step
/// waits for the follower to have read the file to its end (its descriptor's offset), not for
/// a time: the same on the host and in a TCG guest.
#[test]
fn attach_follows_rotation_and_truncation() {
    let out = out_dir("attach");
    let log = out.join("train.log");
    std::fs::write(&log, "old line before attach\nstep 1 | loss 3.0\n").unwrap();
    let mut job = Command::new("sleep").arg("600").spawn().unwrap();
    let nt = Nt::spawn(&[
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
    ]);
    let append = |p: &Path, s: &str| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(p)
            .unwrap();
        f.write_all(s.as_bytes()).unwrap();
    };
    read_to_the_end(nt.pid(), &log, "attach read the log at its start");
    append(&log, "step 2 | loss 2.9\n");
    read_to_the_end(nt.pid(), &log, "step 2 read");
    // Rotation: rename and start a new file.
    std::fs::rename(&log, out.join("train.log.1")).unwrap();
    append(&log, "step 3 | loss 2.8 (after rotation)\n");
    read_to_the_end(nt.pid(), &log, "the new file after the rotation read");
    // Truncation (copytruncate), then the NaN: the follower must have seen the file empty
    // (its offset back at 0), else the longer NaN line would be read from its old offset.
    std::fs::write(&log, "").unwrap();
    read_to_the_end(nt.pid(), &log, "the truncation seen");
    append(&log, "step 4 | loss nan (after truncation)\n");
    // The bundle is written after the post-window; attach keeps watching while the job lives.
    wait_until(
        "a bundle written",
        || {
            std::fs::read_dir(&out)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_str().unwrap().starts_with("nantrace-"))
        },
        || nt.stderr(),
    );
    let _ = job.kill();
    let _ = job.wait();
    let (st, err) = nt.wait();
    eprintln!("{err}");
    assert!(st.success());
    let b = only_bundle(&out);
    let t = timeline(&b);
    assert_eq!(t["trigger"]["kind"], "nan");
    assert_eq!(t["accounting"]["probes_error"], "disabled with --no-probes");
    let app = std::fs::read_to_string(b.join("app.log")).unwrap();
    let pos = |s: &str| {
        app.find(s)
            .unwrap_or_else(|| panic!("{s:?} missing from app.log:\n{app}"))
    };
    assert!(pos("old line before attach") < pos("step 2 | loss 2.9"));
    assert!(pos("step 2 | loss 2.9") < pos("step 3 | loss 2.8 (after rotation)"));
    assert!(pos("(after rotation)") < pos("step 4 | loss nan (after truncation)"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn full_disk_gives_a_message_and_keeps_what_fits() {
    if !privileged("full_disk_gives_a_message_and_keeps_what_fits") {
        return;
    }
    let mnt = std::env::temp_dir().join(format!("nt-tiny-{}", std::process::id()));
    std::fs::create_dir_all(&mnt).unwrap();
    sh_ok(&format!(
        "mount -t tmpfs -o size=16k tmpfs {}",
        mnt.display()
    ));
    struct Umount(PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = sh(&format!("umount {}", self.0.display()));
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _u = Umount(mnt.clone());
    let (st, _, stderr) = run(&[
        "run",
        "--out",
        mnt.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        "for i in $(seq 1 50); do echo \"step $i | loss 2.$i\"; done; exit 1",
    ]);
    assert_eq!(
        st.code(),
        Some(1),
        "the job's exit code, whatever the disk: {stderr}"
    );
    assert!(
        stderr.contains("bundle file not written") && stderr.contains("No space left"),
        "{stderr}"
    );
    let b = only_bundle(&mnt);
    assert!(b.join("app.log").exists(), "what fits is kept");
    assert!(std::fs::read_to_string(b.join("app.log"))
        .unwrap()
        .contains("step 50"));
}

#[test]
fn without_privileges_the_log_path_still_gives_a_bundle() {
    if !privileged("without_privileges_the_log_path_still_gives_a_bundle") {
        return;
    }
    let out = out_dir("nopriv");
    sh_ok(&format!("chmod 777 {}", out.display()));
    let o = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            BIN,
            "run",
            "--out",
            out.to_str().unwrap(),
            "--post",
            "0.5",
            "--",
            "sh",
            "-c",
            "echo 'step 1 | loss 1.0'; echo 'step 2 | loss nan'",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("kernel probes unavailable"),
        "the missing permission is said: {err}"
    );
    let t = timeline(&only_bundle(&out));
    assert_eq!(t["trigger"]["kind"], "nan");
    assert!(
        t["accounting"]["probes_error"]
            .as_str()
            .unwrap()
            .contains("root"),
        "{}",
        t["accounting"]["probes_error"]
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn attach_to_a_dead_pid_is_a_clear_error() {
    let out = out_dir("dead");
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    let (st, _, stderr) = run(&[
        "attach",
        "--no-probes",
        "--pid",
        &pid.to_string(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!st.success());
    assert!(
        stderr.contains(&format!("pid {pid} does not exist")),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// A process's signal masks and threads: what a lost signal leaves to read.
fn signal_state(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let masks: Vec<&str> = status
        .lines()
        .filter(|l| l.starts_with("Sig") || l.starts_with("ShdPnd"))
        .collect();
    format!("{}\n{}", masks.join("\n"), stacks(pid))
}

/// Whether process `pid` catches signal `sig` (its SigCgt mask in /proc/PID/status).
fn catches(pid: u32, sig: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let m = s
                .lines()
                .find_map(|l| l.strip_prefix("SigCgt:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&m, 16).ok()
        })
        .is_some_and(|m| m & (1 << (sig - 1)) != 0)
}

/// Not privileged: the trigger file and SIGUSR1 (`--no-probes`). Each job waits for the test
/// to say it may end (an END file, written once nantrace said what the test waits for), and
/// each signal is sent once nantrace says its signals are armed (their listeners exist: the
/// caught-signal mask alone shows a moment before, and a SIGUSR1 sent then was lost in a
/// loaded TCG guest): no step depends on how fast nantrace starts.
#[test]
fn trigger_file_and_sigusr1_each_give_a_bundle() {
    let out = out_dir("tfile");
    let (tf, end) = (out.join("DUMP"), out.join("END"));
    // Ends by itself after 120 s at the latest, whatever happens to the test.
    let until_end = format!(
        "i=0; while [ ! -e {} ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done",
        end.display()
    );
    let nt = Nt::spawn(&[
        "run",
        "--no-probes",
        "--post",
        "0.3",
        "--trigger-file",
        tf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        &format!(
            "echo 'step 1 | loss 1.0'; touch {}; {until_end}",
            tf.display()
        ),
    ]);
    nt.wait_line("the trigger file fired", |l| l.contains("trigger file:"));
    wait_until(
        "its bundle",
        || {
            std::fs::read_dir(&out)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("nantrace-"))
        },
        || nt.stderr(),
    );
    std::fs::write(&end, "").unwrap();
    let (st, stderr) = nt.wait();
    assert!(st.success(), "{stderr}");
    let t = timeline(&only_bundle(&out));
    assert_eq!(t["trigger"]["kind"], "file");
    assert!(t["trigger"]["reason"].as_str().unwrap().contains("DUMP"));
    let _ = std::fs::remove_dir_all(&out);

    let out = out_dir("usr1");
    let end = out.join("END");
    let until_end = format!(
        "i=0; while [ ! -e {} ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done",
        end.display()
    );
    let nt = Nt::spawn(&[
        "run",
        "--no-probes",
        "--post",
        "0.3",
        "--out",
        out.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        &format!("echo 'step 1 | loss 1.0'; {until_end}"),
    ]);
    nt.wait_line("its signals armed", |l| {
        l.contains("nantrace: signals armed")
    });
    assert!(
        catches(nt.pid(), libc::SIGUSR1),
        "armed, and SIGUSR1 caught"
    );
    // SAFETY: signalling our own child.
    unsafe { libc::kill(nt.pid() as i32, libc::SIGUSR1) };
    wait_until(
        "its bundle",
        || {
            std::fs::read_dir(&out)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("nantrace-"))
        },
        || format!("{}\n{}", nt.stderr(), signal_state(nt.pid())),
    );
    std::fs::write(&end, "").unwrap();
    let (st, stderr) = nt.wait();
    assert!(st.success(), "{stderr}");
    let t = timeline(&only_bundle(&out));
    assert_eq!(t["trigger"]["kind"], "usr1");
    // --no-trigger turns one off: the same SIGUSR1 then writes nothing, and nantrace says so.
    let out2 = out_dir("usr1off");
    let end = out2.join("END");
    let until_end = format!(
        "i=0; while [ ! -e {} ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done",
        end.display()
    );
    let nt = Nt::spawn(&[
        "run",
        "--no-probes",
        "--no-trigger",
        "usr1",
        "--out",
        out2.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        &until_end,
    ]);
    nt.wait_line("its signals armed", |l| {
        l.contains("nantrace: signals armed")
    });
    assert!(
        catches(nt.pid(), libc::SIGUSR1),
        "armed, and SIGUSR1 caught"
    );
    // SAFETY: as above.
    unsafe { libc::kill(nt.pid() as i32, libc::SIGUSR1) };
    nt.wait_line("the turned-off trigger said", |l| {
        l.contains("trigger usr1 is turned off, nothing written")
    });
    std::fs::write(&end, "").unwrap();
    let (st, stderr) = nt.wait();
    assert!(st.success(), "{stderr}");
    let left: Vec<_> = std::fs::read_dir(&out2)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n != "END")
        .collect();
    assert!(left.is_empty(), "usr1 was turned off: {left:?}");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&out2);
}
