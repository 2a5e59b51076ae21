//! The node agent's costs: idle CPU and RSS with 0, 1 and 4 watched jobs, job start to
//! listed, `ctl dump` to bundle.
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{cpu_ticks, json_line, stats, wait_for_line};

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `nantrace agent`: idle CPU and RSS with 0, 1 and 4 watched jobs, job start to "watched",
/// trigger (`ctl dump`, post-window 0) to bundle on disk.
pub(super) fn agent(bin: &Path, secs: f64, tmp: &Path) -> Result<serde_json::Value> {
    let dir = tmp.join("agent");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("run/agent.sock");
    let spool = dir.join("spool");
    let mut a = Command::new(bin)
        .args([
            "agent",
            "--spool",
            spool.to_str().unwrap(),
            "--socket",
            sock.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:19499",
            "--match",
            "nt-benchjob-",
            "--post",
            "0",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let ctl = Ctl { bin, sock: &sock };
    let result = measure_agent(&mut a, &ctl, &dir, &spool, secs);
    // SAFETY: signalling our own child.
    unsafe { libc_kill(a.id() as i32, 15) };
    let _ = a.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The measurements, the agent `a` running: idle, then with 1 and 4 jobs, then a dump.
fn measure_agent(
    a: &mut Child,
    ctl: &Ctl,
    dir: &Path,
    spool: &Path,
    secs: f64,
) -> Result<serde_json::Value> {
    wait_for_line(a, "probes attached", Duration::from_secs(30))?;
    let mut out = serde_json::Map::new();
    std::thread::sleep(Duration::from_secs(1));
    let (cpu0, rss0) = measure(a.id(), secs);
    out.insert(
        "jobs0".into(),
        serde_json::json!({ "cpu_s_per_s": cpu0, "rss_kib": rss0 }),
    );
    let mut jobs: Vec<Child> = Vec::new();
    let mut to_watched = Vec::new();
    for n in [1usize, 4] {
        while jobs.len() < n {
            let (c, t) = start_job(dir, jobs.len())?;
            let pid = c.id();
            jobs.push(c);
            to_watched.push(ctl.wait_listed(pid, t)?);
        }
        std::thread::sleep(Duration::from_secs(1));
        let (cpu, rss) = measure(a.id(), secs);
        out.insert(
            format!("jobs{n}"),
            serde_json::json!({ "cpu_s_per_s": cpu, "rss_kib": rss }),
        );
    }
    // Trigger to bundle: `ctl dump` of one job, post-window 0.
    let dump_s = ctl.dump_to_bundle(spool)?;
    for mut j in jobs {
        let _ = j.kill();
        let _ = j.wait();
    }
    out.insert("start_to_watched_s".into(), stats(&mut to_watched));
    out.insert("trigger_to_bundle_s".into(), serde_json::json!(dump_s));
    out.insert("measured_s".into(), serde_json::json!(secs));
    Ok(serde_json::Value::Object(out))
}

/// CPU seconds per second and RSS of `pid` over `secs`.
fn measure(pid: u32, secs: f64) -> (f64, Option<u64>) {
    let c0 = cpu_ticks(pid).unwrap_or(0);
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let c1 = cpu_ticks(pid).unwrap_or(c0);
    (
        (c1 - c0) as f64 / 100.0 / t.elapsed().as_secs_f64(),
        rss_kib(pid),
    )
}

/// Job `i`: a script named for the agent's `--match` that prints a line every 0.5 s to its
/// log file. Returned with the time it was started.
fn start_job(dir: &Path, i: usize) -> Result<(Child, Instant)> {
    let script = dir.join(format!("nt-benchjob-{i}.sh"));
    std::fs::write(
        &script,
        format!("#!/bin/sh\nwhile :; do echo \"job {i} loss 0.5\"; sleep 0.5; done\n"),
    )?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let log = std::fs::File::create(dir.join(format!("nt-benchjob-{i}.log")))?;
    let t = Instant::now();
    let c = Command::new(&script)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    Ok((c, t))
}

/// `nantrace ctl` on the agent's socket.
struct Ctl<'a> {
    bin: &'a Path,
    sock: &'a Path,
}

impl Ctl<'_> {
    fn call(&self, args: &[&str]) -> Result<serde_json::Value> {
        let o = Command::new(self.bin)
            .arg("ctl")
            .args(args)
            .args(["--json", "--socket", self.sock.to_str().unwrap()])
            .output()?;
        if !o.status.success() {
            bail!("ctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
        json_line(&o.stdout)
    }

    /// Seconds from `t` until `ctl jobs` lists the job of root `pid` (at most 20 s).
    fn wait_listed(&self, pid: u32, t: Instant) -> Result<f64> {
        loop {
            if self.call(&["jobs"])?["jobs"]
                .as_array()
                .is_some_and(|j| j.iter().any(|j| j["root"] == pid))
            {
                return Ok(t.elapsed().as_secs_f64());
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!("job {pid} not watched within 20 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Seconds from `ctl dump` of the first job listed to its bundle in `spool` (at most 60 s).
    fn dump_to_bundle(&self, spool: &Path) -> Result<f64> {
        let key = self.call(&["jobs"])?["jobs"][0]["key"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let t = Instant::now();
        self.call(&["dump", "--job", &key])?;
        loop {
            let done = std::fs::read_dir(spool)?
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("nantrace-"));
            if done {
                return Ok(t.elapsed().as_secs_f64());
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!("no bundle 60 s after ctl dump");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
