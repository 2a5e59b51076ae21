//! The job's threads at the trigger (snapshot.json `stacks`, `collect::stacks`): a rank
//! blocked in D state in the filesystem or block layer (storage), or inside the NVIDIA driver
//! (its GPU), in both samples, with no I/O progress between them. A user's own FUSE daemon can
//! hold a thread in D state: these are at most POSSIBLY (severity below a drain's).
use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::{Acc, Ctx};
use crate::report::rules::signal;

/// Kernel functions of the filesystems and the block layer (a thread waiting in one waits on
/// storage).
static STORAGE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:nfs|rpc_|fuse_|xfs_|ext4_|jbd2|btrfs_|ceph_|p9_|v9fs_|ll_|lustre|ptlrpc|osc_|mdc_|mmfs|gpfs|submit_bio|blk_|bio_|__blkdev|blkdev_|io_schedule|folio_wait|__folio_lock|wait_on_page|__wait_on_buffer|filemap_|iomap_|__iomap|dio_|do_fsync|vfs_fsync|wait_on_commit|nfs_)")
        .unwrap()
});
/// The NVIDIA driver's functions (`nvidia_*`, `_nv000123rm`, `os_*`, `uvm_*`).
static NVIDIA: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(?:nvidia_|_nv\d+rm|nv_|os_|uvm_)").unwrap());

/// A thread blocked through both samples: (its function, its kernel stack, its tid, comm).
fn blocked(p: &Value) -> Vec<(String, Vec<String>, u64, String)> {
    let io = &p["io"];
    let no_io = io.is_null()
        || (io["read_bytes"][0] == io["read_bytes"][1]
            && io["write_bytes"][0] == io["write_bytes"][1]);
    if !no_io {
        return Vec::new();
    }
    p["threads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["state"][0] == "D" && t["state"][1] == "D")
        .filter_map(|t| {
            let w = t["wchan"][0]
                .as_str()
                .filter(|w| !w.is_empty() && *w != "0")?;
            (t["wchan"][1].as_str() == Some(w)).then(|| {
                let stack: Vec<String> = t["kernel_stack"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|f| f.as_str().map(String::from))
                    .collect();
                (
                    w.to_string(),
                    stack,
                    t["tid"].as_u64().unwrap_or(0),
                    t["comm"].as_str().unwrap_or("").to_string(),
                )
            })
        })
        .collect()
}

/// The Python frame the main thread was in, from py-spy's dump (`    log_metrics (train.py:211)`).
fn python_frame(stacks: &Value, pid: u64) -> Option<String> {
    let lines = stacks["python"]["dumps"][pid.to_string()]["lines"].as_array()?;
    let mut in_main = false;
    for l in lines.iter().filter_map(Value::as_str) {
        if l.starts_with("Thread ") {
            in_main = l.starts_with(&format!("Thread {pid} ")) || l.contains("\"MainThread\"");
            continue;
        }
        if in_main && l.starts_with("    ") && !l.trim().is_empty() {
            let f = l.trim();
            let (func, at) = f
                .rsplit_once(" (")
                .map_or((f, ""), |(a, b)| (a, b.trim_end_matches(')')));
            return Some(format!("{at} {func}").trim().chars().take(120).collect());
        }
    }
    None
}

/// Where rank `rank`'s main process stood at the trigger, in a clause (`pid 4121: main
/// thread S in futex_wait_queue, from train.py:211 log_metrics`), when the stacks have it.
pub(crate) fn rank_state(stacks: &Value, rank: u32) -> Option<String> {
    let p = stacks["processes"]
        .as_array()?
        .iter()
        .find(|p| p["rank"] == rank && p["rank_main"] == true)?;
    let pid = p["pid"].as_u64()?;
    let main = p["threads"]
        .as_array()?
        .iter()
        .find(|t| t["tid"].as_u64() == Some(pid))?;
    let state = main["state"][1].as_str().or(main["state"][0].as_str())?;
    let wchan = main["wchan"][1]
        .as_str()
        .filter(|w| !w.is_empty() && *w != "0")
        .map_or(String::new(), |w| format!(" in {w}"));
    let py = python_frame(stacks, pid).map_or(String::new(), |f| format!(", from {f}"));
    Some(format!("pid {pid}: main thread {state}{wchan}{py}"))
}

/// The ranks' main threads at the trigger, grouped by where they stood (state, wait channel,
/// Python frame), over one or more nodes' stacks (`(node, stacks)`): ByteRobust's reading, the
/// ranks outside the largest group are where to look. `None` with fewer than two ranks or one
/// group. Ranks are taken once (the first node that has them).
pub(crate) fn rank_groups<'a>(
    stacks: impl IntoIterator<Item = (Option<&'a str>, &'a Value)>,
) -> Option<String> {
    rank_groups_by(stacks, |_| None, "")
}

