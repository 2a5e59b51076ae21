//! PyTorch's Flight Recorder dumps: where each rank's dump goes (at the trigger, from the
//! rank process's environment, while it exists), and the dumps read at the end of the
//! post-window (torch writes them at its watchdog's timeout, usually after the trigger),
//! decoded (`pickle.rs`, `view.rs`), with the raw files kept for torch's own `torchfrtrace`.
//!
//! Where: the prefix is the process's `TORCH_FR_DUMP_TEMP_FILE`, else
//! `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`, else torch's defaults `$HOME/.cache/torch/
//! comm_lib_trace_rank_` (its `HOME`) and `/tmp/nccl_trace_rank_`; the file is prefix + its
//! `RANK`. Read with the job's rights (`read.rs`): no link followed, a regular file owned by
//! the job's user, at most [`DUMP_MAX`] bytes, not older than the rank process (a stale dump
//! of an earlier job in /tmp is said and ignored). Everything here is the job's own text:
//! it locates a hang, never machine evidence.
pub mod pickle;
mod read;
pub mod view;

use std::collections::BTreeSet;

use serde_json::{json, Value};

/// Rank processes looked at per node.
pub const RANKS_MAX: usize = 16;
/// The largest dump read (torch's default buffer of 2,000 entries with stack traces is
/// some 2-6 MiB).
pub const DUMP_MAX: u64 = 8 << 20;
/// The most bytes of raw dumps copied into one bundle.
pub const COPIES_MAX: usize = 48 << 20;
/// The bundle's subdirectory of raw dumps, one `fr_rank_<RANK>` per rank
/// (`torchfrtrace <bundle>/flight_recorder` reads them).
pub const COPY_DIR: &str = "flight_recorder";

/// Where a rank's dump is looked for: (path, what gave it).
fn candidates(env: &[(&str, &str)], cwd: Option<&str>, rank: u32) -> Vec<(String, &'static str)> {
    let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
    let abs = |p: &str| -> Option<String> {
        if p.is_empty() || p.len() > 1024 || p.contains('\0') {
            None
        } else if p.starts_with('/') {
            Some(p.to_string())
        } else {
            cwd.map(|c| format!("{}/{p}", c.trim_end_matches('/')))
        }
    };
    for k in ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] {
        if let Some(p) = get(k).filter(|v| !v.is_empty()) {
            return abs(p)
                .map(|p| vec![(format!("{p}{rank}"), k)])
                .unwrap_or_default();
        }
    }
    let mut out = Vec::new();
    if let Some(h) = get("HOME").and_then(abs) {
        out.push((
            format!(
                "{}/.cache/torch/comm_lib_trace_rank_{rank}",
                h.trim_end_matches('/')
            ),
            "default ($HOME/.cache/torch/comm_lib_trace_rank_)",
        ));
    }
    out.push((
        format!("/tmp/nccl_trace_rank_{rank}"),
        "default (/tmp/nccl_trace_rank_)",
    ));
    out
}

/// The environment's `KEY=value` pairs that say where a dump goes.
fn env_pairs(environ: &[u8]) -> Vec<(&str, &str)> {
    const KEYS: [&str; 3] = [
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "HOME",
    ];
    environ
        .split(|&b| b == 0)
        .take(10_000)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('='))
        .filter(|(k, _)| KEYS.contains(k))
        .collect()
}

/// A process's fs uid and gid (/proc/PID/status `Uid:`/`Gid:`, the fourth field).
fn ids(status: &str) -> Option<(u32, u32)> {
    // Real, effective, saved and filesystem ids: all four alike, or none (a setuid helper the
    // job started, stopped with the user's environment, has fsuid 0: never read as it).
    let field = |k: &str| -> Option<u32> {
        let v: Vec<u32> = status
            .lines()
            .find_map(|l| l.strip_prefix(k))?
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        (v.len() == 4 && v.iter().all(|x| *x == v[0])).then_some(v[0])
    };
    Some((field("Uid:")?, field("Gid:")?))
}

