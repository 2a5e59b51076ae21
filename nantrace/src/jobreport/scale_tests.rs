//! The job report read as large jobs are: from bundles on disk one node at a time, with
//! events let go and quiet nodes read from their summaries (the differential test every
//! job-report test goes through, `report`), and what finding and reading bundles must refuse.
use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

use super::tests::{at, healthy, nan_line, node, xid, T0};
use super::*;

pub(super) fn report(mut nodes: Vec<Node>) -> JobReport {
    let written = streamed(&nodes);
    if written.is_some() {
        // `from_dir` reads the hosts in name order (ties between equal times follow it).
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
    }
    let merged = crate::merge::merge(&mut nodes);
    let r = build(&merged, &nodes);
    if let Some(streamed) = written {
        assert_eq!(comparable(&r), streamed, "the job report read from bundles on disk, one node at a time, differs from the one with every node in memory");
    }
    r
}

thread_local! {
    /// Nodes the differential test read from their summaries, in this test's last report.
    pub(super) static SUMMARISED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The report's JSON without the bundles' paths (the bundles on disk lie elsewhere).
fn comparable(r: &JobReport) -> Value {
    let mut v = serde_json::to_value(r).unwrap();
    for n in v["nodes"].as_array_mut().unwrap() {
        n["bundle"] = Value::Null;
    }
    v
}

/// The nodes written as bundles (each host once) and read back by `from_dir`: with every
/// node's samples kept and with the samples let go after each node's part, the same report
/// (the differential test of the streamed job report, on every test of this file).
fn streamed(nodes: &[Node]) -> Option<Value> {
    let hosts: BTreeSet<&str> = nodes
        .iter()
        .filter_map(|n| n.timeline["host"]["hostname"].as_str())
        .collect();
    if hosts.len() != nodes.len() {
        return None;
    }
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "nantrace-jobreport-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for n in nodes {
        let d = dir.join(n.timeline["host"]["hostname"].as_str().unwrap());
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("timeline.json"),
            crate::merge::timeline_bytes(&n.timeline).unwrap(),
        )
        .unwrap();
        std::fs::write(
            d.join("snapshot.json"),
            serde_json::to_vec(&n.snapshot).unwrap(),
        )
        .unwrap();
    }
    let (whole_r, whole_merged, _) = super::load::from_dir_using(&dir, usize::MAX, false).unwrap();
    let (thin_r, thin_merged, _) = super::load::from_dir_using(&dir, 0, false).unwrap();
    // With the samples let go, the named node's come back (its counters in the trace).
    let samples = |m: &Value, node: &str| {
        m["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["node"] == node && e["source"] == "gpu")
            .count()
    };
    if let Some(named) = &whole_r.node {
        assert_eq!(samples(&thin_merged, named), samples(&whole_merged, named));
    }
    let (whole, thin) = (comparable(&whole_r), comparable(&thin_r));
    assert_eq!(
        whole, thin,
        "letting each node's samples go after its part changed the job report"
    );
    // Each node's summary as its dump writes it, from what the dump analysed.
    for n in nodes {
        let d = dir.join(n.timeline["host"]["hostname"].as_str().unwrap());
        let (t, snapshot) = crate::bundle::load(&d).unwrap();
        let a = crate::report::analyze(&t, &snapshot);
        let mut s = super::summary::of(&t, &snapshot, &a);
        s["timeline"] =
            json!({ "bytes": std::fs::metadata(d.join("timeline.json")).unwrap().len() });
        std::fs::write(d.join("summary.json"), serde_json::to_vec(&s).unwrap()).unwrap();
    }
    let r = super::load::from_dir_using(&dir, 0, true).unwrap().0;
    SUMMARISED.with(|c| c.set(r.from_summaries));
    let summarised = comparable(&r);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        whole, summarised,
        "the job report from the quiet nodes' summaries differs from the one from their timelines"
    );
    Some(whole)
}

