//! The ranks' Flight Recorder dumps compared (flight_recorder.json, `collect::flight`): per
//! process group, each rank's last collective; the first collective some ranks never joined
//! while others entered it (those ranks stopped first, named with their node and their last
//! entry); one collective of different operations, sizes or dtypes across ranks (the job's
//! code); the ranks of the world with no dump (often the stopped one: a hint, not proof).
//! Used where the watchdog lines cannot decide (gloo's timeouts carry no counters). These are
//! the job's own records: never machine evidence, never a drain.
use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::hang::rules::uneven_by_design as uneven;
use super::hang::{rank_list, Hang, Kind};
use crate::collect::flight::view::{Dump, Entry};

/// One rank's dump, as a node's bundle read it.
#[derive(Clone, Debug)]
pub struct RankDump {
    pub rank: u32,
    pub node: Option<String>,
    /// Where it was read (the job's path).
    pub path: String,
    pub dump: Dump,
}

/// The dumps a bundle's `flight_recorder` section read, and the ranks it looked for without
/// reading one (rank, why).
pub fn dumps(section: &Value, node: Option<&str>) -> (Vec<RankDump>, Vec<(u32, String)>) {
    let (mut read, mut not) = (Vec::new(), Vec::new());
    for r in section["read"]["ranks"].as_array().into_iter().flatten() {
        let Some(rank) = r["rank"].as_u64().and_then(|x| u32::try_from(x).ok()) else {
            continue;
        };
        match serde_json::from_value::<Dump>(r["dump"].clone()) {
            Ok(dump) if r["status"] == "read" => read.push(RankDump {
                rank,
                node: node.map(String::from),
                path: r["path"].as_str().unwrap_or("").to_string(),
                dump,
            }),
            _ => not.push((
                rank,
                crate::collect::flight::view::text(r["status"].as_str().unwrap_or("?")),
            )),
        }
    }
    (read, not)
}

/// Each rank's process group as its dump says it: the group of the oldest collective it
/// has not completed (the one it waits in, as a watchdog line's group), by the entry's
/// `pg_id`, torch's local id, which a watchdog line prints as its `PG ID`. Only from a dump
/// that records completion (NCCL's: `completed` entries); gloo's (torch 2.15) leaves every
/// entry `scheduled`, so its newest entry is no more the one a rank waits in than the last
/// one it finished: none is said. A rank with nothing in flight (the one that stopped on its
/// CPU side) has no group; an entry without a creation time is not taken as the oldest.
pub fn pg_of_ranks(ds: &[RankDump]) -> BTreeMap<u32, String> {
    ds.iter()
        .filter(|d| d.dump.entries.iter().any(|e| e.state == "completed"))
        .filter_map(|d| {
            let e = d
                .dump
                .entries
                .iter()
                .filter(|e| e.is_p2p != Some(true) && e.collective_seq_id.is_some_and(|s| s > 0))
                .filter(|e| e.state != "completed" && e.time_created_ns.is_some())
                .min_by_key(|e| (e.time_created_ns, e.record_id))?;
            Some((d.rank, e.pg_id?.to_string()))
        })
        .collect()
}

/// What the dumps say.
#[derive(Clone, Debug, Default)]
pub struct Flight {
    /// `CpuSide`: ranks never joined a collective others entered; `Mismatch`; `Unnamed`:
    /// the dumps read agree (what is missing is said).
    pub kind: Option<Kind>,
    pub pg: String,
    pub seq: Option<i64>,
    pub op: Option<String>,
    /// The ranks named (lagging, or the minority of a mismatch).
    pub ranks: Vec<u32>,
    /// The ranks that entered it.
    pub entered: Vec<u32>,
    pub detail: String,
    /// Ranks of the world with no dump read: (rank, why).
    pub missing: Vec<(u32, String)>,
    /// Ranks whose dumps were read.
    pub read: Vec<u32>,
    pub node_of: BTreeMap<u32, String>,
}

/// The collectives of one group in one rank's dump, by sequence number.
fn collectives<'a>(d: &'a RankDump, pg: &str) -> BTreeMap<i64, &'a Entry> {
    d.dump
        .entries
        .iter()
        .filter(|e| e.pg_name == pg && e.is_p2p != Some(true))
        .filter_map(|e| e.collective_seq_id.filter(|s| *s > 0).map(|s| (s, e)))
        .collect()
}

/// An entry in words: `collective 5 (gloo:all_reduce, scheduled)`.
fn words(seq: i64, e: &Entry) -> String {
    format!("collective {seq} ({}, {})", e.profiling_name, e.state)
}

