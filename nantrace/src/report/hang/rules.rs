//! The rules that name the rank a hung collective waits for, within one process group:
//! torch's own desync report, a mismatch of operations, the rank that never enqueued the
//! collective (CPU side), the one whose completions lag (GPU side), the ranks that said nothing.
use std::collections::{BTreeMap, BTreeSet};

use super::{ranks_word, Group, Hang, Kind, RankState};

pub(super) fn judge_group(
    pg: &str,
    g: &Group,
    world: Option<&BTreeSet<u32>>,
    local: Option<&BTreeSet<u32>>,
) -> Hang {
    let seen: Vec<u32> = g.ranks.keys().copied().collect();
    let missing = missing_ranks(pg, g, &seen, world, local);
    let mut h = Hang {
        kind: Kind::Unnamed,
        pg: pg.to_string(),
        ranks: Vec::new(),
        collective: None,
        op: None,
        seen: seen.clone(),
        missing,
        detail: String::new(),
        evidence: String::new(),
        evidence_node: None,
        hint: String::new(),
        timeout_ms: g.timeout_ms,
    };
    if desync_report(&mut h, g) || mismatch(&mut h, g) {
        return h;
    }
    if g.ranks.len() < 2 {
        if let Some((r, s)) = g.ranks.iter().next() {
            h.collective = s.waits_in.or(s.enqueued);
            h.detail = format!("only rank {r}'s lines are there");
            evidence(&mut h, g, *r);
        }
        silent(&mut h, g);
        return h;
    }
    let enq: Vec<(u32, i64)> = g
        .ranks
        .iter()
        .filter_map(|(r, s)| s.enqueued.map(|e| (*r, e)))
        .collect();
    if !enq.is_empty()
        && enq.iter().all(|(_, e)| *e < 0)
        && g.ranks.values().all(|s| s.waits_in.is_none_or(|w| w < 0))
    {
        h.kind = Kind::BeforeFirst;
        h.ranks.clone_from(&seen);
        h.detail = format!(
            "{} with no collective enqueued (last enqueued -1)",
            ranks_word(&seen)
        );
        evidence(&mut h, g, seen[0]);
        return h;
    }
    lagging(&mut h, g, &enq, &seen);
    h
}

/// The ranks of the world with no line: of the job's world for the default group (its ranks
/// are the world's), else none (a subgroup's members are not known); only this node's when
/// `local` says which are.
fn missing_ranks(
    pg: &str,
    g: &Group,
    seen: &[u32],
    world: Option<&BTreeSet<u32>>,
    local: Option<&BTreeSet<u32>>,
) -> Vec<u32> {
    match world {
        Some(w) if pg == "0" => w
            .iter()
            .filter(|r| !g.ranks.contains_key(r))
            .copied()
            .collect(),
        // World unknown: the ranks below the highest seen (ranks count from 0), when that is
        // not far more than the ranks seen (one line claiming rank 900000 says nothing).
        None if pg == "0"
            && seen
                .last()
                .is_some_and(|m| (*m as usize) <= 4 * seen.len() + 64) =>
        {
            (0..seen.last().copied().unwrap_or(0))
                .filter(|r| !g.ranks.contains_key(r))
                .collect()
        }
        _ => Vec::new(),
    }
    .into_iter()
    .filter(|r| local.is_none_or(|l| l.contains(r)))
    .collect()
}

/// The line of rank `r` as the hang's evidence, with its node.
fn evidence(h: &mut Hang, g: &Group, r: u32) {
    if let Some(s) = g.ranks.get(&r) {
        h.evidence.clone_from(&s.line);
        h.evidence_node.clone_from(&s.node);
    }
}

