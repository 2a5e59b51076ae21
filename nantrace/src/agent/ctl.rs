//! The control socket: a Unix socket (0600, in a 0700 directory) answering one JSON request
//! per connection, from root only (SO_PEERCRED); and `nantrace ctl`, its client.
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, oneshot};

use super::Job;
use crate::clock::monotonic_ns;
use crate::session::Input;
use crate::trigger::TriggerKind;

/// A request and where its answer goes.
pub type Request = (Value, oneshot::Sender<Value>);

/// Bind the socket: its directory is created 0700 (or must be root's and not writable by
/// others); a stale socket is replaced, anything else at the path is an error (never
/// followed, never removed).
pub fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _};
    anyhow::ensure!(
        path.is_absolute(),
        "socket {}: give an absolute path",
        path.display()
    );
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("/"));
    // SAFETY: geteuid has no failure mode.
    let me = unsafe { libc::geteuid() };
    if !dir.exists() {
        // Only what exists is trusted, then each missing level is made by us (as the spool).
        let existing = dir
            .ancestors()
            .find(|a| std::fs::symlink_metadata(a).is_ok())
            .unwrap_or(Path::new("/"));
        super::spool::check_ancestors(existing, me, "socket")?;
        let em = std::fs::symlink_metadata(existing)?;
        anyhow::ensure!(em.is_dir() && (em.uid() == 0 || em.uid() == me) && (em.mode() & 0o022 == 0 || em.mode() & 0o1000 != 0), "socket {}: {} belongs to uid {} (mode {:o}): its directory would be made where another user could swap it for a link", path.display(), existing.display(), em.uid(), em.mode() & 0o7777);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    // No one but root can swap a directory on the way for a link (redteam3 D-11).
    super::spool::check_ancestors(dir, me, "socket")?;
    let dm = std::fs::symlink_metadata(dir).with_context(|| format!("{}", dir.display()))?;
    anyhow::ensure!(
        dm.is_dir(),
        "socket directory {} is not a directory (a link?)",
        dir.display()
    );
    anyhow::ensure!(
        dm.uid() == me && dm.mode() & 0o022 == 0,
        "socket directory {} must belong to uid {me} and not be writable by others",
        dir.display()
    );
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            // A live agent answers: never take its socket away (review 11).
            anyhow::ensure!(
                std::os::unix::net::UnixStream::connect(path).is_err(),
                "another agent is running on {} (its socket answers)",
                path.display()
            );
            std::fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        Ok(_) => anyhow::bail!(
            "{} exists and is not a socket: not touching it",
            path.display()
        ),
        Err(_) => {}
    }
    // The socket is created with no permission for others from the start (umask), then 0600.
    // SAFETY: umask only changes this process's file-creation mask.
    let old = unsafe { libc::umask(0o177) };
    let l = tokio::net::UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let l = l.with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Accept connections; each request (one line of JSON, at most 64 KiB, within 5 s) goes to
/// `tx`; the answer is written back as one line.
pub fn serve(listener: tokio::net::UnixListener, tx: mpsc::Sender<Request>) {
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                // SAFETY: geteuid has no failure mode.
                let me = unsafe { libc::geteuid() };
                let allowed = conn
                    .peer_cred()
                    .is_ok_and(|c| c.uid() == 0 || c.uid() == me);
                let (r, mut w) = conn.into_split();
                if !allowed {
                    let _ = w
                        .write_all(
                            b"{\"error\":\"permission denied: the agent's socket is for root\"}\n",
                        )
                        .await;
                    return;
                }
                let mut line = String::new();
                let mut r = tokio::io::BufReader::new(tokio::io::AsyncReadExt::take(r, 64 * 1024));
                let ok = tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut line))
                    .await
                    .is_ok_and(|x| x.is_ok());
                let answer = match (ok, serde_json::from_str::<Value>(&line)) {
                    (true, Ok(req)) => {
                        let (otx, orx) = oneshot::channel();
                        if tx.send((req, otx)).await.is_err() {
                            json!({ "error": "the agent is stopping" })
                        } else {
                            tokio::time::timeout(Duration::from_secs(30), orx)
                                .await
                                .ok()
                                .and_then(Result::ok)
                                .unwrap_or_else(|| json!({ "error": "no answer from the agent" }))
                        }
                    }
                    _ => json!({ "error": "bad request: one line of JSON expected" }),
                };
                let mut out = answer.to_string();
                out.push('\n');
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), w.write_all(out.as_bytes())).await;
            });
        }
    });
}