fn mismatch(pg: &str, ds: &[RankDump]) -> Option<Flight> {
    let per: Vec<(u32, BTreeMap<i64, &Entry>)> =
        ds.iter().map(|d| (d.rank, collectives(d, pg))).collect();
    let seqs: BTreeSet<i64> = per.iter().flat_map(|(_, c)| c.keys().copied()).collect();
    for s in seqs {
        let mut kinds: BTreeMap<(String, String, String), Vec<u32>> = BTreeMap::new();
        for (r, c) in &per {
            if let Some(e) = c.get(&s) {
                let k = (
                    e.profiling_name.clone(),
                    format!("{:?}", e.input_sizes),
                    e.input_dtypes.join(","),
                );
                kinds.entry(k).or_default().push(*r);
            }
        }
        if kinds.len() < 2 || kinds.keys().any(|k| uneven(&k.0)) {
            continue;
        }
        // The minority is named; with no single one (two ranks), every rank of it.
        let least = kinds.values().map(Vec::len).min().unwrap_or(0);
        let mut minority: Vec<u32> = kinds
            .values()
            .filter(|r| r.len() == least)
            .flatten()
            .copied()
            .collect();
        if kinds.values().filter(|r| r.len() == least).count() > 1 {
            minority = kinds.values().flatten().copied().collect();
        }
        minority.sort_unstable();
        let detail = kinds
            .iter()
            .map(|((op, sz, dt), r)| format!("{} {op} of {sz} {dt}", ranks_word(r)))
            .collect::<Vec<_>>()
            .join(", ");
        return Some(Flight {
            kind: Some(Kind::Mismatch),
            pg: pg.to_string(),
            seq: Some(s),
            op: kinds.keys().next().map(|k| k.0.clone()),
            ranks: minority,
            detail: format!("their Flight Recorder dumps: {detail}"),
            ..Flight::default()
        });
    }
    None
}

fn ranks_word(r: &[u32]) -> String {
    format!(
        "{} {}",
        if r.len() == 1 { "rank" } else { "ranks" },
        rank_list(r)
    )
}

/// The ranks whose last collective of `pg` is below another rank's: (lagging with their
/// last, entered, the first collective they lack).
fn lagging(pg: &str, ds: &[RankDump]) -> Option<(Vec<(u32, i64, Entry)>, Vec<u32>, i64)> {
    let last: Vec<(u32, i64, &Entry)> = ds
        .iter()
        .filter_map(|d| {
            let (s, e) = collectives(d, pg).into_iter().next_back()?;
            Some((d.rank, s, e))
        })
        .collect();
    let top = last.iter().map(|x| x.1).max()?;
    let low = last.iter().map(|x| x.1).min()?;
    if low == top {
        return None;
    }
    let behind = last
        .iter()
        .filter(|x| x.1 == low)
        .map(|(r, s, e)| (*r, *s, (*e).clone()))
        .collect();
    let entered = last.iter().filter(|x| x.1 > low).map(|x| x.0).collect();
    Some((behind, entered, low + 1))
}

/// A rank waits elsewhere when its newest entry is a collective of a group that another
/// rank of it never joined: it is stuck there, behind someone else, not stopped itself.
fn waits_elsewhere(d: &RankDump, ds: &[RankDump]) -> bool {
    let Some(e) = d.dump.entries.iter().max_by_key(|e| e.time_created_ns) else {
        return false;
    };
    let Some(seq) = e.collective_seq_id.filter(|_| e.is_p2p != Some(true)) else {
        return false;
    };
    ds.iter().any(|o| {
        let c = collectives(o, &e.pg_name);
        o.rank != d.rank && !c.is_empty() && !c.contains_key(&seq) && c.keys().all(|s| *s < seq)
    })
}

