//! Whole incidents (issue 24): multi-line excerpts that people pasted into public threads,
//! each with the cause the thread established and its URL (tests/corpus/incidents/NNN.log).
//! Each excerpt is read as the session reads a job's output (`LineReader`: NaN scanner,
//! failure classifier with its traceback state), one line every 0.2 s, on a node whose kernel
//! log and NVML were watched and silent (what a pasted log cannot tell: nantrace is asked only
//! to read the log right). The verdict's family is scored against the thread's cause, per
//! incident, in three parts scored on their own (`PARTS`): held-out excerpts were never read
//! while the rules were built. Not privileged: pure analysis.
mod common;

use std::collections::BTreeMap;

use nantrace::session::LineReader;
use serde_json::json;

struct Incident {
    file: String,
    source: String,
    cause: String,
    /// Whether the thread established a fault of the machine (hardware, network, storage,
    /// the node's memory).
    machine: bool,
    lines: Vec<String>,
    /// The rank(s) the thread established as the one that stopped (hang collection only).
    lagging: Option<String>,
}

fn corpus() -> Vec<Incident> {
    corpus_in("tests/corpus/incidents")
}

fn corpus_in(sub: &str) -> Vec<Incident> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(sub);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            let head = |k: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("# {k}: ")))
                    .unwrap_or("")
                    .trim()
                    .to_string()
            };
            Incident {
                file: p.file_name().unwrap().to_string_lossy().into_owned(),
                source: head("source"),
                cause: head("cause"),
                machine: head("machine") == "yes",
                lagging: Some(head("lagging_rank")).filter(|r| !r.is_empty() && r != "unknown"),
                lines: text
                    .lines()
                    .filter(|l| !l.starts_with("# "))
                    .map(String::from)
                    .collect(),
            }
        })
        .collect()
}

/// The verdict's family for a cause the thread established.
fn expected(cause: &str) -> &'static [&'static str] {
    match cause {
        "gpu_hw" => &["GPU"],
        "network" => &["network"],
        "storage" => &["storage"],
        "host_memory" => &["host memory"],
        "gpu_oom" => &["GPU memory limit"],
        "software" => &["software/configuration", "job processes"],
        "numerics" => &["numerics", "none"],
        "hang" => &["collective hang", "network"],
        _ => &[],
    }
}

/// The timeline a node would have recorded for this output: the kernel and NVML watched.
fn analyse(inc: &Incident) -> nantrace::report::Analysis {
    let (t, snapshot) = bundle_of(inc);
    nantrace::report::analyze(&t, &snapshot)
}

/// The timeline and snapshot of an excerpt, as a session would have written them.
fn bundle_of(inc: &Incident) -> (serde_json::Value, serde_json::Value) {
    let mut reader = LineReader::new(nantrace::nanscan::Scanner::default());
    let mut events = Vec::new();
    let mut first_nan = None;
    for (i, line) in inc.lines.iter().enumerate() {
        let t = i as f64 * 0.2;
        let l = reader.read(line);
        let mut e =
            json!({ "offset_s": t, "source": "log", "pid": 4242, "job": true, "line": line });
        if let Some(f) = &l.fault {
            e["fault"] = serde_json::to_value(f).unwrap();
        }
        if let Some(s) = l.step {
            e["step"] = json!(s);
        }
        if let Some(v) = l.loss {
            e["loss"] = if v.is_finite() {
                json!(v)
            } else {
                json!("NaN")
            };
        }
        if l.nonfinite {
            e["nonfinite"] = json!(true);
            first_nan.get_or_insert((t, line.clone()));
        }
        events.push(e);
    }
    let end = inc.lines.len() as f64 * 0.2;
    let (ref_off, trigger) = match &first_nan {
        Some((t, _)) => (*t, json!({ "kind": "nan", "time": "2026-12-01T10:00:00Z" })),
        None => (
            end,
            json!({ "kind": "exit", "time": "2026-12-01T10:00:00Z", "reason": "the job exited with code 1" }),
        ),
    };
    for e in &mut events {
        e["offset_s"] = json!(e["offset_s"].as_f64().unwrap() - ref_off);
    }
    let t = json!({
        "schema": "nantrace.timeline/1",
        "first_nan": first_nan.map(|(_, l)| json!({ "offset_s": 0.0, "time": "2026-12-01T10:00:00Z", "line": l })),
        "trigger": trigger,
        "job": { "root_pid": 4242, "exit_code": 1 },
        "window": { "pre_s": 600.0 },
        "accounting": { "probes_attached": ["printk:console", "sched:sched_process_exit", "tcp:tcp_retransmit_skb", "block:block_rq_complete"], "events": {} },
        "events": events,
    });
    let snapshot = json!({ "gpu": { "available": true, "device_count": 8, "devices": [] } });
    (t, snapshot)
}

