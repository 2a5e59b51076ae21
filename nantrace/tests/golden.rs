//! Golden outputs (issue 32): what nantrace renders from frozen inputs, byte for byte as
//! recorded in `tests/golden/`, except what `normalize` lists (the checkout's path, which
//! changes with the clone). The inputs: the recorded multi-node incident
//! (`data/demo-multinode`, six node bundles of three VMs) and its job report, and the
//! whole-incident corpus (`tests/corpus/incidents`, in `incidents.rs`). A reshaping must leave
//! every file as it is; a change meant to change a report records them again with
//! `NANTRACE_GOLDEN=update cargo test -p nantrace --test golden --test incidents`, and the
//! diff of `tests/golden/` is part of the commit.
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

/// The job report over the six bundles: Markdown, JSON, and the merged trace.
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
    bad.assert();
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