/// When the process started, in seconds since the epoch (boot time + its start ticks).
fn started_s(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks: u64 = stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()?;
    let btime: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no failure mode that matters here (a non-positive answer is refused).
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|h| *h > 0)?;
    Some(btime + ticks / hz)
}

/// snapshot.json `flight_recorder` at the trigger: for each rank's main process (the lowest
/// pid with that RANK), where its dump will be looked for at the dump.
pub fn sources(job: &BTreeSet<u32>) -> Value {
    // An environ read takes the process's memory-map lock and can block for good behind a
    // thread stuck in the kernel (collect/stacks.rs): on a thread of its own, with a deadline.
    let pids: Vec<u32> = job.iter().copied().take(4096).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("nantrace-fr-env".into())
        .spawn(move || {
            let _ = tx.send(sources_now(&pids));
        });
    if spawned.is_err() {
        return json!({ "not_collected": "no thread to read the ranks' environments" });
    }
    rx.recv_timeout(SOURCES_DEADLINE).unwrap_or_else(|_| {
        json!({ "not_collected": format!("reading the ranks' environments took over {} s (a process blocked in the kernel)", SOURCES_DEADLINE.as_secs()) })
    })
}

/// How long [`sources`] may take.
const SOURCES_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

fn sources_now(job: &[u32]) -> Value {
    let mut by_rank: std::collections::BTreeMap<u32, (u32, Vec<(String, String)>)> =
        Default::default();
    for &pid in job {
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let Some(r) = super::ranks::from_environ(&environ) else {
            continue;
        };
        if by_rank.len() >= RANKS_MAX && !by_rank.contains_key(&r.rank) {
            continue;
        }
        // Only the variables the dump's path comes from are kept (a job's environment can be
        // megabytes).
        by_rank.entry(r.rank).or_insert_with(|| {
            let kept = env_pairs(&environ)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (pid, kept)
        });
    }
    if by_rank.is_empty() {
        return json!({ "not_collected": "no process of the job has a launcher's RANK" });
    }
    let n = by_rank.len();
    let list: Vec<Value> = by_rank
        .into_iter()
        .take(RANKS_MAX)
        .map(|(rank, (pid, environ))| {
            let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
                .ok()
                .map(|p| p.to_string_lossy().into_owned());
            let env: Vec<(&str, &str)> =
                environ.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let paths = candidates(&env, cwd.as_deref(), rank);
            let (uid, gid) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .as_deref()
                .and_then(ids)
                .unzip();
            json!({
                "rank": rank, "pid": pid, "uid": uid, "gid": gid, "started_s": started_s(pid),
                "paths": paths.iter().map(|(p, from)| path_entry(p, from)).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut out = json!({ "sources": list });
    if n > RANKS_MAX {
        out["ranks_not_taken"] = json!(n - RANKS_MAX);
    }
    out
}

/// A candidate path in the trigger's record: `path` as shown (cleaned and cut: the job's
/// text), `open` the path itself where that differs (a long path, a control character), so
/// the file looked for is the one the rank writes.
fn path_entry(p: &str, from: &str) -> Value {
    let shown = view::text(p);
    let mut e = json!({ "path": shown, "from": from });
    if shown != p {
        e["open"] = json!(p);
    }
    e
}

/// A rank's dump as read at the dump: its record in flight_recorder.json and the raw bytes.
fn one(src: &Value, copied: &mut usize) -> (Value, Option<(String, Vec<u8>)>) {
    let rank = src["rank"].as_u64().unwrap_or(0);
    let mut rec = json!({ "rank": rank, "pid": src["pid"] });
    let owner = src["uid"]
        .as_u64()
        .and_then(|u| u32::try_from(u).ok())
        .zip(src["gid"].as_u64().and_then(|g| u32::try_from(g).ok()));
    let mut tried = Vec::new();
    let mut got = None;
    let mut stale = None;
    let started = src["started_s"].as_u64();
    for p in src["paths"].as_array().into_iter().flatten() {
        let (Some(shown), from) = (p["path"].as_str(), &p["from"]) else {
            continue;
        };
        let path = p["open"].as_str().unwrap_or(shown);
        match read::dump(std::path::Path::new(path), owner, DUMP_MAX) {
            Err(read::Why::NoFile) => tried.push(shown.to_string()),
            // An earlier job's dump at this candidate: the next one may hold this job's.
            Ok((_, mtime_s)) if started.is_some_and(|s| mtime_s + 1 < s) => {
                let s = started.unwrap_or(0);
                stale.get_or_insert(format!(
                    "{shown} written {} s before rank {rank}'s process started: an earlier job's dump, ignored",
                    s - mtime_s
                ));
            }
            r => {
                rec["path"] = json!(shown);
                rec["path_from"] = from.clone();
                got = Some(r);
                break;
            }
        }
    }
    let Some(r) = got else {
        if let Some(why) = stale {
            rec["status"] = json!("stale");
            rec["why"] = json!(why);
        } else {
            rec["status"] = json!("no_file");
            rec["why"] = json!(format!("no file at {}", tried.join(" or ")));
        }
        return (rec, None);
    };
    let (bytes, mtime_s) = match r {
        Ok(x) => x,
        Err(w) => {
            rec["status"] = json!(w.status());
            rec["why"] = json!(w.to_string());
            return (rec, None);
        }
    };
    rec["bytes"] = json!(bytes.len());
    rec["mtime_s"] = json!(mtime_s);
    if let Some(why) = stale {
        rec["earlier_candidate"] = json!(why);
    }
    match pickle::decode(&bytes).map(|p| view::of(&p)) {
        Ok(Some(d)) => {
            rec["status"] = json!("read");
            rec["dump"] = json!(d);
        }
        Ok(None) => {
            rec["status"] = json!("undecodable");
            rec["why"] = json!("a pickle, but not a Flight Recorder dump (no entries or version)");
        }
        Err(e) => {
            rec["status"] = json!("undecodable");
            rec["why"] = json!(e.to_string());
        }
    }
    let name = format!("fr_rank_{rank}");
    if *copied + bytes.len() > COPIES_MAX {
        rec["copy_not_kept"] = json!(format!(
            "the bundle's {} MiB of raw dumps were used",
            COPIES_MAX >> 20
        ));
        return (rec, None);
    }
    *copied += bytes.len();
    rec["copy"] = json!(format!("{COPY_DIR}/{name}"));
    (rec, Some((name, bytes)))
}

/// The dumps read at the end of the post-window from the trigger's `sources`: the value of
/// flight_recorder.json and the raw copies (file name, bytes) for the bundle's
/// [`COPY_DIR`]. `None` when the trigger's snapshot said where to look at nothing.
pub fn read(section: &Value) -> Option<(Value, Vec<(String, Vec<u8>)>)> {
    let sources = section["sources"].as_array()?;
    let mut copied = 0;
    let mut ranks = Vec::new();
    let mut copies = Vec::new();
    for s in sources.iter().take(RANKS_MAX) {
        let (rec, copy) = one(s, &mut copied);
        ranks.push(rec);
        copies.extend(copy);
    }
    let count = |st: &str| ranks.iter().filter(|r| r["status"] == st).count();
    let mut v = json!({
        "schema": SCHEMA,
        "read_at": crate::clock::rfc3339(crate::clock::realtime_ns()),
        "ranks_read": count("read"),
        "ranks": ranks,
    });
    if let Some(n) = section.get("ranks_not_taken") {
        v["ranks_not_taken"] = n.clone();
    }
    Some((v, copies))
}

/// flight_recorder.json's schema.
pub const SCHEMA: &str = "nantrace.flight_recorder/1";

#[cfg(test)]
mod tests;
