//! A gloo hang across nodes: the ranks' timeout lines carry no counters ("Timed out waiting
//! 3000ms for recv"), and the Flight Recorder dumps each node read say which rank stopped.
use serde_json::{json, Value};

use super::hang_tests::line;
use super::scale_tests::report;
use super::tests::{healthy, node};
use crate::collect::flight::{pickle, view};

const R0: &str = "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete";
const R2: &str = "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to complete";

/// A node's `flight_recorder` section as the dump reads it: torch's own dump of `rank`
/// (tests/flight/<scenario>), or none.
pub(crate) fn section(scenario: &str, rank: u32) -> Value {
    let path = format!("/tmp/fr/fr_{rank}");
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/flight/{scenario}/fr_{rank}"));
    let rec = match std::fs::read(p) {
        Ok(b) => {
            let d = view::of(&pickle::decode(&b).unwrap()).unwrap();
            json!({ "rank": rank, "pid": 100, "status": "read", "path": path, "bytes": b.len(), "dump": d })
        }
        Err(_) => {
            json!({ "rank": rank, "pid": 100, "status": "no_file", "why": format!("no file at {path}") })
        }
    };
    json!({ "sources": [], "read": { "schema": crate::collect::flight::SCHEMA, "ranks_read": 1, "ranks": [rec] } })
}

/// Three nodes of one rank each (n1-n3 for ranks 0-2): rank 0's steps, ranks 0 and 2's gloo
/// timeouts, and each node's Flight Recorder section of `scenario`.
pub(crate) fn job(scenario: &str) -> Vec<super::Node> {
    let names = ["n1", "n2", "n3"];
    (0..3u32)
        .map(|r| {
            let name = names[r as usize];
            let lines = match r {
                0 => vec![line(-0.1, R0)],
                2 => vec![line(0.0, R2)],
                _ => vec![],
            };
            let mut n = node(name, [healthy(name, r == 0), lines].concat(), 0.0, false, "n[1-3]");
            n.timeline["job"]["identity"] = json!({ "kind": "slurm", "job_id": "4711", "distributed": { "launcher": "torch", "world_size": 3, "ranks": [{ "pid": 100, "rank": r }] } });
            n.snapshot["flight_recorder"] = section(scenario, r);
            n
        })
        .collect()
}

/// Rank 1 (n2) stopped before collective 6 and dumped from its own thread: the job report
/// names it and its node from the dumps, and the peers' socket timeouts are consequences.
#[test]
fn the_rank_that_never_joined_is_named_from_the_flight_recorder_with_its_node() {
    let r = report(job("stopped"));
    assert!(
        r.verdict.starts_with("NOT THE MACHINE (software/configuration), most likely: rank 1 on n2 stopped first: it never enqueued collective 6 (gloo:all_reduce, PG 0)"),
        "{}",
        r.verdict
    );
    assert!(r.verdict.contains("rank 1's Flight Recorder dump ends at collective 5 (gloo:all_reduce, scheduled) while ranks 0, 2 entered collective 6)"), "{}", r.verdict);
    assert_eq!(r.node.as_deref(), Some("n2"));
    assert!(!r.verdict.contains("model side"), "{}", r.verdict);
}

/// Rank 1 wrote no dump (gloo aborted it), ranks 0 and 2 disagree on collective 4's size.
#[test]
fn a_size_mismatch_is_the_jobs_code_and_the_rank_without_a_dump_is_said_with_its_node() {
    let r = report(job("mismatch"));
    assert!(r.verdict.starts_with("NOT THE MACHINE (software/configuration): the ranks disagree on collective 4 (gloo:all_reduce, PG 0)"), "{}", r.verdict);
    assert!(
        r.verdict
            .contains("no Flight Recorder dump from rank 1 (n2: no_file)"),
        "{}",
        r.verdict
    );
}

/// job-report.md's ranks' table: the ranks the watchdog lines and the dumps know, the named
/// rank first, each with its dump's last collective and last completed one ("—" where
/// none: torch 2.15's gloo dumps leave every entry `scheduled`), escaped as the table's
/// other cells.
#[test]
fn the_markdown_ranks_table_has_each_ranks_flight_recorder_columns() {
    let r = report(job("stopped"));
    let md = super::markdown(&r);
    let table = &md[md.find("## The hang: where each rank stood").expect(&md)..];
    let table = &table[..table.find("\n\n## ").expect(table)];
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| ")).collect();
    assert_eq!(rows[0], "| rank | node | PG | timed out in | last enqueued | last completed | Flight Recorder: last collective | Flight Recorder: last completed | its line (the job's own words) |");
    assert_eq!(rows.len(), 4, "{table}");
    // The named rank first: no watchdog line, its dump ends at collective 5.
    assert_eq!(
        rows[1],
        "| 1 | n2 | 0 | — | — | — | 5 gloo:all_reduce scheduled | — | — |"
    );
    for (row, rank, node) in [(rows[2], 0, "n1"), (rows[3], 2, "n3")] {
        assert!(
            row.starts_with(&format!(
                "| {rank} | {node} | 0 | — | — | — | 6 gloo:all_reduce scheduled | — | "
            )),
            "{row}"
        );
    }
    // The recorded job: rank 1, named, with no watchdog line and no dump, has its row.
    let d = std::env::temp_dir().join(format!("nt-md-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let inc = crate::demo::multinode::recording("hang")
        .unwrap()
        .write(&d)
        .unwrap();
    let (recorded, _, _) = super::from_dir(&inc).unwrap();
    let _ = std::fs::remove_dir_all(&d);
    let md = super::markdown(&recorded);
    assert!(md.contains("|---|---|---|---|---|---|---|---|---|\n| 1 | n2 | 0 | — | — | — | — | — | — |\n| 0 | n1 | 0 | — | — | — | 6 gloo:all_reduce scheduled | — | \\[rank0\\]: collective 6 failed: "), "{md}");
    // The job's line escaped as the other cells are (`[` opens a link).
    assert!(rows[2].contains("| \\[rank0\\]: RuntimeError: \\[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78\\] Timed out waiting 3000ms for recv operation |"), "{}", rows[2]);
}
