//! A Flight Recorder dump (`pickle::Py`) read into a typed view: the keys torch writes
//! (`torch/csrc/distributed/c10d/FlightRecorderDetail.hpp`, version 2.x), unknown keys
//! ignored, every string cleaned and cut (the job's own text), every list bounded. The last
//! [`ENTRIES_PER_GROUP`] entries of each process group are kept, the rest counted.
use serde::{Deserialize, Serialize};

use super::pickle::Py;

/// Entries kept per process group (the newest).
pub const ENTRIES_PER_GROUP: usize = 64;
/// Process groups kept per dump.
const GROUPS_MAX: usize = 64;
/// Frames kept per entry (the innermost first, as torch lists them).
const FRAMES_MAX: usize = 8;
const TEXT_MAX: usize = 160;
const TENSORS_MAX: usize = 16;
const DIMS_MAX: usize = 8;
const RANKS_MAX: usize = 4096;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    pub version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub comm_lib_version: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pg_config: Vec<PgConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pg_status: Vec<PgStatus>,
    /// Entries in the dump, and those of them not kept (older than the newest
    /// [`ENTRIES_PER_GROUP`] of their group, or of groups past the 64th).
    pub entries_total: usize,
    pub entries_not_kept: usize,
    pub entries: Vec<Entry>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PgConfig {
    /// The group's key in `pg_config` (torch's group name).
    pub key: String,
    pub name: String,
    pub desc: String,
    /// Its ranks, when `ranks` reads as a list of numbers (`"[0, 1, 2]"`).
    pub ranks: Vec<u32>,
}

/// `pg_status`: the group's counters when the dump was written.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PgStatus {
    pub pg: String,
    pub last_enqueued: Option<i64>,
    pub last_started: Option<i64>,
    pub last_completed: Option<i64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub record_id: Option<i64>,
    pub pg_id: Option<i64>,
    /// `process_group`: (name, desc).
    pub pg_name: String,
    pub pg_desc: String,
    pub collective_seq_id: Option<i64>,
    pub p2p_seq_id: Option<i64>,
    pub op_id: Option<i64>,
    /// `nccl:all_reduce`, `gloo:broadcast`...
    pub profiling_name: String,
    pub time_created_ns: Option<i64>,
    pub time_discovered_started_ns: Option<i64>,
    pub time_discovered_completed_ns: Option<i64>,
    pub input_sizes: Vec<Vec<i64>>,
    pub input_dtypes: Vec<String>,
    pub output_sizes: Vec<Vec<i64>>,
    pub output_dtypes: Vec<String>,
    /// `scheduled`, `started` or `completed`.
    pub state: String,
    pub retired: Option<bool>,
    pub timeout_ms: Option<i64>,
    pub is_p2p: Option<bool>,
    /// `name (file:line)`, at most [`FRAMES_MAX`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frames: Vec<String>,
}

/// Untrusted text: one line, control characters escaped, cut.
pub fn text(s: &str) -> String {
    let c = crate::term::clean(s.trim());
    if c.chars().count() <= TEXT_MAX {
        return c;
    }
    let mut out: String = c.chars().take(TEXT_MAX).collect();
    out.push('…');
    out
}

fn s(p: Option<&Py>) -> String {
    match p {
        Some(Py::Str(x)) => text(x),
        Some(Py::Int(i)) => i.to_string(),
        _ => String::new(),
    }
}

/// A name the reports print in their verdicts (an operation, a state, a dtype, a group's
/// name): the job's own text, so only the characters such names use, cut to 64 (review
/// finding: a job could write a verdict's words through its dump).
fn token(p: Option<&Py>) -> String {
    let t = match p {
        Some(Py::Str(x)) => x.as_str(),
        Some(Py::Int(i)) => return i.to_string(),
        _ => return String::new(),
    };
    t.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | ':' | '.' | '-'))
        .take(64)
        .collect()
}

fn int(p: Option<&Py>) -> Option<i64> {
    p.and_then(Py::as_i64)
}