/// redteam4 D-9: one bundle's impossible GPU samples (1e6 W) do not make its two healthy
/// peers stand out below half "the median".
#[test]
fn impossible_gpu_samples_are_not_compared() {
    let m = |w: f64| {
        let mut b = BTreeMap::new();
        let view = json!({ "events": (0..10).map(|i| json!({ "offset_s": -(i as f64), "time": at(-(i as f64)), "source": "gpu", "power_w": w })).collect::<Vec<_>>() });
        let gpus = super::buckets::Buckets::of_events(view["events"].as_array().unwrap());
        let rel = |b| super::buckets::start_rel(b, 0.0, T0, 0.0);
        b.extend(super::peers::measures(&view, &gpus, rel));
        b
    };
    let o = outliers(&[
        ("n1".into(), m(250.0)),
        ("n2".into(), m(251.0)),
        ("n3".into(), m(1e6)),
    ]);
    assert!(o.is_empty(), "{o:?}");
    assert!(!m(1e6).contains_key("gpu_power_w_mean"));
    assert_eq!(m(250.0).get("gpu_power_w_mean"), Some(&250.0));
}

/// redteam4 D-8, its cheap part: directories of hard links to one bundle are read once.
#[test]
fn hard_linked_copies_of_a_bundle_are_read_once() {
    let d = std::env::temp_dir().join(format!("nantrace-jobreport-links-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let n = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n1",
    );
    std::fs::create_dir_all(d.join("n1")).unwrap();
    std::fs::write(
        d.join("n1/timeline.json"),
        serde_json::to_vec(&n.timeline).unwrap(),
    )
    .unwrap();
    std::fs::write(
        d.join("n1/snapshot.json"),
        serde_json::to_vec(&n.snapshot).unwrap(),
    )
    .unwrap();
    for i in 0..5 {
        let c = d.join(format!("copy{i}"));
        std::fs::create_dir_all(&c).unwrap();
        std::fs::hard_link(d.join("n1/timeline.json"), c.join("timeline.json")).unwrap();
    }
    let (_, _, nodes) = from_dir(&d).unwrap();
    assert_eq!(nodes.len(), 1);
    assert!(
        nodes[0].timeline.get("bundles").is_none(),
        "one bundle read, not six merged: {:?}",
        nodes[0].timeline.get("bundles")
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bundles_are_found_below_a_job_directory_without_following_links() {
    let d = std::env::temp_dir().join(format!("nantrace-jobreport-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    for h in ["n1", "n2"] {
        std::fs::create_dir_all(d.join("4711/inc-1").join(h)).unwrap();
        std::fs::write(d.join("4711/inc-1").join(h).join("timeline.json"), "{}").unwrap();
    }
    let elsewhere = d.join("elsewhere/n9");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("timeline.json"), "{}").unwrap();
    std::os::unix::fs::symlink(d.join("elsewhere"), d.join("4711/inc-1/link")).unwrap();
    let found = find_bundles(&d.join("4711")).unwrap();
    assert_eq!(found, [d.join("4711/inc-1/n1"), d.join("4711/inc-1/n2")]);
    assert!(is_job_dir(&d.join("4711")));
    assert!(
        !is_job_dir(&d.join("4711/inc-1/n1")),
        "a bundle is not a job directory"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// redteam4 D-3: in an incident of a job directory, a bundle lies under its host's name (its
/// agent put it there): one whose claimed host differs from its directory is not read.
#[test]
fn a_bundle_claiming_another_host_than_its_directory_is_not_read() {
    let d = std::env::temp_dir().join(format!("nantrace-jobreport-bound-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("INCIDENT.json"), "{}").unwrap();
    let put = |dir: &str, host: &str, events: Vec<Value>, nan: bool| {
        let n = node(host, events, 0.0, nan, "n[1-3]");
        std::fs::create_dir_all(d.join(dir)).unwrap();
        std::fs::write(
            d.join(dir).join("timeline.json"),
            serde_json::to_vec(&n.timeline).unwrap(),
        )
        .unwrap();
        std::fs::write(
            d.join(dir).join("snapshot.json"),
            serde_json::to_vec(&n.snapshot).unwrap(),
        )
        .unwrap();
    };
    put(
        "n1",
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        true,
    );
    put("n2", "n2", healthy("n2", false), false);
    put(
        "gpu-node-12",
        "gpu-node-12",
        healthy("gpu-node-12", false),
        false,
    );
    put(
        "gpu-node-12-2",
        "gpu-node-12",
        healthy("gpu-node-12", false),
        false,
    );
    // n3's root writes a bundle claiming n1, with an Xid.
    let mut forged = healthy("n1", false);
    forged.push(xid(
        -3.0,
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python, GPU has fallen off the bus.",
    ));
    put("n3-3", "n1", forged, false);
    // n2's own timeline hard-linked under a name listed before it (`m9`), claiming n2: the
    // refused link does not make n2's own directory "a file already read".
    std::fs::create_dir_all(d.join("m9")).unwrap();
    std::fs::hard_link(d.join("n2/timeline.json"), d.join("m9/timeline.json")).unwrap();
    let (r, _, nodes) = from_dir(&d).unwrap();
    let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(names.contains(&"n2"), "{names:?}");
    assert!(!r.verdict.contains("Xid 79"), "{}", r.verdict);
    let _ = std::fs::remove_dir_all(&d);
}

/// A node whose samples a detector would act on (a swap storm, a disk await of seconds) is
/// not quiet: against the job's reference its detector could see them (review of issue 33).
#[test]
fn a_node_with_samples_a_detector_acts_on_is_not_quiet() {
    let loud = |sample: Value| {
        let t = json!({ "schema": crate::bundle::SCHEMA, "accounting": {}, "events": [
            { "time": at(-90.0), "source": "log", "line": "step 1 | loss 2.0", "loss": 2.0 },
            sample,
        ] });
        let a = crate::report::analyze(&t, &Value::Null);
        super::summary::of(&t, &Value::Null, &a)["own"]["events_not_quiet"].clone()
    };
    let t = at(-90.0);
    assert_eq!(
        loud(
            json!({ "time": t, "source": "system", "swap_in_kb_s": 1.0, "psi_memory_some_avg10": 0.5 })
        ),
        0
    );
    assert_eq!(
        loud(json!({ "time": t, "source": "system", "swap_in_kb_s": 80_000.0 })),
        1
    );
    assert_eq!(
        loud(json!({ "time": t, "source": "system", "psi_memory_some_avg10": 35.0 })),
        1
    );
    assert_eq!(
        loud(
            json!({ "time": t, "source": "disk", "disks": { "sda": { "r_await_ms": 2.0, "w_await_ms": 900.0 } } })
        ),
        1
    );
}

/// A summary's GPU buckets are its node's claim: a mean no GPU reports is not compared (as a
/// timeline's sample is not), a count that overflows saturates, a sum without a count is
/// no bucket.
#[test]
fn a_summarys_impossible_gpu_buckets_are_not_compared() {
    use super::buckets::{Bucket, Buckets};
    let row = |gpu, n: u32, power: f64| Bucket {
        gpu,
        b: 179_600_000,
        n: [n, n, n],
        sum: [
            power * f64::from(n),
            1980.0 * f64::from(n),
            60.0 * f64::from(n),
        ],
        ..Bucket::default()
    };
    let measures = |rows| {
        let mut m = BTreeMap::new();
        Buckets::from_rows(rows).measures(|_| 0.0, &mut m);
        m
    };
    let m = measures(vec![row(0, 10, 650.0), row(1, 10, 1e6)]);
    assert!(!m.contains_key("gpu_power_w_mean"), "{m:?}");
    assert_eq!(m.get("gpu_sm_clock_mhz_mean"), Some(&1980.0));
    let m = measures(vec![
        row(0, u32::MAX, 650.0),
        Bucket {
            b: 179_600_001,
            ..row(0, u32::MAX, 650.0)
        },
    ]);
    assert!(
        m.contains_key("gpu_power_w_mean"),
        "no overflow panic: {m:?}"
    );
    let m = measures(vec![Bucket {
        gpu: 0,
        b: 1,
        n: [0, 0, 0],
        sum: [5e9, 0.0, 0.0],
        ..Bucket::default()
    }]);
    assert!(m.is_empty(), "{m:?}");
}