/// Golden outputs (issue 32, `golden.rs`): every excerpt's report.md as recorded in
/// `tests/golden/incidents/`, so that a reshaping that changes a verdict or its wording on a
/// real failure shows here.
#[test]
fn every_excerpts_report_is_as_recorded() {
    let mut bad = common::golden::Mismatches::default();
    for part in ["incidents", "hangs"] {
        for inc in corpus_in(&format!("tests/corpus/{part}")) {
            let (t, snapshot) = bundle_of(&inc);
            let a = nantrace::report::analyze(&t, &snapshot);
            let stem = inc.file.trim_end_matches(".log");
            bad.check(
                &format!("{part}/{stem}.md"),
                &nantrace::report::markdown(&a, &t),
            );
        }
    }
    bad.assert();
}

#[test]
fn whole_incidents_are_read_for_their_cause() {
    let all = corpus();
    assert!(
        all.len() >= 40,
        "the whole-incident corpus has {} excerpts, fewer than 40",
        all.len()
    );
    // Per (part, cause): (the machine question right, the family right, incidents).
    let mut per: BTreeMap<(usize, String), (usize, usize, usize)> = BTreeMap::new();
    let mut wrong = Vec::new();
    for inc in &all {
        assert!(
            inc.source.starts_with("https://"),
            "{}: no source URL",
            inc.file
        );
        let want = expected(&inc.cause);
        assert!(
            !want.is_empty(),
            "{}: unknown cause {:?}",
            inc.file,
            inc.cause
        );
        let a = analyse(inc);
        // `INCIDENT_SHOW=041 cargo test --test incidents -- --nocapture`: one incident's reading.
        if std::env::var("INCIDENT_SHOW").is_ok_and(|v| inc.file.starts_with(&v)) {
            eprintln!(
                "{}: {}\n{:#?}\n{:#?}",
                inc.file,
                a.verdict,
                a.order,
                a.suspects.iter().map(|s| &s.text).collect::<Vec<_>>()
            );
        }
        let family = a
            .family
            .trim_end_matches(nantrace::report::rules::JOB_WORDS_SUFFIX)
            .to_string();
        // "Was it the machine?": POSSIBLY/PROBABLY for a machine cause, NOT THE MACHINE for
        // the job's own (UNDECIDED and CANNOT TELL answer neither).
        let blames = a.verdict.starts_with("PROBABLY THE MACHINE")
            || a.verdict.starts_with("POSSIBLY THE MACHINE");
        let clears = a.verdict.starts_with("NOT THE MACHINE");
        let machine_ok = if inc.machine { blames } else { clears };
        let family_ok = want.contains(&family.as_str());
        let n = inc
            .file
            .get(..3)
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0);
        let part = part_of(n);
        let e = per.entry((part, inc.cause.clone())).or_default();
        e.0 += usize::from(machine_ok);
        e.1 += usize::from(family_ok);
        e.2 += 1;
        if !(machine_ok && family_ok) {
            wrong.push(format!(
                "{}{} [{}, machine: {}] {}{} got {family:?}: {} ({})",
                inc.file,
                PART_MARK[part],
                inc.cause,
                inc.machine,
                if machine_ok { "" } else { "MACHINE WRONG, " },
                if family_ok { "" } else { "family wrong" },
                a.verdict.chars().take(200).collect::<String>(),
                inc.source
            ));
        }
    }
    for (p, name) in PARTS.iter().enumerate() {
        let (m, f, n) = per
            .iter()
            .filter(|((h, _), _)| *h == p)
            .fold((0, 0, 0), |acc, (_, v)| {
                (acc.0 + v.0, acc.1 + v.1, acc.2 + v.2)
            });
        eprintln!("{name}: was it the machine {m}/{n} right, the cause's family {f}/{n}");
        for ((h, cause), (m, f, n)) in &per {
            if *h == p {
                eprintln!("  {cause:<12} machine {m}/{n}, family {f}/{n}");
            }
        }
    }
    for w in &wrong {
        eprintln!("MISS {w}");
    }
    let (machine, family, total) = per
        .values()
        .fold((0, 0, 0), |acc, v| (acc.0 + v.0, acc.1 + v.1, acc.2 + v.2));
    // The floors this corpus is held to (measured when it was added, docs/log-formats.md): a
    // regression below them fails; every miss is printed with its verdict and its thread.
    assert!(
        machine * 100 >= total * MACHINE_FLOOR_PCT,
        "was it the machine: {machine}/{total} right, under {MACHINE_FLOOR_PCT}%:\n{}",
        wrong.join("\n")
    );
    assert!(
        family * 100 >= total * FAMILY_FLOOR_PCT,
        "the cause's family: {family}/{total} right, under {FAMILY_FLOOR_PCT}%:\n{}",
        wrong.join("\n")
    );
}

/// The corpus's parts: 001-040 collected on 2026-12-01 (evening) by an independent collector,
/// a quarter of them (NNN divisible by 4) never read while the rules were built; 041-054
/// collected on 2026-12-01 (night) by another, after that session's rules, and scored once.
const PARTS: [&str; 3] = [
    "001-040, the rest",
    "001-040, held out (NNN divisible by 4)",
    "041-054, the second collection (unseen until scored)",
];
const PART_MARK: [&str; 3] = ["", " (held out)", " (second collection)"];

fn part_of(n: u32) -> usize {
    if n >= 41 {
        2
    } else if n.is_multiple_of(4) {
        1
    } else {
        0
    }
}