/// Compare the dumps across ranks; `world` names the ranks with no dump. None without two
/// dumps to compare or a missing one to name.
pub fn judge(ds: &[RankDump], not_read: &[(u32, String)], world: Option<u32>) -> Option<Flight> {
    if ds.is_empty() {
        return None;
    }
    let read: BTreeSet<u32> = ds.iter().map(|d| d.rank).collect();
    let mut missing: BTreeMap<u32, String> = not_read
        .iter()
        .filter(|(r, _)| !read.contains(r))
        .cloned()
        .collect();
    for r in (0..world.unwrap_or(0).min(1 << 16)).filter(|r| !read.contains(r)) {
        missing
            .entry(r)
            .or_insert_with(|| "no bundle read it".into());
    }
    let node_of: BTreeMap<u32, String> = ds
        .iter()
        .filter_map(|d| d.node.clone().map(|n| (d.rank, n)))
        .collect();
    let mut pgs: Vec<String> = ds
        .iter()
        .flat_map(|d| d.dump.entries.iter().map(|e| e.pg_name.clone()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    pgs.sort_by_key(|p| (p.parse::<u64>().unwrap_or(u64::MAX), p.clone()));
    let mut found: Option<Flight> = pgs.iter().find_map(|pg| mismatch(pg, ds));
    if found.is_none() {
        let mut cands: Vec<(bool, Flight)> = Vec::new();
        for pg in &pgs {
            let Some((behind, entered, seq)) = lagging(pg, ds) else {
                continue;
            };
            let op = ds.iter().find_map(|d| {
                collectives(d, pg)
                    .get(&seq)
                    .map(|e| e.profiling_name.clone())
            });
            let stopped = behind.iter().all(|(r, ..)| {
                ds.iter()
                    .find(|d| d.rank == *r)
                    .is_some_and(|d| !waits_elsewhere(d, ds))
            });
            let (r0, s0, e0) = &behind[0];
            cands.push((
                stopped,
                Flight {
                    kind: Some(Kind::CpuSide),
                    pg: pg.clone(),
                    seq: Some(seq),
                    op,
                    ranks: behind.iter().map(|x| x.0).collect(),
                    entered: entered.clone(),
                    detail: format!(
                        "{} Flight Recorder dump ends at {} while {} entered collective {seq}",
                        if behind.len() == 1 {
                            format!("rank {r0}'s")
                        } else {
                            format!(
                                "{}' (rank {r0}'s)",
                                ranks_word(&behind.iter().map(|x| x.0).collect::<Vec<_>>())
                            )
                        },
                        words(*s0, e0),
                        ranks_word(&entered)
                    ),
                    ..Flight::default()
                },
            ));
        }
        // A group whose lagging ranks stopped there, before one whose ranks wait elsewhere.
        found = cands
            .iter()
            .find(|c| c.0)
            .or(cands.first())
            .map(|c| c.1.clone());
    }
    let mut f = match found {
        Some(f) => f,
        None if !missing.is_empty() && ds.len() >= 1 => {
            let pg = pgs.first().cloned().unwrap_or_else(|| "0".into());
            // Where they all stand: the newest collective of every dump read, when it is one.
            let newest: BTreeSet<Option<i64>> = ds
                .iter()
                .map(|d| collectives(d, &pg).keys().max().copied())
                .collect();
            let seq = (newest.len() == 1)
                .then(|| newest.into_iter().next().flatten())
                .flatten();
            let op = seq.and_then(|n| {
                ds.iter().find_map(|d| {
                    collectives(d, &pg)
                        .get(&n)
                        .map(|e| e.profiling_name.clone())
                })
            });
            let at = seq.map_or(String::new(), |n| {
                format!(", each ending at collective {n}")
            });
            Flight {
                detail: format!(
                    "the Flight Recorder dumps of {} agree{at}",
                    ranks_word(&read.iter().copied().collect::<Vec<_>>())
                ),
                pg,
                seq,
                op,
                ..Flight::default()
            }
        }
        None => return None,
    };
    f.missing = missing.into_iter().collect();
    f.read = read.into_iter().collect();
    f.node_of = node_of;
    Some(f)
}

impl Flight {
    /// "no Flight Recorder dump from rank 1 (n2)": where a dump is missing, a hint.
    pub fn missing_clause(&self, node_of: &dyn Fn(u32) -> Option<String>) -> String {
        if self.missing.is_empty() {
            return String::new();
        }
        let list: Vec<String> = self
            .missing
            .iter()
            .take(12)
            .map(|(r, why)| match node_of(*r) {
                Some(n) => format!("rank {r} ({n}: {why})"),
                None => format!("rank {r} ({why})"),
            })
            .collect();
        format!(
            "no Flight Recorder dump from {}{}: a rank that never dumped is often the stopped one (a hint, not proof)",
            list.join(", "),
            if self.missing.len() > 12 { format!(" and {} more", self.missing.len() - 12) } else { String::new() }
        )
    }

    /// As a hang the verdict's rules read (`report::hang`): the ranks that never joined the
    /// collective are its CPU side, a mismatch the job's code; else no rank named.
    pub fn hang(&self, node_of: &dyn Fn(u32) -> Option<String>) -> Hang {
        let miss = self.missing_clause(node_of);
        let detail = match (self.detail.is_empty(), miss.is_empty()) {
            (_, true) => self.detail.clone(),
            (true, false) => miss,
            (false, false) => format!("{}; {miss}", self.detail),
        };
        Hang {
            kind: self.kind.unwrap_or(Kind::Unnamed),
            pg: self.pg.clone(),
            ranks: self.ranks.clone(),
            collective: self.seq,
            op: self.op.clone(),
            seen: self.read.clone(),
            missing: Vec::new(),
            detail,
            evidence: String::new(),
            evidence_node: None,
            hint: " (the job's Flight Recorder, its own record: a strong hint, not proof)".into(),
            timeout_ms: None,
        }
    }
}

/// What a node's summary keeps of its `flight_recorder` section (the job report reads a
/// quiet node from it): each rank's status and path, and its dump's newest 8 entries per
/// group, without their frames.
pub fn thin(section: &Value) -> Value {
    let mut s = section.clone();
    for r in s["read"]["ranks"].as_array_mut().into_iter().flatten() {
        let Some(d) = r.get_mut("dump") else { continue };
        let Ok(mut dump) = serde_json::from_value::<Dump>(d.take()) else {
            continue;
        };
        let mut per: BTreeMap<String, usize> = BTreeMap::new();
        let mut keep: Vec<Entry> = Vec::new();
        for mut e in dump.entries.into_iter().rev() {
            let n = per.entry(e.pg_name.clone()).or_default();
            if *n < 8 {
                *n += 1;
                e.frames.clear();
                keep.push(e);
            }
        }
        keep.reverse();
        dump.entries = keep;
        *d = serde_json::to_value(dump).unwrap_or_default();
    }
    s
}

#[cfg(test)]
mod tests;