/// Send one request to the agent and return its answer.
pub fn request(socket: &Path, req: &Value) -> anyhow::Result<Value> {
    use std::io::{BufRead as _, Write as _};
    let mut s = std::os::unix::net::UnixStream::connect(socket).with_context(|| {
        format!(
            "connecting to the agent at {} (is `nantrace agent` running? root needed)",
            socket.display()
        )
    })?;
    // The server must be the agent (root, or ourselves): a user's socket at that path gets
    // no request and its answer is never printed (redteam3 D-11).
    let uid = peer_uid(&s).with_context(|| format!("{}: who is answering", socket.display()))?;
    // SAFETY: geteuid has no failure mode.
    let me = unsafe { libc::geteuid() };
    anyhow::ensure!(
        uid == 0 || uid == me,
        "{} is served by uid {uid}, not by root: not the agent, nothing sent",
        socket.display()
    );
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.write_all(format!("{req}\n").as_bytes())?;
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line)?;
    let v: Value = serde_json::from_str(&line).context("the agent's answer is not JSON")?;
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        anyhow::bail!("agent: {e}");
    }
    Ok(v)
}

/// The uid of the process at the other end of a Unix socket (SO_PEERCRED).
fn peer_uid(s: &std::os::unix::net::UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a zeroed ucred is a valid out-parameter.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket, a buffer of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut c).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(c.uid)
}

/// `nantrace ctl CMD`: send `req`, print the answer (JSON as it is with `json`).
pub fn cli(cmd: &str, mut req: Value, socket: &Path, json: bool) -> anyhow::Result<()> {
    if cmd == "slurm-prolog" || cmd == "slurm-epilog" {
        // From Slurm's prolog/epilog environment. Never fail the job's allocation: an
        // unreachable agent is a message, exit 0.
        req["job_id"] = std::env::var("SLURM_JOB_ID").unwrap_or_default().into();
        match request(socket, &req) {
            Ok(v) => crate::say!("nantrace: {cmd}: {v}"),
            Err(e) => crate::say!("nantrace: {cmd}: {e:#}"),
        }
        return Ok(());
    }
    let v = request(socket, &req)?;
    if json {
        crate::sayout!("{v}");
    } else {
        print(cmd, &v);
    }
    Ok(())
}

