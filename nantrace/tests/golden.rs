//! Golden outputs (issue 32): what nantrace renders from frozen inputs, byte for byte as
//! recorded in `tests/golden/`, except what `normalize` lists (the checkout's path, which
//! changes with the clone). The inputs: the recorded multi-node incident
//! (`data/demo-multinode`, six node bundles of three VMs) and its job report (job-report.html
//! by its text), and the whole-incident corpus (`tests/corpus/incidents`, in `incidents.rs`).
//! A reshaping must leave every file as it is; a change meant to change a report records them
//! again with `NANTRACE_GOLDEN=update cargo test -p nantrace --test golden --test incidents`,
//! and the diff of `tests/golden/` is part of the commit.
mod common;

use std::path::{Path, PathBuf};

use common::golden::Mismatches;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/demo-multinode")
}

/// Every node bundle's report.md, report.txt, report.html (its text) and trace.json, rendered
/// again from its timeline and snapshot as `nantrace report --write` would.
#[test]
fn the_recorded_node_bundles_render_as_recorded() {
    let mut bad = Mismatches::default();
    for node in ["n1", "n1-2", "n2", "n2-2", "n3", "n3-2"] {
        let dir = data().join(node);
        let (a, t, snap) = nantrace::report::for_bundle(&dir).expect("a recorded bundle");
        bad.check(
            &format!("multinode/{node}/report.md"),
            &nantrace::report::markdown(&a, &t),
        );
        for (name, bytes) in nantrace::export::derived(&t, &snap).run().1 {
            bad.check_file(&format!("multinode/{node}/{name}"), name, &bytes);
        }
    }
    bad.assert();
}

/// The job report over the six bundles: Markdown, JSON, the merged trace, and
/// job-report.html's text.
#[test]
fn the_recorded_job_report_renders_as_recorded() {
    let mut bad = Mismatches::default();
    let (r, merged, nodes) = nantrace::jobreport::from_dir(&data()).expect("the recorded job");
    bad.check(
        "multinode/job-report.md",
        &nantrace::jobreport::markdown(&r),
    );
    bad.check(
        "multinode/job-report.json",
        &serde_json::to_string_pretty(&r).unwrap(),
    );
    bad.check_file(
        "multinode/trace.json",
        "trace.json",
        &serde_json::to_vec(&nantrace::export::perfetto::merged(&merged, &nodes)).unwrap(),
    );
    bad.check(
        "multinode/job-report.html.txt",
        &common::golden::html_text(&nantrace::export::jobhtml::render(&r, &merged)),
    );
    bad.assert();
}

/// Summaries of new agents beside bundles of older ones (issue 33): one dump of each of the
/// three recorded nodes, copied; the job report with no summary, then with summary.json
/// written into two of the three (the third is an older agent's bundle): the same report,
/// and the quiet nodes among the two read from their summaries.
#[test]
fn summaries_beside_bundles_without_one_give_the_same_job_report() {
    let tmp = std::env::temp_dir().join(format!("nantrace-golden-mixed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    for node in ["n1", "n2-2", "n3"] {
        let to = tmp.join(node);
        std::fs::create_dir_all(&to).unwrap();
        for f in ["timeline.json", "snapshot.json"] {
            std::fs::copy(data().join(node).join(f), to.join(f)).unwrap();
        }
    }
    let before = nantrace::jobreport::from_dir(&tmp)
        .expect("the copied job")
        .0;
    assert_eq!(before.from_summaries, 0);
    let only = tmp.join("only");
    std::fs::create_dir_all(&only).unwrap();
    for node in ["n2-2", "n3"] {
        std::fs::rename(tmp.join(node), only.join(node)).unwrap();
    }
    nantrace::cmd::report::write_summaries(&only).unwrap();
    for node in ["n2-2", "n3"] {
        assert!(
            only.join(node).join("summary.json").is_file(),
            "{node}'s summary"
        );
        std::fs::rename(only.join(node), tmp.join(node)).unwrap();
    }
    std::fs::remove_dir(&only).unwrap();
    // The large-job path (summaries are read past 16 nodes) on these three.
    let after = nantrace::jobreport::from_dir_past(&tmp, 0)
        .expect("the job with two summaries")
        .0;
    let _ = std::fs::remove_dir_all(&tmp);
    assert_eq!(
        serde_json::to_value(&before).unwrap(),
        serde_json::to_value(&after).unwrap(),
        "summaries beside bundles without one changed the job report"
    );
    // n3 dumped on n1's marker with nothing of its own: quiet; n2-2 has its own lines.
    assert_eq!(
        after.from_summaries, 1,
        "the quiet node read from its summary"
    );
}

/// The checker checks: a changed byte is a mismatch, and says where.
#[test]
fn a_changed_rendering_is_a_mismatch() {
    if std::env::var("NANTRACE_GOLDEN").is_ok_and(|v| v == "update") {
        return;
    }
    let mut bad = Mismatches::default();
    let want = std::fs::read_to_string(common::golden::dir().join("multinode/job-report.md"))
        .expect("recorded");
    bad.check("multinode/job-report.md", &want.replacen("n2", "n9", 1));
    assert_eq!(bad.0.len(), 1, "{:?}", bad.0);
    assert!(bad.0[0].contains("line "), "{:?}", bad.0);
}