/// The lowest shares of whole incidents read right that the suite accepts.
const MACHINE_FLOOR_PCT: usize = 70;
const FAMILY_FLOOR_PCT: usize = 60;

/// The hang collection (tests/corpus/hangs, README.md there): gathered on 2026-12-02 by an
/// independent collector after the watchdog-counter reading was built (docs/hangs.md), blind
/// to the code, and scored once that day: the machine question, the cause's family, and, where
/// the thread established the rank that stopped, whether the verdict names it. The floors are
/// that first score rounded down.
/// One hang collection scored: (was it the machine, the family, the rank named, incidents
/// whose thread established the rank, incidents), each line printed.
fn score_hangs(dir: &str) -> (usize, usize, usize, usize, usize) {
    let all = corpus_in(dir);
    let (mut machine, mut family, mut ranks, mut with_rank) = (0, 0, 0, 0);
    for inc in &all {
        let a = analyse(inc);
        let fam = a
            .family
            .trim_end_matches(nantrace::report::rules::JOB_WORDS_SUFFIX)
            .to_string();
        let blames = a.verdict.starts_with("PROBABLY THE MACHINE")
            || a.verdict.starts_with("POSSIBLY THE MACHINE");
        let m = if inc.machine {
            blames
        } else {
            a.verdict.starts_with("NOT THE MACHINE")
        };
        let f = expected(&inc.cause).contains(&fam.as_str());
        let r = inc.lagging.as_ref().map(|want| {
            let named = want.split(',').all(|w| {
                let w = w.trim();
                a.verdict.contains(&format!("rank {w} "))
                    || a.verdict.contains(&format!("ranks {w},"))
            });
            named && (a.verdict.contains("stopped first") || a.verdict.contains("printed nothing"))
        });
        machine += usize::from(m);
        family += usize::from(f);
        if let Some(r) = r {
            with_rank += 1;
            ranks += usize::from(r);
        }
        eprintln!(
            "{} {} [{}, machine: {}, rank {}] {}: {} ({})",
            if m && f && r != Some(false) {
                "OK  "
            } else {
                "MISS"
            },
            inc.file,
            inc.cause,
            inc.machine,
            inc.lagging.as_deref().unwrap_or("unknown"),
            if r == Some(false) {
                "rank not named"
            } else {
                ""
            },
            a.verdict.chars().take(240).collect::<String>(),
            inc.source
        );
    }
    let n = all.len();
    eprintln!("hang collection {dir}: was it the machine {machine}/{n}, the family {family}/{n}, the rank named {ranks}/{with_rank}");
    (machine, family, ranks, with_rank, n)
}

#[test]
fn the_hang_collection_is_read_for_its_cause_and_its_rank() {
    let (machine, family, ranks, with_rank, n) = score_hangs("tests/corpus/hangs");
    assert!(n >= 10, "{n} hang incidents");
    assert!(machine * 100 >= n * HANG_MACHINE_FLOOR_PCT, "{machine}/{n}");
    assert!(family * 100 >= n * HANG_FAMILY_FLOOR_PCT, "{family}/{n}");
    assert!(
        ranks * 100 >= with_rank * HANG_RANK_FLOOR_PCT,
        "{ranks}/{with_rank}"
    );
}

/// The second hang collection (tests/corpus/hangs2, README.md there): gathered on 2026-12-04
/// by another independent collector after the gloo, Flight Recorder and real-job work of
/// that day, blind to the code, and scored once (`HANG2_*`, docs/hangs.md).
#[test]
fn the_second_hang_collection_is_read_for_its_cause() {
    let (machine, family, ranks, with_rank, n) = score_hangs("tests/corpus/hangs2");
    assert!(n >= 5, "{n} hang incidents");
    assert!(
        machine * 100 >= n * HANG2_MACHINE_FLOOR_PCT,
        "{machine}/{n}"
    );
    assert!(family * 100 >= n * HANG2_FAMILY_FLOOR_PCT, "{family}/{n}");
    assert!(
        ranks * 100 >= with_rank * HANG_RANK_FLOOR_PCT,
        "{ranks}/{with_rank}"
    );
}

/// The hang collection's first score (2026-12-02 16:10: the machine 4/10, the family 3/10,
/// the rank named 0/3), rounded down (docs/hangs.md). The machine's floor lowered to 30 on
/// 2026-12-05: 003 (only the watchdog's C++ frames) was right by accident, NOT THE MACHINE
/// with "look at the model side" for a hang; it is read as the collective hang it is now
/// (UNDECIDED on one node's lines, as 001 and 002), which the score counts as wrong.
const HANG_MACHINE_FLOOR_PCT: usize = 30;
const HANG_FAMILY_FLOOR_PCT: usize = 30;
const HANG_RANK_FLOOR_PCT: usize = 0;
/// The second collection's first score (2026-12-04 20:50: the machine 2/5, the family 2/5,
/// no thread established the rank), rounded down (docs/hangs.md).
const HANG2_MACHINE_FLOOR_PCT: usize = 40;
const HANG2_FAMILY_FLOOR_PCT: usize = 40;