/// `nantrace ctl`: print an answer for a person (untrusted text made inert).
pub fn print(cmd: &str, v: &Value) {
    let clean = |s: &str| crate::term::clean(s);
    match cmd {
        "jobs" => {
            let jobs = v["jobs"].as_array().cloned().unwrap_or_default();
            if jobs.is_empty() {
                crate::sayout!("no job watched");
            }
            for j in jobs {
                crate::sayout!(
                    "{:<24} root {:<8} pids {:<4} gpus {:<10} {:>6.0} s  incidents {}  {}  logs: {}",
                    clean(j["key"].as_str().unwrap_or("")),
                    j["root"],
                    j["pids"],
                    clean(&j["gpus"].to_string()),
                    j["watched_s"].as_f64().unwrap_or(0.0),
                    j["incidents"],
                    clean(&j["identity"].to_string()),
                    clean(&j["logs"].to_string())
                );
            }
        }
        "incidents" => {
            let inc = v["incidents"].as_array().cloned().unwrap_or_default();
            if inc.is_empty() {
                crate::sayout!("no incident");
            }
            for i in inc {
                crate::sayout!(
                    "{}  {:<22} {:<10} {}  {}",
                    clean(i["time"].as_str().unwrap_or("")),
                    clean(i["job"].as_str().unwrap_or("")),
                    clean(i["trigger"].as_str().unwrap_or("")),
                    clean(i["verdict"].as_str().unwrap_or("")),
                    clean(i["bundle"].as_str().unwrap_or(""))
                );
            }
        }
        "report" => crate::sayout!(
            "{}",
            crate::term::clean_lines(v["report"].as_str().unwrap_or(""))
        ),
        "history" => {
            let inc = v["incidents"].as_array().cloned().unwrap_or_default();
            if inc.is_empty() {
                crate::sayout!(
                    "no incident in the last {:.0} days ({} in the index)",
                    v["since_s"].as_f64().unwrap_or(0.0) / 86_400.0,
                    v["index_entries"]
                );
            }
            for i in inc {
                let gpus: Vec<String> = i["gpus"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|g| {
                        clean(&format!(
                            "{}{}",
                            g["pci"].as_str().unwrap_or("?"),
                            g["uuid"]
                                .as_str()
                                .map_or(String::new(), |u| format!(" ({u})"))
                        ))
                    })
                    .collect();
                crate::sayout!(
                    "{}  {:<22} {:<10} {:<48} {}  {}",
                    crate::clock::rfc3339(
                        i128::from(i["time_s"].as_i64().unwrap_or(0)) * 1_000_000_000
                    ),
                    clean(i["job"].as_str().unwrap_or("")),
                    clean(i["trigger"].as_str().unwrap_or("")),
                    clean(i["verdict"].as_str().unwrap_or("")),
                    if gpus.is_empty() {
                        "-".to_string()
                    } else {
                        gpus.join(", ")
                    },
                    clean(i["bundle"].as_str().unwrap_or(""))
                );
            }
            if v["bad_lines"].as_u64().is_some_and(|n| n > 0) {
                crate::sayout!("({} damaged line(s) of the index skipped)", v["bad_lines"]);
            }
        }
        _ => crate::sayout!("{}", serde_json::to_string_pretty(v).unwrap_or_default()),
    }
}

