//! Helpers for the privileged integration tests: root check, a running `nantrace watch`, a
//! memory-limited cgroup (v1 or v2), network namespaces. Everything created is removed on drop.
#![allow(dead_code, reason = "each test file uses a subset")]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod agent;
pub mod golden;
pub mod slurm;

pub const BIN: &str = env!("CARGO_BIN_EXE_nantrace");

/// True when the test may run. Not root: fails in CI (CI runs as root), skips loudly elsewhere.
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{test}: privileged test needs root, and CI runs as root");
    }
    eprintln!("SKIPPED {test}: needs root (loads eBPF probes, makes cgroups and namespaces)");
    false
}

pub fn sh(cmd: &str) -> std::process::Output {
    Command::new("sh").arg("-c").arg(cmd).output().expect("sh")
}

/// Give `p` to uid and gid 65534 (nobody), the link itself where `p` is a symlink.
pub fn chown_nobody(p: &Path) {
    sh_ok(&format!("chown -h 65534:65534 '{}'", p.display()));
}

pub fn sh_ok(cmd: &str) {
    let o = sh(cmd);
    assert!(
        o.status.success(),
        "`{cmd}` failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every thread of process `pid`: its name, what it waits on (wchan), its kernel stack and,
/// where gdb is installed, its user-space backtrace. What a hung test prints before it
/// fails, so that a hang leaves its cause, not only its timeout.
pub fn stacks(pid: u32) -> String {
    let mut out = format!(
        "== process {pid} ({})\n",
        read_trim(&format!("/proc/{pid}/comm"))
    );
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map_or_else(
        |_| Vec::new(),
        |rd| rd.flatten().map(|e| e.path()).collect::<Vec<_>>(),
    );
    for t in tasks {
        out.push_str(&format!(
            "-- thread {} ({}) wchan {}\n{}",
            t.file_name().unwrap_or_default().to_string_lossy(),
            read_trim(&t.join("comm").to_string_lossy()),
            read_trim(&t.join("wchan").to_string_lossy()),
            std::fs::read_to_string(t.join("stack")).unwrap_or_default()
        ));
    }
    if Path::new("/usr/bin/gdb").exists() {
        let o = Command::new("timeout")
            .args([
                "-k",
                "5",
                "90",
                "/usr/bin/gdb",
                "-batch",
                "-nx",
                "-p",
                &pid.to_string(),
                "-ex",
                "thread apply all bt",
            ])
            .stdin(Stdio::null())
            .output();
        if let Ok(o) = o {
            let text = String::from_utf8_lossy(&o.stdout);
            // Threads and frames only: gdb's chatter about symbols is not the evidence.
            for l in text
                .lines()
                .filter(|l| l.starts_with("Thread ") || l.starts_with('#'))
            {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

fn read_trim(p: &str) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// How long a test may hold a `nantrace watch` before its guard prints every thread's stack
/// of the test and of the watch, and kills the watch: no kernel test holds one for a tenth
/// of this, even in the matrix's slowest guest.
const WATCH_GUARD: Duration = Duration::from_secs(150);

/// How long `Watch::stop` waits for the watch to exit after its SIGINT (it takes well under
/// a second on the host and a few in a TCG guest).
const STOP_LIMIT: Duration = Duration::from_secs(60);

/// A running `nantrace watch --json`, its events collected by a thread.
pub struct Watch {
    child: Child,
    pub events: Arc<Mutex<Vec<Value>>>,
    /// Set when the Watch is done with: its guard thread then goes.
    done: Arc<std::sync::atomic::AtomicBool>,
    /// While set, nobody reads the watch's stdout: its pipe fills and its writes block.
    paused: Arc<std::sync::atomic::AtomicBool>,
    /// The read end of the watch's stdout (owned by the reader thread).
    stdout_fd: i32,
}

impl Watch {
    pub fn start(args: &[&str]) -> Self {
        Self::start_env(args, &[])
    }

    /// As [`Watch::start`], with environment variables set for nantrace.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(BIN)
            .args(["watch", "--json"])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nantrace watch");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[watch] {line}");
                if line.contains("watching") {
                    let _ = tx.send(());
                }
            }
        });
        let events = Arc::new(Mutex::new(Vec::new()));
        let ev = events.clone();
        let paused = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let p = paused.clone();
        let stdout = child.stdout.take().unwrap();
        let stdout_fd = std::os::fd::AsRawFd::as_raw_fd(&stdout);
        std::thread::spawn(move || {
            // A small buffer: a pause stops the reading within a few lines.
            for line in BufReader::with_capacity(512, stdout)
                .lines()
                .map_while(Result::ok)
            {
                while p.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    ev.lock().unwrap().push(v);
                }
            }
        });
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, watch_pid) = (done.clone(), child.id());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while t0.elapsed() < WATCH_GUARD {
                if d.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            eprintln!(
                "HANG: a test has held `nantrace watch` (pid {watch_pid}) for {WATCH_GUARD:?}; every thread of both processes:\n{}\n{}",
                stacks(std::process::id()),
                stacks(watch_pid)
            );
            // SAFETY: our own child; a test blocked on its output or exit then goes on (and fails).
            unsafe { libc::kill(watch_pid as i32, libc::SIGKILL) };
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("nantrace watch did not report that its probes are attached");
        Watch {
            child,
            events,
            done,
            paused,
            stdout_fd,
        }
    }

    /// Make the watch's stdout pipe one page (from 64 KiB): a paused reader then blocks the
    /// watch after a few dozen lines.
    pub fn shrink_stdout_pipe(&self) {
        // SAFETY: fcntl on a pipe descriptor this Watch's reader thread holds open.
        let rc = unsafe { libc::fcntl(self.stdout_fd, libc::F_SETPIPE_SZ, 4096) };
        assert!(rc > 0, "F_SETPIPE_SZ: {}", std::io::Error::last_os_error());
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stop (or go on) reading the watch's stdout.
    pub fn pause_reading(&self, on: bool) {
        self.paused.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the watch exits by itself within `limit`.
    pub fn exits_within(&mut self, limit: Duration) -> bool {
        let t0 = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return true,
                Ok(None) if t0.elapsed() > limit => return false,
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// Wait until an event satisfies `pred`; returns it and how long it took.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> (Value, Duration) {
        let t0 = Instant::now();
        loop {
            if let Some(v) = self
                .events
                .lock()
                .unwrap()
                .iter()
                .find(|v| pred(v))
                .cloned()
            {
                return (v, t0.elapsed());
            }
            if t0.elapsed() > timeout {
                let all = self.events.lock().unwrap();
                let tail: Vec<String> = all.iter().rev().take(20).map(|v| v.to_string()).collect();
                panic!(
                    "no {what} within {timeout:?}; last events:\n{}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn all(&self, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|v| pred(v))
            .cloned()
            .collect()
    }

    /// Stop with SIGINT and return the accounting line. A watch that does not exit within
    /// [`STOP_LIMIT`] fails the test with every thread's stack of it.
    pub fn stop(mut self) -> Value {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let t0 = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if t0.elapsed() > STOP_LIMIT => {
                    let st = stacks(self.child.id());
                    panic!("nantrace watch did not exit within {STOP_LIMIT:?} of its SIGINT; its threads:\n{st}");
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        // The accounting line is the last thing it writes: its reader has it at EOF.
        let t0 = Instant::now();
        loop {
            if let Some(a) = self
                .events
                .lock()
                .unwrap()
                .iter()
                .find(|v| v.get("accounting").is_some())
                .cloned()
            {
                return a;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "accounting line at the end"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A memory cgroup with a limit (cgroup v2 when it has the memory controller, else v1).
pub struct MemCgroup {
    pub path: PathBuf,
    pub v2: bool,
}

impl MemCgroup {
    pub fn new(name: &str, limit: u64) -> Self {
        let v2root = Path::new("/sys/fs/cgroup");
        let v2 = std::fs::read_to_string(v2root.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
        let path = if v2 {
            v2root.join(name)
        } else {
            PathBuf::from("/sys/fs/cgroup/memory").join(name)
        };
        let _ = std::fs::remove_dir(&path);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        if v2 {
            let _ = std::fs::write(v2root.join("cgroup.subtree_control"), "+memory");
            std::fs::write(path.join("memory.max"), limit.to_string()).unwrap();
            let _ = std::fs::write(path.join("memory.swap.max"), "0");
        } else {
            std::fs::write(path.join("memory.limit_in_bytes"), limit.to_string()).unwrap();
            let _ = std::fs::write(path.join("memory.memsw.limit_in_bytes"), limit.to_string());
        }
        MemCgroup { path, v2 }
    }

    pub fn procs(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if let Ok(p) = std::fs::read_to_string(self.procs()) {
            for pid in p.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: killing leftover test processes in our own cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Two network namespaces joined by a veth pair: `a` = 10.213.0.1, `b` = 10.213.0.2.
pub struct NetPair {
    pub a: String,
    pub b: String,
}

impl NetPair {
    pub fn new(tag: &str) -> Self {
        let a = format!("nta-{tag}");
        let b = format!("ntb-{tag}");
        let _ = sh(&format!(
            "ip netns del {a} 2>/dev/null; ip netns del {b} 2>/dev/null"
        ));
        sh_ok(&format!(
            "ip netns add {a} && ip netns add {b} && \
             ip link add va-{tag} netns {a} type veth peer name vb-{tag} netns {b} && \
             ip -n {a} addr add 10.213.0.1/24 dev va-{tag} && ip -n {b} addr add 10.213.0.2/24 dev vb-{tag} && \
             ip -n {a} link set va-{tag} up && ip -n {b} link set vb-{tag} up && \
             ip -n {a} link set lo up && ip -n {b} link set lo up"
        ));
        NetPair { a, b }
    }

    /// Run `f` in a thread that has entered namespace `ns`.
    pub fn in_ns<T: Send + 'static>(
        ns: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/var/run/netns/{ns}");
        std::thread::spawn(move || {
            let f_ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            use std::os::fd::AsRawFd;
            // SAFETY: setns on this thread only, with a valid namespace fd.
            let rc = unsafe { libc::setns(f_ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        let _ = sh(&format!(
            "ip netns del {} ; ip netns del {}",
            self.a, self.b
        ));
    }
}

/// The console loglevel (`dmesg -n`) set for a test, put back on drop.
pub struct ConsoleLevel(String);

impl ConsoleLevel {
    pub fn set(level: u32) -> Self {
        let old = std::fs::read_to_string("/proc/sys/kernel/printk")
            .expect("read /proc/sys/kernel/printk");
        let first = old.split_whitespace().next().unwrap_or("4").to_string();
        std::fs::write("/proc/sys/kernel/printk", level.to_string())
            .expect("set the console loglevel");
        ConsoleLevel(first)
    }
}

impl Drop for ConsoleLevel {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/kernel/printk", &self.0);
    }
}

/// Write one line to the kernel log (fires printk:console).
pub fn kmsg(line: &str) {
    std::fs::write("/dev/kmsg", format!("{line}\n")).expect("write /dev/kmsg");
}

/// A fresh output directory for a test's bundles.
pub fn out_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nt-bundles-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The one bundle a test expects under `out`.
pub fn only_bundle(out: &Path) -> PathBuf {
    let b: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("nantrace-")
        })
        .collect();
    assert_eq!(
        b.len(),
        1,
        "expected exactly one bundle in {}: {b:?}",
        out.display()
    );
    b[0].clone()
}

// Helpers of the hostile suites (tests/hostile.rs, tests/hostile_input.rs, tests/hostile_output.rs).

/// A scratch directory for one hostile test, removed at the end.
/// Whether the kernel writes a core file into the dumping process's working directory (a
/// `core_pattern` that is neither a pipe nor an absolute or relative path elsewhere), so a
/// test can let a process dump a core into a scratch directory and expect WCOREDUMP.
pub fn cores_land_in_cwd() -> bool {
    let p = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap_or_default();
    let p = p.trim();
    !p.is_empty() && !p.starts_with('|') && !p.contains('/')
}

pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("nantrace-hostile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch(p)
    }
    pub fn join(&self, s: &str) -> PathBuf {
        self.0.join(s)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn nantrace(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args).stdin(Stdio::null());
    // The tests' own environment may come from sudo: the default must not depend on it.
    c.env_remove("SUDO_UID")
        .env_remove("SUDO_GID")
        .env_remove("SUDO_USER");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run nantrace")
}

pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

pub fn bundles(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with("nantrace-")
                        && !p.ends_with("nantrace-..")
                        && p.is_dir()
                        && !p.is_symlink()
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A real bundle, made with `run --no-probes` (log-only evidence).
pub fn make_bundle(dir: &Scratch, name: &str) -> PathBuf {
    let out = dir.join(name);
    let o = nantrace(
        &[
            "run",
            "--no-probes",
            "--post",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "echo 'HOSTILE-bundle step 1 loss nan'; exit 3",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(3), "{:?}", text(&o));
    let b = bundles(&out);
    assert_eq!(b.len(), 1, "{:?}", text(&o));
    b[0].clone()
}

/// The probe path this run is meant to test: `NANTRACE_PROBE_PATH=tracefs` forces the
/// fallback (`cargo xtask test` runs the kernel tests both ways); otherwise the BTF programs
/// are expected wherever the kernel has BTF.
/// As [`expect_btf`], for one tracepoint: the kernel matrix (`cargo xtask vm-test`) names in
/// `NANTRACE_EXPECT_TRACEFS` the probes that kernel runs on tracefs for a stated reason.
pub fn expect_btf_for(tp: &str) -> bool {
    expect_btf()
        && !std::env::var("NANTRACE_EXPECT_TRACEFS").is_ok_and(|v| v.split(',').any(|t| t == tp))
}

pub fn expect_btf() -> bool {
    std::env::var("NANTRACE_PROBE_PATH").map_or(true, |v| v != "tracefs")
        && Path::new("/sys/kernel/btf/vmlinux").exists()
}

/// Assert from a watch's accounting that `tracepoints` ran on the path this run tests.
pub fn assert_probe_path(acct: &Value, tracepoints: &[&str]) {
    let btf: Vec<&str> = acct["accounting"]["probes_btf"]
        .as_array()
        .expect("probes_btf in the accounting")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for tp in tracepoints {
        let want = expect_btf_for(tp);
        assert_eq!(
            btf.contains(tp),
            want,
            "{tp}: BTF path expected = {want}; on BTF: {btf:?}"
        );
    }
    eprintln!(
        "probe path: {}",
        if expect_btf() {
            "BTF"
        } else {
            "tracefs (forced)"
        }
    );
}

/// A loop device over `image` (a file created sparse, `size` long), detached on drop; `then`
/// runs after the detach (e.g. unmounting the image's filesystem).
pub struct LoopDev {
    pub dev: String,
    pub minor: u64,
    image: PathBuf,
    then: Option<String>,
}

impl LoopDev {
    pub fn new(image: &Path, size: &str, then: Option<String>) -> Self {
        sh_ok(&format!("truncate -s {size} {}", image.display()));
        let out = sh(&format!("losetup --find --show {}", image.display()));
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let minor = dev
            .trim_start_matches("/dev/loop")
            .parse()
            .expect("a /dev/loopN name");
        Self {
            dev,
            minor,
            image: image.to_path_buf(),
            then,
        }
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        // Bounded, and said when it did not finish: a detach or unmount that hangs must not
        // hang the suite (the guests' snapshot then shows where).
        let o = sh(&format!("timeout -k 5 60 losetup -d {}", self.dev));
        if !o.status.success() {
            eprintln!(
                "WARNING: losetup -d {}: {:?} {}",
                self.dev,
                o.status,
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let _ = std::fs::remove_file(&self.image);
        if let Some(c) = &self.then {
            let o = sh(&format!("timeout -k 5 60 sh -c '{c}'"));
            if !o.status.success() {
                eprintln!(
                    "WARNING: `{c}`: {:?} {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr)
                );
            }
        }
    }
}

/// How long a test's job may run ([`Gated::wait`]).
const JOB_LIMIT: Duration = Duration::from_secs(90);

/// `pid` and every process below it (from /proc/PID/task/*/children).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() && out.len() < 256 {
        let p = out[i];
        if let Ok(rd) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in rd.flatten() {
                let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                out.extend(
                    kids.split_whitespace()
                        .filter_map(|k| k.parse::<u32>().ok()),
                );
            }
        }
        i += 1;
    }
    out
}

/// A test's job: `sh -c` that waits for its go file (so nantrace has seeded its pid before it
/// forks), then runs `then`.
pub struct Gated {
    child: std::process::Child,
    go: std::path::PathBuf,
}

impl Gated {
    pub fn new(tag: &str, then: &str) -> Self {
        let go = std::env::temp_dir().join(format!("nt-{tag}-go-{}", std::process::id()));
        let _ = std::fs::remove_file(&go);
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while [ ! -e {} ]; do sleep 0.02; done; {then}",
                go.display()
            ))
            .spawn()
            .unwrap();
        Self { child, go }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    pub fn go(&self) {
        std::fs::write(&self.go, "").unwrap();
    }

    /// Wait for the job's end, [`JOB_LIMIT`] at most (every test's job takes seconds, even in a
    /// TCG guest): a job that does not end fails the test with the stacks of every process of
    /// its tree, instead of hanging it.
    pub fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if t0.elapsed() > JOB_LIMIT {
                let tree: String = descendants(self.child.id())
                    .into_iter()
                    .map(stacks)
                    .collect();
                panic!("the test's job did not end within {JOB_LIMIT:?}; its processes:\n{tree}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.go);
    }
}

/// The pid a test's job writes to `path`, waited for (10 s at most).
pub fn pid_from(path: &std::path::Path, what: &str) -> u32 {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(p) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what} never written to {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Compile the C program `src` into `exe` with gcc (CI installs it), `-O0` and `extra`.
pub fn gcc(src: &Path, exe: &Path, extra: &[&str]) {
    let o = Command::new("gcc")
        .arg("-O0")
        .args(extra)
        .arg("-o")
        .arg(exe)
        .arg(src)
        .output()
        .expect("gcc (CI installs it)");
    assert!(
        o.status.success(),
        "gcc: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A cgroup throttling reads of block device `majmin` to `bps`, removed on drop.
pub struct Throttle(pub PathBuf);

impl Throttle {
    pub fn new(tag: &str, majmin: &str, bps: u64) -> Self {
        let v1 = Path::new("/sys/fs/cgroup/blkio");
        let (dir, file, line) = if v1.join("blkio.throttle.read_bps_device").exists() {
            (
                v1.join(tag),
                "blkio.throttle.read_bps_device",
                format!("{majmin} {bps}"),
            )
        } else {
            // cgroup v2: the io controller enabled for the root's children.
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+io");
            (
                Path::new("/sys/fs/cgroup").join(tag),
                "io.max",
                format!("{majmin} rbps={bps}"),
            )
        };
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        std::fs::write(dir.join(file), &line)
            .unwrap_or_else(|e| panic!("{}/{file} <- {line}: {e}", dir.display()));
        Throttle(dir)
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}