fn sizes(p: Option<&Py>) -> Vec<Vec<i64>> {
    p.map(Py::items)
        .unwrap_or_default()
        .iter()
        .take(TENSORS_MAX)
        .map(|t| {
            t.items()
                .iter()
                .take(DIMS_MAX)
                .filter_map(Py::as_i64)
                .collect()
        })
        .collect()
}

fn strings(p: Option<&Py>) -> Vec<String> {
    p.map(Py::items)
        .unwrap_or_default()
        .iter()
        .take(TENSORS_MAX)
        .map(|x| token(Some(x)))
        .collect()
}

fn entry(e: &Py) -> Entry {
    let pg = e.get("process_group").map(Py::items).unwrap_or_default();
    let frames = e
        .get("frames")
        .map(Py::items)
        .unwrap_or_default()
        .iter()
        .take(FRAMES_MAX)
        .map(|f| {
            format!(
                "{} ({}:{})",
                s(f.get("name")),
                s(f.get("filename")),
                int(f.get("line")).unwrap_or(0)
            )
        })
        .map(|f| text(&f))
        .collect();
    Entry {
        record_id: int(e.get("record_id")),
        pg_id: int(e.get("pg_id")),
        pg_name: token(pg.first()),
        pg_desc: s(pg.get(1)),
        collective_seq_id: int(e.get("collective_seq_id")),
        p2p_seq_id: int(e.get("p2p_seq_id")),
        op_id: int(e.get("op_id")),
        profiling_name: token(e.get("profiling_name")),
        time_created_ns: int(e.get("time_created_ns")),
        time_discovered_started_ns: int(e.get("time_discovered_started_ns")),
        time_discovered_completed_ns: int(e.get("time_discovered_completed_ns")),
        input_sizes: sizes(e.get("input_sizes")),
        input_dtypes: strings(e.get("input_dtypes")),
        output_sizes: sizes(e.get("output_sizes")),
        output_dtypes: strings(e.get("output_dtypes")),
        state: token(e.get("state")),
        retired: e.get("retired").and_then(Py::as_bool),
        timeout_ms: int(e.get("timeout_ms")),
        is_p2p: e.get("is_p2p").and_then(Py::as_bool),
        frames,
    }
}

/// `"[0, 1, 2]"` (or a list) as ranks.
fn ranks(p: Option<&Py>) -> Vec<u32> {
    match p {
        Some(Py::Str(x)) => x
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter_map(|r| r.trim().parse().ok())
            .take(RANKS_MAX)
            .collect(),
        Some(l) => l
            .items()
            .iter()
            .filter_map(|r| r.as_i64().and_then(|r| u32::try_from(r).ok()))
            .take(RANKS_MAX)
            .collect(),
        None => Vec::new(),
    }
}

fn dict(p: Option<&Py>) -> &[(Py, Py)] {
    match p {
        Some(Py::Dict(kv)) => kv,
        _ => &[],
    }
}