/// The newest bundle's report, from the spool (for `report --last`).
pub fn last_report(incidents: &[Value], spool: &Path) -> Value {
    let dir: Option<PathBuf> = incidents
        .iter()
        .rev()
        .find_map(|i| i["bundle"].as_str().map(PathBuf::from))
        .or_else(|| super::spool::bundles(spool).pop().map(|b| b.0));
    let Some(dir) = dir else {
        return json!({ "error": "no incident yet" });
    };
    let mut text = std::fs::read_to_string(dir.join("report.md"))
        .unwrap_or_else(|e| format!("(report.md unreadable: {e})"));
    if text.len() > 1 << 20 {
        let mut end = 1 << 20;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    json!({ "bundle": dir.display().to_string(), "report": text })
}

impl super::Agent {
    /// One request on the socket, answered from the agent's state.
    pub(super) fn answer(
        &self,
        req: &Value,
        scan_now: &std::sync::mpsc::Sender<()>,
        disc: &std::sync::mpsc::Sender<super::scanner::DiscMsg>,
    ) -> Value {
        let cmd = req["cmd"].as_str().unwrap_or("");
        let st = super::lock(&self.state);
        match cmd {
            "status" => {
                let node = super::lock(&self.node).stats();
                json!({
                    "version": env!("CARGO_PKG_VERSION"),
                    "host": self.host,
                    "uptime_s": (monotonic_ns() - self.started) as f64 / 1e9,
                    "probes_attached": self.kernel.attached(),
                    "probes_not_attached": self.kernel.probes_not_attached(),
                    "probes_error": self.kernel.error,
                    "ringbuf_drops": self.kernel.drops(),
                    "jobs": st.jobs.len(),
                    "jobs_not_watched": st.not_watched,
                    "incidents": st.incidents.len(),
                    "spool": { "dir": self.cfg.spool_dir, "usage": super::spool::usage(&self.cfg.spool_dir), "max_mb": self.cfg.spool_max_mb },
                    "node_recorder": node,
                    "metrics": self.cfg.metrics_addr,
                })
            }
            "jobs" => json!({ "jobs": st.jobs.iter().map(|(k, j)| json!({
                "key": k,
                "root": j.found.root,
                "pids": st.pid_job.values().filter(|v| *v == k).count(),
                "gpus": j.found.gpus,
                "found_by": j.found.reason,
                "identity": j.found.identity(),
                "command": crate::collect::redact::text(&j.found.command),
                "logs": j.logs,
                "watched_s": (monotonic_ns() - j.since_ns) as f64 / 1e9,
                "incidents": j.incidents,
            })).collect::<Vec<_>>() }),
            "incidents" => json!({ "incidents": st.incidents }),
            "dump" => {
                if !req["job"].is_null() && !req["job"].is_string() {
                    return json!({ "error": "job must be a string (a job key, a Slurm job id or a root pid)" });
                }
                let want = req["job"].as_str().unwrap_or("");
                // An epilog's unset variable (`--job "$SLURM_JOB_ID"`) must not dump the whole
                // node (redteam3 D-10): every job is asked for by leaving `job` out.
                if req["job"].is_string() && want.trim().is_empty() {
                    return json!({ "error": "job is empty (an unset variable?): give a job key, a Slurm job id or a root pid, or leave --job out to dump every watched job" });
                }
                let matching: Vec<(&String, &Job)> = st
                    .jobs
                    .iter()
                    .filter(|(k, j)| {
                        want.is_empty()
                            || *k == want
                            || j.found.slurm.as_ref().is_some_and(|s| s.job_id == want)
                            || j.found.root.to_string() == want
                    })
                    .collect();
                if matching.is_empty() {
                    return json!({ "error": format!("no watched job {want:?} (see `nantrace ctl jobs`)") });
                }
                for (_, j) in &matching {
                    let _ = j.tx.try_send(Input::Fire(
                        TriggerKind::Ctl,
                        "nantrace ctl dump".into(),
                        monotonic_ns(),
                    ));
                }
                json!({ "dumping": matching.iter().map(|m| m.0).collect::<Vec<_>>(), "post_s": self.cfg.post_s, "note": "the bundle is written after the post-window; `nantrace ctl incidents` lists it" })
            }
            "report" => last_report(
                &st.incidents.iter().cloned().collect::<Vec<_>>(),
                &self.cfg.spool_dir,
            ),
            "history" => {
                let since = match req["since"].as_str() {
                    None => 30 * 86_400,
                    Some(s) => match super::history::parse_since(s) {
                        Some(v) => v,
                        None => {
                            return json!({ "error": format!("since {s:?}: a number of days, hours, minutes or seconds (30d, 12h, 90m, 3600)") })
                        }
                    },
                };
                let now_s = (crate::clock::realtime_ns() / 1_000_000_000) as i64;
                let mut v = super::lock(&self.history).answer(req["gpu"].as_str(), now_s - since);
                v["since_s"] = since.into();
                v
            }
            "slurm-prolog" | "slurm-epilog" | "scan" => {
                let id = req["job_id"].as_str().unwrap_or("");
                if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
                    let _ = disc.send(if cmd == "slurm-prolog" {
                        super::scanner::DiscMsg::WantSlurm(id.to_string())
                    } else {
                        super::scanner::DiscMsg::ForgetSlurm(id.to_string())
                    });
                }
                let _ = scan_now.send(());
                let key = format!("slurm-{id}");
                crate::say!("nantrace: {cmd} for Slurm job {}", crate::term::clean(id));
                json!({ "ok": true, "job": key, "watched": st.jobs.contains_key(&key), "incidents": st.incidents.iter().filter(|i| i["job"] == key).count() })
            }
            _ => {
                json!({ "error": format!("unknown command {cmd:?}: status, jobs, incidents, history, dump, report, slurm-prolog, slurm-epilog") })
            }
        }
    }
}