/// [`rank_groups`] over one node's stacks, per process group where the node's Flight Recorder
/// dumps (snapshot `flight_recorder`) put its ranks in two or more.
pub(crate) fn node_rank_groups(stacks: &Value, flight: &Value) -> Option<String> {
    let (ds, _) = crate::report::flight::dumps(flight, None);
    let pg = crate::report::flight::pg_of_ranks(&ds);
    if pg.values().collect::<BTreeSet<_>>().len() < 2 {
        return rank_groups([(None, stacks)]);
    }
    rank_groups_by([(None, stacks)], |r| pg.get(&r).cloned(), PG_FROM_FLIGHT)
}

pub(crate) type RankPgs = (BTreeMap<u32, Option<String>>, &'static str);

/// Each rank's process group, where its watchdog lines name one only (a pipeline stage's
/// ranks stand apart from another stage's by design): `rank_groups_by`'s grouping, and where
/// the group was read. A rank with no watchdog line (gloo prints none; the rank that stopped
/// prints none; a paste of one rank's) takes the group its Flight Recorder dump shows it
/// waiting in (`flight::pg_of_ranks`: by the same id as the lines' `PG ID`); the lines'
/// group always wins.
pub(crate) fn rank_pgs<'a>(
    keys: impl Iterator<Item = &'a (String, u32)>,
    dumps: &[crate::report::flight::RankDump],
) -> RankPgs {
    let mut pg_of: BTreeMap<u32, Option<String>> = BTreeMap::new();
    for (pg, r) in keys {
        pg_of
            .entry(*r)
            .and_modify(|p| {
                if p.as_deref() != Some(pg.as_str()) {
                    *p = None;
                }
            })
            .or_insert_with(|| Some(pg.clone()));
    }
    let mut from = PG_FROM_WATCHDOG;
    for (r, pg) in crate::report::flight::pg_of_ranks(dumps) {
        if let std::collections::btree_map::Entry::Vacant(v) = pg_of.entry(r) {
            v.insert(Some(pg));
            from = PG_FROM_BOTH;
        }
    }
    (pg_of, from)
}

/// Where a rank's process group was read, for [`rank_groups_by`]'s sentence.
pub(crate) const PG_FROM_WATCHDOG: &str = "the one each rank's watchdog line timed out in";
pub(crate) const PG_FROM_FLIGHT: &str =
    "the one each rank's Flight Recorder dump shows it waiting in";
pub(crate) const PG_FROM_BOTH: &str = "the one each rank's watchdog line timed out in, else the one its Flight Recorder dump shows it waiting in";

