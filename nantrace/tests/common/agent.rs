//! A running `nantrace agent` for the tests: its own spool, socket and metrics port.
use std::io::{BufRead as _, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{bundles, BIN};

/// The PCI devices of the tests' node (see `Agent::spawn`).
pub const PCI_DEVICES: &[&str] = &[
    "0000:3b:00.0",
    "0000:5e:00.0",
    "0000:b1:00.0",
    "0000:00:1c.5",
    "0000:81:00.0",
];

/// A running agent with its own spool, socket and metrics port; its stderr collected.
pub struct Agent {
    pub child: Child,
    pub dir: PathBuf,
    pub spool: PathBuf,
    pub socket: PathBuf,
    pub metrics: String,
    pub lines: Arc<Mutex<Vec<String>>>,
    /// What it was started with, for `restart`.
    extra: Vec<String>,
    env: Vec<(String, String)>,
    /// The command that runs `nantrace` (this build's binary, or a wrapper and another one).
    program: Vec<String>,
}

impl Agent {
    /// Where `start(tag, ...)` puts its files (a test may need the socket path first).
    pub fn dir_for(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("nt-agent-{tag}-{}", std::process::id()))
    }

    pub fn start(tag: &str, port: u16, extra: &[&str]) -> Self {
        Self::start_env(tag, port, extra, &[])
    }

    pub fn start_env(tag: &str, port: u16, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_prepared(tag, port, extra, env, |_| {})
    }

    /// As `start_env`, with `prepare(dir)` run before the agent starts (a spool made ahead).
    pub fn start_prepared(
        tag: &str,
        port: u16,
        extra: &[&str],
        env: &[(&str, &str)],
        prepare: impl FnOnce(&Path),
    ) -> Self {
        let dir = Self::dir_for(tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare(&dir);
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_string()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        Self::spawn(dir, format!("127.0.0.1:{port}"), extra, env, vec![BIN.to_string()])
    }

    /// As `start_env`, run by `program` (e.g. another version's binary behind `unshare`);
    /// its last word is the `nantrace` binary (`ctl` is always this build's).
    pub fn start_program(
        tag: &str,
        port: u16,
        program: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let dir = Self::dir_for(tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self::spawn(
            dir,
            format!("127.0.0.1:{port}"),
            extra.iter().map(|s| (*s).to_string()).collect(),
            env.iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            program.iter().map(|s| (*s).to_string()).collect(),
        )
    }

    /// Stop it (SIGTERM, as systemd would) and start it again on the same spool and socket.
    pub fn restart(mut self) -> Self {
        self.terminate();
        let (dir, metrics, extra, env, program) = (
            self.dir.clone(),
            self.metrics.clone(),
            std::mem::take(&mut self.extra),
            std::mem::take(&mut self.env),
            std::mem::take(&mut self.program),
        );
        drop(self);
        Self::spawn(dir, metrics, extra, env, program)
    }

    /// Kill it with SIGKILL (as the OOM killer would) and start it again on the same spool.
    /// The socket it leaves is stale; the new agent replaces it.
    pub fn crash_and_restart(mut self) -> Self {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let (dir, metrics, extra, env, program) = (
            self.dir.clone(),
            self.metrics.clone(),
            std::mem::take(&mut self.extra),
            std::mem::take(&mut self.env),
            std::mem::take(&mut self.program),
        );
        drop(self);
        Self::spawn(dir, metrics, extra, env, program)
    }

    fn spawn(
        dir: PathBuf,
        metrics: String,
        extra: Vec<String>,
        env: Vec<(String, String)>,
        program: Vec<String>,
    ) -> Self {
        let (spool, socket) = (dir.join("spool"), dir.join("run/agent.sock"));
        // No GPU here: the PCI devices the tests' Xid and AER lines name stand in a
        // /sys/bus/pci/devices of their own (metric labels take only the node's devices).
        let pci = dir.join("pci-devices");
        for d in PCI_DEVICES {
            std::fs::create_dir_all(pci.join(d)).unwrap();
        }
        // A short post-window unless the test asks for its own.
        let post: &[&str] = if extra.iter().any(|a| a == "--post") {
            &[]
        } else {
            &["--post", "1.5"]
        };
        let mut child = Command::new(&program[0])
            .args(&program[1..])
            .args([
                "agent",
                "--spool",
                spool.to_str().unwrap(),
                "--socket",
                socket.to_str().unwrap(),
                "--metrics-addr",
                &metrics,
                "--pci-devices",
                pci.to_str().unwrap(),
            ])
            .args(post)
            .args(&extra)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nantrace agent");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l2 = lines.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[agent] {line}");
                l2.lock().unwrap().push(line);
            }
        });
        let a = Agent {
            child,
            dir,
            spool,
            socket,
            metrics,
            lines,
            extra,
            env,
            program,
        };
        a.wait_line("agent started", Duration::from_secs(30), |l| {
            l.contains("nantrace: agent ") && l.contains("probes attached")
        });
        a
    }

    pub fn wait_line(&self, what: &str, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Some(l) = self.lines.lock().unwrap().iter().find(|l| pred(l)) {
                return l.clone();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("agent: no line for {what} within {timeout:?}");
    }

    pub fn ctl(&self, args: &[&str]) -> Value {
        let o = Command::new(BIN)
            .args(["ctl"])
            .args(args)
            .args(["--json", "--socket", self.socket.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "ctl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("ctl {args:?}: {e}: {}", String::from_utf8_lossy(&o.stdout)))
    }

    /// Wait until `ctl jobs` lists a job whose root is `root`; returns its entry and the time.
    pub fn wait_job(&self, root: u32, timeout: Duration) -> (Value, Duration) {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            let v = self.ctl(&["jobs"]);
            if let Some(j) = v["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .find(|j| j["root"] == root)
            {
                return (j.clone(), t0.elapsed());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "job with root pid {root} not listed within {timeout:?}: {}",
            self.ctl(&["jobs"])
        );
    }

    pub fn wait_bundles(&self, n: usize, timeout: Duration) -> Vec<PathBuf> {
        let t0 = Instant::now();
        loop {
            let b = bundles(&self.spool);
            if b.len() >= n || t0.elapsed() > timeout {
                return b;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn metrics_text(&self) -> String {
        use std::io::{Read as _, Write as _};
        let mut c = std::net::TcpStream::connect(&self.metrics).expect("connect to /metrics");
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        assert!(s.starts_with("HTTP/1.1 200 OK"), "{s}");
        s
    }

    /// The metrics once `pred` holds on them (or, past `timeout`, as they are): a bundle is
    /// visible in the spool a moment before its incident is counted.
    pub fn wait_metrics(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let m = self.metrics_text();
            if pred(&m) || t0.elapsed() > timeout {
                return m;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM: the agent drains and exits 0, removing its socket.
    pub fn stop(mut self) {
        self.terminate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    fn terminate(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        let st = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(70),
                "agent did not stop within 70 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(st.success(), "agent exit status {st:?}");
        assert!(!self.socket.exists(), "socket left behind");
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A job script under `dir`, started with its output in `<name>.log` (as a batch system does).
pub fn start_job(dir: &Path, name: &str, body: &str) -> (Child, PathBuf) {
    let script = dir.join(format!("{name}.sh"));
    std::fs::write(&script, format!("#!/bin/bash\n{body}\n")).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let log = dir.join(format!("{name}.log"));
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new(&script)
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    (child, log)
}

/// Kill a job started by [`start_job`] and its children, and reap it.
pub fn kill_job(c: &mut Child) {
    let _ = super::sh(&format!("pkill -KILL -P {}", c.id()));
    let _ = c.kill();
    let _ = c.wait();
}

/// A bundle's timeline.json.
pub fn timeline(bundle: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(bundle.join("timeline.json")).unwrap()).unwrap()
}

/// No NVIDIA GPU here: a device node standing in for /dev/nvidia0 (same path shape, 0666), in
/// a directory of its own; a job holds it open the way CUDA holds the real one, and the
/// agent's `--gpu-device <dir>/nvidia` finds it through /proc/PID/fd as on a GPU node.
/// Returns (the directory, the device).
pub fn fake_gpu(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("nt-agent-{tag}-dev-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dev = dir.join("nvidia0");
    let _ = std::fs::remove_file(&dev);
    super::sh_ok(&format!("mknod {0} c 1 3 && chmod 0666 {0}", dev.display()));
    (dir, dev)
}
