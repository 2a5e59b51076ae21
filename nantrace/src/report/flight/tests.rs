use super::*;
use crate::collect::flight::{pickle, view};

/// The dumps torch wrote for a scenario (tests/flight/make_dumps.py), rank r on node `n<r+1>`.
pub(crate) fn real(scenario: &str) -> Vec<RankDump> {
    (0..3)
        .filter_map(|r| {
            let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("tests/flight/{scenario}/fr_{r}"));
            let b = std::fs::read(&p).ok()?;
            Some(RankDump {
                rank: r,
                node: Some(format!("n{}", r + 1)),
                path: format!("/tmp/fr_{r}"),
                dump: view::of(&pickle::decode(&b).unwrap()).unwrap(),
            })
        })
        .collect()
}

fn node(r: u32) -> Option<String> {
    Some(format!("n{}", r + 1))
}

#[test]
fn the_rank_that_never_joined_the_collective_is_named_with_its_last_entry() {
    let f = judge(&real("stopped"), &[], Some(3)).unwrap();
    assert_eq!(f.kind, Some(Kind::CpuSide));
    assert_eq!(
        (f.ranks.clone(), f.entered.clone(), f.seq),
        (vec![1], vec![0, 2], Some(6))
    );
    assert_eq!(f.op.as_deref(), Some("gloo:all_reduce"));
    let h = f.hang(&node);
    let s = h.sentence(&node);
    assert!(
        s.starts_with(
            "rank 1 on n2 stopped first: it never enqueued collective 6 (gloo:all_reduce, PG 0)"
        ),
        "{s}"
    );
    assert!(s.contains("rank 1's Flight Recorder dump ends at collective 5 (gloo:all_reduce, scheduled) while ranks 0, 2 entered collective 6"), "{s}");
    // Without rank 1's dump: nothing to compare, rank 1 said as missing.
    let two: Vec<RankDump> = real("stopped")
        .into_iter()
        .filter(|d| d.rank != 1)
        .collect();
    let f = judge(&two, &[(1, "no_file".into())], Some(3)).unwrap();
    assert_eq!(f.kind, None);
    let s = f.hang(&node).sentence(&node);
    assert!(s.contains("no Flight Recorder dump from rank 1 (n2: no_file): a rank that never dumped is often the stopped one (a hint, not proof)"), "{s}");
}

#[test]
fn one_collective_of_different_sizes_is_the_jobs_code_and_the_silent_rank_is_said() {
    let f = judge(&real("mismatch"), &[], Some(3)).unwrap();
    assert_eq!(
        (f.kind, f.seq, f.ranks.clone()),
        (Some(Kind::Mismatch), Some(4), vec![0, 2])
    );
    let s = f.hang(&node).sentence(&node);
    assert!(s.contains("the ranks disagree on collective 4"), "{s}");
    assert!(
        s.contains(
            "rank 0 gloo:all_reduce of [[1024]] Float, rank 2 gloo:all_reduce of [[512]] Double"
        ),
        "{s}"
    );
    assert!(
        s.contains("no Flight Recorder dump from rank 1 (n2: no bundle read it)"),
        "{s}"
    );
}

/// Rank 1 stopped before group 1's broadcast 3; rank 0 waits in it, so it lags in the
/// default group too: the rank that stopped is named, not the one waiting elsewhere.
#[test]
fn with_two_groups_the_rank_waiting_elsewhere_is_not_the_one_named() {
    let ds = real("two_pgs");
    assert!(
        ds[0].dump.entries.iter().all(|e| !e.frames.is_empty()),
        "stack traces kept"
    );
    let f = judge(&ds, &[], Some(3)).unwrap();
    assert_eq!(
        (f.kind, f.pg.as_str(), f.seq, f.ranks.clone()),
        (Some(Kind::CpuSide), "1", Some(3), vec![1])
    );
    assert_eq!(f.op.as_deref(), Some("gloo:broadcast"));
}

/// gloo records no send/recv in its Flight Recorder: rank 1 blocked before a recv and rank
/// 0 in its send both lack the next all_reduce that rank 2 entered.
#[test]
fn point_to_point_ops_are_not_in_glogs_records() {
    let ds = real("p2p");
    assert!(ds.iter().all(|d| d
        .dump
        .entries
        .iter()
        .all(|e| e.profiling_name.contains("all_reduce"))));
    let f = judge(&ds, &[], Some(3)).unwrap();
    assert_eq!(
        (f.ranks.clone(), f.seq, f.entered.clone()),
        (vec![0, 1], Some(5), vec![2])
    );
}

#[test]
fn one_dump_and_no_world_say_nothing() {
    let one: Vec<RankDump> = real("stopped").into_iter().take(1).collect();
    assert!(judge(&one, &[], None).is_none());
    assert!(judge(&[], &[], Some(3)).is_none());
}

/// gloo's dumps (torch 2.15) leave every entry `scheduled`: no rank's waiting group is said
/// from them. With the states NCCL's dumps record (made here on the same dumps: no GPU run
/// yet), each rank's group is the one of its oldest unfinished collective, and a rank with
/// nothing in flight has none; the stacks are grouped by them for the ranks whose watchdog
/// lines name no group.
#[test]
fn the_group_a_rank_waits_in_is_read_only_from_a_dump_that_records_completion() {
    let mut ds = real("two_pgs");
    assert!(pg_of_ranks(&ds).is_empty());
    // As NCCL would: rank 0 waits in group 1's broadcast 3, rank 2 in the default group's
    // all_reduce 4, rank 1 (stopped in Python) finished all it entered.
    let waiting = [(0, "1", 3), (2, "0", 4)];
    for d in &mut ds {
        for e in &mut d.dump.entries {
            let w = waiting.iter().any(|(r, pg, s)| {
                *r == d.rank && e.pg_name == *pg && e.collective_seq_id == Some(*s)
            });
            e.state = if w { "started" } else { "completed" }.into();
        }
    }
    let got = pg_of_ranks(&ds);
    assert_eq!(
        got.into_iter().collect::<Vec<_>>(),
        vec![(0, "1".to_string()), (2, "0".to_string())]
    );
    // A rank's own watchdog line wins; a rank without one (rank 0 here) takes its dump's
    // group, by the entry's `pg_id` (torch's local id, a watchdog line's `PG ID`).
    let lines = [("0".to_string(), 2)];
    let (pg, from) = crate::report::detect::rank_pgs(lines.iter(), &ds);
    assert_eq!(
        (
            pg.get(&0).cloned().flatten(),
            pg.get(&1).cloned().flatten(),
            pg.get(&2).cloned().flatten(),
            from
        ),
        (
            Some("1".into()),
            None,
            Some("0".into()),
            crate::report::detect::PG_FROM_BOTH
        )
    );
    // Every rank's line names its group: the lines', whatever the dumps say.
    let lines = [("3".to_string(), 0), ("4".to_string(), 2)];
    let (pg, from) = crate::report::detect::rank_pgs(lines.iter(), &ds);
    assert_eq!(pg.get(&0).cloned().flatten(), Some("3".into()));
    assert_eq!(pg.get(&1), None);
    assert_eq!(from, crate::report::detect::PG_FROM_WATCHDOG);
    // An entry with no creation time is never taken as the oldest.
    for e in &mut ds[0].dump.entries {
        if e.pg_name == "0" && e.collective_seq_id == Some(3) {
            e.state = "started".into();
            e.time_created_ns = None;
        }
    }
    assert_eq!(pg_of_ranks(&ds).get(&0).map(String::as_str), Some("1"));
}