/// The typed view of a decoded dump; `None` when it is not a Flight Recorder dump (no
/// `entries` list, no `version`).
pub fn of(d: &Py) -> Option<Dump> {
    let entries = match d.get("entries") {
        Some(Py::List(v)) => v,
        _ => return None,
    };
    let version = s(Some(d.get("version")?));
    let pg_config = dict(d.get("pg_config"))
        .iter()
        .take(GROUPS_MAX)
        .map(|(k, v)| PgConfig {
            key: s(Some(k)),
            name: s(v.get("name")),
            desc: s(v.get("desc")),
            ranks: ranks(v.get("ranks")),
        })
        .collect();
    let pg_status = dict(d.get("pg_status"))
        .iter()
        .take(GROUPS_MAX)
        .map(|(k, v)| PgStatus {
            pg: s(Some(k)),
            last_enqueued: int(v.get("last_enqueued_collective")),
            last_started: int(v.get("last_started_collective")),
            last_completed: int(v.get("last_completed_collective")),
        })
        .collect();
    // The newest entries of each group: walked from the end, counted per group.
    let mut per: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut kept: Vec<Entry> = Vec::new();
    for e in entries.iter().rev() {
        let pg = s(e.get("process_group").and_then(|g| g.items().first()));
        let n = per.len();
        let c = match per.get_mut(&pg) {
            Some(c) => c,
            None if n < GROUPS_MAX => per.entry(pg).or_insert(0),
            None => continue,
        };
        if *c < ENTRIES_PER_GROUP {
            *c += 1;
            kept.push(entry(e));
        }
    }
    kept.reverse();
    Some(Dump {
        version,
        comm_lib_version: s(d.get("comm_lib_version")),
        pg_config,
        pg_status,
        entries_total: entries.len(),
        entries_not_kept: entries.len() - kept.len(),
        entries: kept,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchs_dumps_read_into_the_view() {
        for (name, b, want) in super::super::pickle::tests::fixtures() {
            let d = of(&super::super::pickle::decode(&b).unwrap()).expect(&name);
            let we = want["entries"].as_array().unwrap();
            assert_eq!(d.entries_total, we.len(), "{name}");
            assert_eq!(d.version, want["version"].as_str().unwrap());
            let (e, w) = (d.entries.last().unwrap(), we.last().unwrap());
            assert_eq!(e.collective_seq_id, w["collective_seq_id"].as_i64());
            assert_eq!(e.profiling_name, w["profiling_name"].as_str().unwrap());
            assert_eq!(e.pg_name, w["process_group"][0].as_str().unwrap());
            assert_eq!(e.time_created_ns, w["time_created_ns"].as_i64());
            assert_eq!(e.state, w["state"].as_str().unwrap());
            assert_eq!(e.timeout_ms, w["timeout_ms"].as_i64());
            assert_eq!(serde_json::json!(e.input_sizes), w["input_sizes"]);
            assert_eq!(serde_json::json!(e.input_dtypes), w["input_dtypes"]);
            assert_eq!(
                e.frames.len(),
                w["frames"].as_array().map_or(0, |f| f.len().min(8))
            );
            let st = &want["pg_status"][&e.pg_name];
            let ps = d.pg_status.iter().find(|p| p.pg == e.pg_name).unwrap();
            assert_eq!(ps.last_enqueued, st["last_enqueued_collective"].as_i64());
        }
    }

    #[test]
    fn the_jobs_text_is_cleaned_and_lists_bounded() {
        let evil = Py::Dict(vec![
            (Py::Str("version".into()), Py::Str("2.10".into())),
            (
                Py::Str("entries".into()),
                Py::List(
                    (0..200)
                        .map(|i| {
                            Py::Dict(vec![
                                (Py::Str("collective_seq_id".into()), Py::Int(i)),
                                (
                                    Py::Str("profiling_name".into()),
                                    Py::Str(format!(
                                        "nccl:\x1b[31mall_reduce\n{}",
                                        "x".repeat(999)
                                    )),
                                ),
                                (
                                    Py::Str("input_sizes".into()),
                                    Py::List(vec![Py::List(vec![Py::Int(1); 100]); 100]),
                                ),
                            ])
                        })
                        .collect(),
                ),
            ),
        ]);
        let d = of(&evil).unwrap();
        assert_eq!(
            (d.entries_total, d.entries.len(), d.entries_not_kept),
            (200, 64, 136)
        );
        assert_eq!(d.entries[0].collective_seq_id, Some(136), "the newest kept");
        let e = &d.entries[0];
        assert!(!e.profiling_name.contains('\x1b') && !e.profiling_name.contains('\n'));
        assert!(e.profiling_name.chars().count() <= TEXT_MAX + 1);
        assert_eq!(
            (e.input_sizes.len(), e.input_sizes[0].len()),
            (TENSORS_MAX, DIMS_MAX)
        );
        assert_eq!(of(&Py::Dict(Vec::new())), None, "not a dump");
    }
}