/// As [`rank_groups`], per process group where `pg_of` knows the ranks' (read `from` a
/// rank's watchdog line or its Flight Recorder dump: a pipeline stage, a tensor-parallel
/// group): ranks of different stages stand in different places by design, so each group is
/// read alone and the ranks outside the largest stack group *of their process group* are
/// named. With one process group (or none known) the reading is [`rank_groups`]'s.
pub(crate) fn rank_groups_by<'a>(
    stacks: impl IntoIterator<Item = (Option<&'a str>, &'a Value)>,
    pg_of: impl Fn(u32) -> Option<String>,
    from: &str,
) -> Option<String> {
    let ranks = main_threads(stacks);
    // Where most of the job's ranks stood (none on a tie): what a rank of no known group is
    // compared with (never with the other ranks of no group: they are no group).
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &ranks {
        *counts.entry(r.at.as_str()).or_default() += 1;
    }
    let job_largest = largest(&counts).map(str::to_string);
    let mut by_pg: BTreeMap<String, Vec<RankAt>> = BTreeMap::new();
    let mut no_group = Vec::new();
    for r in ranks {
        match pg_of(r.rank) {
            Some(pg) if by_pg.len() < 64 || by_pg.contains_key(&pg) => {
                by_pg.entry(pg).or_default().push(r);
            }
            _ => no_group.push(r),
        }
    }
    if by_pg.len() <= 1 {
        let all = by_pg.into_values().flatten().chain(no_group).collect();
        return said(all, "").map(|(s, _)| s);
    }
    let mut parts = Vec::new();
    let mut outside = Vec::new();
    for (pg, rs) in by_pg {
        if let Some((s, out)) = said(rs, &format!("PG {pg}: ")) {
            parts.push(s);
            outside.extend(out);
        }
    }
    let apart: Vec<String> = no_group
        .iter()
        .filter(|r| job_largest.as_deref().is_some_and(|l| r.at != l))
        .take(8)
        .map(|r| {
            outside.push(r.rank);
            let on = r.node.map_or(String::new(), |n| format!(" ({n})"));
            format!("rank {}{on}: main thread {}", r.rank, r.at)
        })
        .collect();
    if !apart.is_empty() {
        parts.push(format!(
            "of no known group (nothing in flight), apart from where most of the job's ranks stood: {}",
            apart.join("; ")
        ));
    }
    if parts.is_empty() {
        return None;
    }
    outside.sort_unstable();
    Some(format!(
        "per process group ({from}): {}; outside the largest group of their process group: {}",
        parts.join("; "),
        named(&outside)
    ))
}

/// The key held by the most, unless two hold as many.
fn largest<'k>(counts: &BTreeMap<&'k str, usize>) -> Option<&'k str> {
    let mut v: Vec<(&str, usize)> = counts.iter().map(|(k, n)| (*k, *n)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1));
    match v.as_slice() {
        [a, b, ..] if a.1 == b.1 => None,
        [a, ..] => Some(a.0),
        [] => None,
    }
}

/// `rank 2`, `ranks 0, 3`, or that no rank is named (every group as large as another).
fn named(outside: &[u32]) -> String {
    match outside.len() {
        0 => "none (no group is the largest)".to_string(),
        1 => format!("rank {}", crate::report::hang::rank_list(outside)),
        _ => format!("ranks {}", crate::report::hang::rank_list(outside)),
    }
}

/// One rank's main thread at the trigger: where it stood, on which node.
struct RankAt<'a> {
    rank: u32,
    node: Option<&'a str>,
    at: String,
}

fn main_threads<'a>(
    stacks: impl IntoIterator<Item = (Option<&'a str>, &'a Value)>,
) -> Vec<RankAt<'a>> {
    use std::collections::BTreeSet;
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for (node, st) in stacks {
        for p in st["processes"].as_array().into_iter().flatten() {
            let (Some(rank), Some(pid)) = (
                p["rank"].as_u64().and_then(|r| u32::try_from(r).ok()),
                p["pid"].as_u64(),
            ) else {
                continue;
            };
            if p["rank_main"] != true || seen.len() >= 65_536 || !seen.insert(rank) {
                continue;
            }
            let Some(main) = p["threads"]
                .as_array()
                .and_then(|t| t.iter().find(|t| t["tid"].as_u64() == Some(pid)))
            else {
                continue;
            };
            let state = main["state"][1]
                .as_str()
                .or(main["state"][0].as_str())
                .unwrap_or("?");
            let wchan = main["wchan"][1]
                .as_str()
                .filter(|w| !w.is_empty() && *w != "0")
                .map_or(String::new(), |w| format!(" in {w}"));
            let py = python_frame(st, pid).map_or(String::new(), |f| format!(", at {f}"));
            out.push(RankAt {
                rank,
                node,
                at: format!("{state}{wchan}{py}"),
            });
        }
    }
    out
}