/// torch's own report first: it compared every rank's trace.
fn desync_report(h: &mut Hang, g: &Group) -> bool {
    if let Some((r, n, line, node)) = g.not_joined.as_ref().or(g.not_finished.as_ref()) {
        let joined = g.not_joined.is_none();
        h.kind = if joined { Kind::GpuSide } else { Kind::CpuSide };
        h.ranks.clone_from(r);
        h.collective = Some(*n);
        h.detail = format!(
            "torch's desync report: {} {} collective #{n}",
            ranks_word(r),
            if joined {
                "joined but did not finish"
            } else {
                "did not join"
            }
        );
        h.evidence.clone_from(line);
        h.evidence_node.clone_from(node);
        return true;
    }
    if let Some((r, line, node)) = &g.lagging {
        h.kind = Kind::Reported;
        h.ranks.clone_from(r);
        h.detail = format!("torch's desync report names {} as lagging", ranks_word(r));
        h.evidence.clone_from(line);
        h.evidence_node.clone_from(node);
        return true;
    }
    false
}

/// One collective, different operations or sizes across ranks: the job's code.
fn mismatch(h: &mut Hang, g: &Group) -> bool {
    // collective -> (operation, size) -> the ranks that timed out in it so.
    type Kinds = BTreeMap<(String, Option<u64>), Vec<u32>>;
    let mut by_seq: BTreeMap<i64, Kinds> = BTreeMap::new();
    for (r, s) in &g.ranks {
        if let Some((n, op, numel)) = &s.work {
            by_seq
                .entry(*n)
                .or_default()
                .entry((op.clone(), *numel))
                .or_default()
                .push(*r);
        }
    }
    // Only collectives every rank calls alike: point-to-point pairs (a SEND meets a RECV) and
    // all-to-alls (uneven splits, MoE) differ across ranks by design.
    let varies = |op: &str| uneven_by_design(op);
    if let Some((n, kinds)) = by_seq
        .iter()
        .find(|(_, k)| k.len() > 1 && !k.keys().any(|(op, _)| varies(op)))
    {
        h.kind = Kind::Mismatch;
        h.collective = Some(*n);
        h.detail = kinds
            .iter()
            .map(|((op, numel), r)| {
                format!(
                    "{} {op}{}",
                    ranks_word(r),
                    numel.map_or(String::new(), |x| format!(" of {x} elements"))
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        // The minority is named.
        if let Some((_, r)) = kinds.iter().min_by_key(|(_, r)| r.len()) {
            h.ranks.clone_from(r);
            evidence(h, g, r[0]);
        }
        return true;
    }
    false
}

/// The collective the others wait in, and the rank behind it: never enqueued it (the CPU
/// side), or enqueued but completions lagging by two or more (the GPU, NCCL or link side);
/// else every rank seen in it and none done.
fn lagging(h: &mut Hang, g: &Group, enq: &[(u32, i64)], seen: &[u32]) {
    let of = |r: u32| g.ranks.get(&r);
    // The collective the others wait in.
    // A timeout at a collective the rank had already completed is not one it waits in.
    let target = g
        .ranks
        .values()
        .filter_map(|s| s.waits_in.filter(|w| s.completed.is_none_or(|c| c < *w)))
        .min()
        .or_else(|| enq.iter().map(|x| x.1).max());
    let Some(target) = target else {
        // gloo's timeouts number no collective: only the silent ranks can be named.
        if let Some(first) = seen.first() {
            h.detail = format!("{} timed out in a collective", ranks_word(seen));
            evidence(h, g, *first);
        }
        silent(h, g);
        return;
    };
    h.collective = Some(target);
    h.op = g.ranks.values().find_map(|s| {
        s.work
            .as_ref()
            .filter(|w| w.0 == target)
            .map(|w| w.1.clone())
    });
    let behind: Vec<(u32, i64)> = enq.iter().filter(|(_, e)| *e < target).copied().collect();
    let at: Vec<u32> = g
        .ranks
        .iter()
        .filter(|(_, s)| s.enqueued.is_some_and(|e| e >= target) || s.waits_in == Some(target))
        .map(|(r, _)| *r)
        .collect();
    if !behind.is_empty() && !at.is_empty() {
        h.kind = Kind::CpuSide;
        h.ranks = behind.iter().map(|x| x.0).collect();
        let last = behind.iter().map(|x| x.1).max().unwrap_or(target - 1);
        let idle = behind
            .iter()
            .all(|(r, e)| of(*r).and_then(|s| s.completed) == Some(*e));
        h.detail = format!(
            "its last enqueued {last} while {} wait in {target}",
            ranks_word(&at)
        );
        if idle {
            h.hint = "; nothing was in flight on it (enqueued = completed): torch 2.8 and later count a collective as enqueued once its NCCL call returns, so a rank blocked inside that call looks the same: a strong hint, not proof".into();
        }
        let first = h.ranks[0];
        evidence(h, g, first);
        return;
    }
    let comp: Vec<(u32, i64)> = g
        .ranks
        .iter()
        .filter_map(|(r, s)| s.completed.map(|c| (*r, c)))
        .collect();
    if let Some(best) = comp.iter().map(|x| x.1).max() {
        // Two or more behind: one is the watchdog's poll timing with work in flight.
        let lag: Vec<(u32, i64)> = comp
            .iter()
            .filter(|(_, c)| best.saturating_sub(*c) >= 2)
            .copied()
            .collect();
        if !lag.is_empty() && lag.len() < comp.len() {
            h.kind = Kind::GpuSide;
            h.ranks = lag.iter().map(|x| x.0).collect();
            let last = lag.iter().map(|x| x.1).min().unwrap_or(best - 1);
            h.collective = Some(last + 1);
            h.detail =
                format!("all enqueued {target}; its last completed {last}, the others' {best}");
            let first = h.ranks[0];
            evidence(h, g, first);
            return;
        }
    }
    h.detail = format!(
        "{} enqueued collective {target} and none completed it",
        ranks_word(seen)
    );
    evidence(h, g, seen[0]);
    silent(h, g);
}

/// Every rank seen timed out in one collective and a few ranks of the world printed no line
/// at all: they were not waiting in it (a rank in a collective times out with the others), so
/// they most likely stopped on their CPU side first, or their lines are not in what was read.
/// Only when the silent ranks are no more than the waiting ones (else the lines are merely
/// incomplete).
///
/// gloo's timeout numbers no collective: a group whose ranks all timed out that way (or in
/// one numbered collective) is judged the same, the collective unnamed.
fn silent(h: &mut Hang, g: &Group) {
    let in_flight = |s: &RankState| s.waits_in.filter(|w| s.completed.is_none_or(|c| c < *w));
    let waits: BTreeSet<i64> = g.ranks.values().filter_map(in_flight).collect();
    let all_wait = g
        .ranks
        .values()
        .all(|s| in_flight(s).is_some() || (s.timed_out && s.waits_in.is_none()));
    if h.missing.is_empty() || h.missing.len() > g.ranks.len() || waits.len() > 1 || !all_wait {
        return;
    }
    let t = waits.into_iter().next();
    h.kind = Kind::Silent;
    h.ranks.clone_from(&h.missing);
    h.collective = t;
    h.op = g.ranks.values().find_map(|s| {
        s.work
            .as_ref()
            .filter(|w| Some(w.0) == t)
            .map(|w| w.1.clone())
    });
    h.detail = format!(
        "{} timed out waiting in it, {} printed no watchdog line",
        ranks_word(&h.seen),
        if h.ranks.len() == 1 { "it" } else { "they" }
    );
}

/// An operation whose sizes (or kind) differ across ranks by design: point-to-point pairs (a
/// SEND meets a RECV), all-to-alls (uneven splits, MoE), scatter and gather, coalesced
/// groups; not all-gather or reduce-scatter. Both spellings: NCCL's watchdog `ALLTOALL_BASE`,
/// the Flight Recorder's `nccl:all_to_all`.
pub(crate) fn uneven_by_design(op: &str) -> bool {
    let op: String = op
        .to_ascii_uppercase()
        .chars()
        .filter(|c| *c != '_')
        .collect();
    [
        "SEND",
        "RECV",
        "ALLTOALL",
        "SCATTER",
        "GATHER",
        "COALESCED",
        "UNKNOWN",
    ]
    .iter()
    .any(|x| op.contains(x))
        && !op.contains("ALLGATHER")
        && !op.contains("REDUCESCATTER")
}