/// The groups of `ranks` by where they stood, said (after `head`), and the ranks outside the
/// largest; `None` with fewer than two ranks or one group.
fn said(ranks: Vec<RankAt<'_>>, head: &str) -> Option<(String, Vec<u32>)> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut groups: BTreeMap<String, Vec<(u32, Option<&str>)>> = BTreeMap::new();
    for r in ranks {
        if groups.len() < 1024 || groups.contains_key(&r.at) {
            groups.entry(r.at).or_default().push((r.rank, r.node));
        }
    }
    let n: usize = groups.values().map(Vec::len).sum();
    if n < 2 || groups.len() < 2 {
        return None;
    }
    let mut g: Vec<_> = groups.into_iter().collect();
    g.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
    let said: Vec<String> = g
        .iter()
        .take(6)
        .map(|(k, r)| {
            let ranks: Vec<u32> = r.iter().map(|x| x.0).collect();
            let nodes: BTreeSet<&str> = r.iter().filter_map(|x| x.1).collect();
            let on = if nodes.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    nodes.into_iter().take(8).collect::<Vec<_>>().join(", ")
                )
            };
            format!(
                "{} {}{on}: main thread {k}",
                if ranks.len() == 1 { "rank" } else { "ranks" },
                crate::report::hang::rank_list(&ranks)
            )
        })
        .collect();
    // Two groups as large as each other: which one is apart the stacks cannot tell.
    let tie = g[0].1.len() == g[1].1.len();
    let outside: Vec<u32> = if tie {
        Vec::new()
    } else {
        g[1..].iter().flat_map(|x| x.1.iter().map(|r| r.0)).collect()
    };
    Some((
        format!(
            "{head}the ranks' main threads at the trigger in {} groups: {}; outside the largest group: {}",
            g.len(),
            said.join("; "),
            named(&outside)
        ),
        outside,
    ))
}

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    // Only in a hang: at a NaN or an exit, a DataLoader worker reading a network
    // filesystem or a rank closing its GPU is in D state for good reasons.
    if !ctx.hung {
        return;
    }
    let stacks = ctx.stacks;
    let gap_s = stacks["gap_ms"].as_f64().unwrap_or(0.0) / 1000.0;
    for p in stacks["processes"].as_array().into_iter().flatten() {
        let pid = p["pid"].as_u64().unwrap_or(0);
        let who = match p["rank"].as_u64() {
            Some(r) if p["rank_main"] == true => format!(
                "rank {r} (pid {pid}, {})",
                p["comm"].as_str().unwrap_or("?")
            ),
            Some(r) => format!(
                "a process of rank {r} (pid {pid}, {}: a worker)",
                p["comm"].as_str().unwrap_or("?")
            ),
            None => format!("job process {pid} ({})", p["comm"].as_str().unwrap_or("?")),
        };
        for (wchan, stack, tid, comm) in blocked(p) {
            let storage = STORAGE.is_match(&wchan) || stack.iter().any(|f| STORAGE.is_match(f));
            let gpu = NVIDIA.is_match(&wchan) || stack.iter().any(|f| NVIDIA.is_match(f));
            let sig = match (storage, gpu) {
                (true, _) => signal("rank_blocked_storage"),
                (false, true) => signal("rank_blocked_gpu_driver"),
                _ => continue,
            };
            let path: Vec<&str> = stack.iter().take(4).map(String::as_str).collect();
            let py = python_frame(stacks, pid).map_or(String::new(), |f| format!(", from {f}"));
            let thread = if tid == pid {
                "main thread".to_string()
            } else {
                format!("thread {tid} ({comm})")
            };
            acc.add(sig, &format!("{pid}/{wchan}"), 0.0, true, || {
                format!(
                    "{who}: {thread} in D state in {wchan} in both samples {gap_s:.1} s apart at the trigger, no I/O progress{}{py}: {}",
                    if path.is_empty() {
                        String::new()
                    } else {
                        format!(" (kernel stack: {})", path.join(" ← "))
                    },
                    if storage { "waiting on storage" } else { "waiting in the NVIDIA driver" }
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_thread_in_d_state_twice_without_io_is_blocked_and_one_making_progress_is_not() {
        let p = |rb: [u64; 2]| json!({ "pid": 9, "io": { "read_bytes": rb, "write_bytes": [0, 0] }, "threads": [{ "tid": 9, "comm": "python3", "state": ["D", "D"], "wchan": ["submit_bio_wait", "submit_bio_wait"], "kernel_stack": ["submit_bio_wait", "__blkdev_direct_IO_simple", "blkdev_read_iter"] }] });
        assert_eq!(blocked(&p([4096, 4096])).len(), 1);
        assert!(blocked(&p([4096, 8192])).is_empty(), "I/O progressed");
        let s = json!({ "python": { "dumps": { "9": { "lines": ["Process 9: python3 train.py", "Python v3.11.7 (/usr/bin/python3.11)", "", "Thread 9 (idle): \"MainThread\"", "    log_metrics (train.py:211)", "    <module> (train.py:300)"] } } } });
        assert_eq!(
            python_frame(&s, 9).as_deref(),
            Some("train.py:211 log_metrics")
        );
    }

    /// Two pipeline stages (process groups 1 and 2) stand in different places by design:
    /// read together, stage 2's four ranks were the largest group and stage 1's healthy
    /// ranks 0, 1 and 3 were named with rank 2; per process group only rank 2 is.
    #[test]
    fn ranks_are_grouped_per_process_group_where_it_is_known() {
        let proc_ = |rank: u32, wchan: &str| json!({ "pid": 100 + rank, "rank": rank, "rank_main": true, "threads": [{ "tid": 100 + rank, "state": ["S", "S"], "wchan": [wchan, wchan] }] });
        let mut ps = Vec::new();
        for r in 0..4 {
            ps.push(proc_(
                r,
                if r == 2 {
                    "hrtimer_nanosleep"
                } else {
                    "futex_wait_queue"
                },
            ));
        }
        for r in 4..8 {
            ps.push(proc_(r, "sk_wait_data"));
        }
        let st = json!({ "processes": ps });
        let one = rank_groups([(Some("n1"), &st)]).unwrap();
        assert!(
            one.ends_with("outside the largest group: ranks 0-3"),
            "{one}"
        );
        let per = rank_groups_by(
            [(Some("n1"), &st)],
            |r| Some(if r < 4 { "1" } else { "2" }.to_string()),
            PG_FROM_WATCHDOG,
        )
        .unwrap();
        assert!(
            per.starts_with("per process group (the one each rank's watchdog line timed out in): PG 1: the ranks' main threads at the trigger in 2 groups")
                && per.ends_with("outside the largest group of their process group: rank 2"),
            "{per}"
        );
        // Ranks of no known group are compared with where most of the job's ranks stood,
        // never with each other (review: a stopped rank alone in that bucket was dropped, and
        // of two there the healthy one was named by its text's order).
        let ps: Vec<Value> = (0..8)
            .map(|r| proc_(r, if r == 5 { "hrtimer_nanosleep" } else { "futex_wait_queue" }))
            .collect();
        let st8 = json!({ "processes": ps });
        let pg = |r: u32| match r {
            0..=3 => Some("0".to_string()),
            5 => None,
            _ => Some("2".to_string()),
        };
        let a = rank_groups_by([(Some("n1"), &st8)], pg, PG_FROM_BOTH).unwrap();
        assert!(
            a.contains("of no known group (nothing in flight), apart from where most of the job's ranks stood: rank 5 (n1): main thread S in hrtimer_nanosleep")
                && a.ends_with("outside the largest group of their process group: rank 5"),
            "{a}"
        );
        let ps = vec![
            proc_(0, "futex_wait_queue"),
            json!({ "pid": 101, "rank": 1, "rank_main": true, "threads": [{ "tid": 101, "state": ["R", "R"], "wchan": ["0", "0"] }] }),
            proc_(2, "futex_wait_queue"),
            proc_(3, "futex_wait_queue"),
        ];
        let st4 = json!({ "processes": ps });
        let pg = |r: u32| match r {
            0 => Some("1".to_string()),
            2 => Some("2".to_string()),
            _ => None,
        };
        let b = rank_groups_by([(Some("n1"), &st4)], pg, PG_FROM_BOTH).unwrap();
        assert!(b.ends_with("outside the largest group of their process group: rank 1"), "{b}");
        // Two ranks, two places: which one is apart the stacks cannot tell.
        let st2 = json!({ "processes": [proc_(0, "futex_wait_queue"), proc_(1, "hrtimer_nanosleep")] });
        let t = rank_groups([(Some("n1"), &st2)]).unwrap();
        assert!(t.ends_with("outside the largest group: none (no group is the largest)"), "{t}");
        // A node's report groups by its dumps' groups (NCCL's states: a completed entry,
        // then the one each rank waits in): stage 1 (PG 1: ranks 0, 1 wait) and stage 2 (PG
        // 2: ranks 3-5) stand apart by design; rank 2 stopped with nothing in flight and is
        // the one named (the plain reading named ranks 0-2: stage 2 was the largest group).
        let entry = |pg: i64, seq: i64, state: &str| json!({ "pg_id": pg, "pg_name": pg.to_string(), "pg_desc": "", "collective_seq_id": seq, "profiling_name": "nccl:all_reduce", "time_created_ns": 1_000 + seq, "state": state, "input_sizes": [], "input_dtypes": [], "output_sizes": [], "output_dtypes": [] });
        let mut ps = Vec::new();
        let mut dumps = Vec::new();
        for r in 0..6u32 {
            let pg = if r < 3 { 1 } else { 2 };
            let wchan = match r {
                2 => "hrtimer_nanosleep",
                0 | 1 => "futex_wait_queue",
                _ => "sk_wait_data",
            };
            ps.push(proc_(r, wchan));
            let entries = if r == 2 {
                vec![entry(pg, 7, "completed")]
            } else {
                vec![entry(pg, 7, "completed"), entry(pg, 8, "started")]
            };
            dumps.push(json!({ "rank": r, "pid": 100 + r, "status": "read", "path": "/tmp/fr", "dump": { "version": "2.10", "entries_total": entries.len(), "entries_not_kept": 0, "entries": entries } }));
        }
        let flight = json!({ "sources": [], "read": { "schema": crate::collect::flight::SCHEMA, "ranks_read": 6, "ranks": dumps } });
        let node = node_rank_groups(&json!({ "processes": ps }), &flight).unwrap();
        assert!(
            node.starts_with("per process group (the one each rank's Flight Recorder dump shows it waiting in): of no known group (nothing in flight), apart from where most of the job's ranks stood: rank 2: main thread S in hrtimer_nanosleep")
                && node.ends_with("outside the largest group of their process group: rank 2"),
            "{node}"
        );
        // One process group known: the plain reading.
        assert_eq!(
            rank_groups_by([(Some("n1"), &st)], |_| Some("0".into()), PG_FROM_WATCHDOG),
            Some(one)
        );
    }
}
