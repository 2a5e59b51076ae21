//! The job report on node timelines shaped as bundles write them: the guilty node named, the
//! peers compared, the missing node said, and no machine named where every node is clean.
use std::path::PathBuf;

use super::load::one_per_host;
use super::scale_tests::{report, SUMMARISED};
use super::*;

pub(super) const T0: i128 = 1_796_000_000_000_000_000; // 2026-11-30T..., the job's first NaN

pub(super) fn at(offset_s: f64) -> String {
    crate::clock::rfc3339(T0 + (offset_s * 1e9) as i128)
}

/// Ten minutes of a healthy rank: loss lines (rank 0 only), GPU samples, system samples.
pub(super) fn healthy(name: &str, rank0: bool) -> Vec<Value> {
    let mut ev = Vec::new();
    for i in 0..300 {
        let t = -300.0 + f64::from(i);
        if rank0 {
            ev.push(json!({ "time": at(t), "source": "log", "pid": 100, "job": true, "line": format!("step {i} | loss {:.3}", 2.5 - f64::from(i) / 600.0), "step": i, "loss": 2.5 - f64::from(i) / 600.0 }));
        }
        if i % 5 == 0 {
            ev.push(json!({ "time": at(t + 0.5), "source": "gpu", "gpu": 0, "pci": "0000:3b:00.0", "temp_c": 61, "power_w": 650.0 + f64::from(i % 7), "sm_clock_mhz": 1980, "ecc_corrected_volatile": 0, "pcie_replay": 0 }));
            ev.push(json!({ "time": at(t + 0.3), "source": "system", "mem_available_kb": 20_000_000, "swap_in_kb_s": 0.0, "psi_memory_some_avg10": 0.0, "iowait_pct": 1.0 }));
        }
    }
    ev.push(json!({ "time": at(-200.0), "source": "kmsg", "text": format!("NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.54.15 on {name}"), "pid": 0 }));
    ev
}

pub(super) fn nan_line() -> Value {
    json!({ "time": at(0.0), "source": "log", "pid": 100, "job": true, "line": "step 300 | loss nan", "step": 300, "loss": "NaN", "nonfinite": true })
}

pub(super) fn node(
    name: &str,
    mut events: Vec<Value>,
    trigger_s: f64,
    nan: bool,
    node_list: &str,
) -> Node {
    events.sort_by_key(|e| e["time"].as_str().unwrap_or("").to_string());
    let first_nan = if nan {
        json!({ "time": at(0.0), "line": "step 300 | loss nan", "step": 300 })
    } else {
        Value::Null
    };
    let timeline = json!({
        "schema": crate::bundle::SCHEMA,
        "host": { "hostname": name, "boot_id": format!("boot-{name}") },
        "clock": { "correction_s": 0.0, "uncertainty_s": 0.001 },
        "trigger": { "kind": if nan { "nan" } else { "job_dump" }, "time": at(trigger_s), "mono_ns": 1000 + (trigger_s * 1e9) as i64, "reason": "" },
        "first_nan": first_nan,
        "job": { "root_pid": 100 },
        "window": { "pre_s": 300.0 },
        "accounting": { "probes_attached": ["printk:console", "sched:sched_process_exit", "tcp:tcp_retransmit_skb"], "events": {} },
        "events": events,
    });
    let snapshot = json!({
        "gpu": { "available": true, "device_count": 1, "devices": [{ "index": 0, "pci": "0000:3b:00.0", "uuid": format!("GPU-{name}-0000"), "compute_processes": [{ "pid": 100 }] }] },
        "scheduler": { "slurm": { "job_id": "4711", "node_list": node_list, "procid": if name.ends_with('1') { "0" } else { "1" } } },
    });
    Node {
        name: name.into(),
        dir: PathBuf::from(format!("/jobs/4711/inc/{name}")),
        timeline,
        snapshot,
        correction_s: 0.0,
        uncertainty_s: Some(0.001),
    }
}

pub(super) fn xid(t: f64, text: &str) -> Value {
    let mut e = json!({ "time": at(t), "source": "kmsg", "text": text, "pid": 0, "job": false });
    let c = crate::classify::classify(text).expect("an Xid line");
    e["severity"] = serde_json::to_value(c.severity()).unwrap();
    if let Value::Object(m) = serde_json::to_value(&c).unwrap() {
        for (k, v) in m {
            e[k] = v;
        }
    }
    e["source"] = json!("xid");
    e
}

#[test]
fn an_xid_on_node_2_before_rank_0s_nan_names_node_2_and_its_gpu() {
    let n1 = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-3]",
    );
    let mut e2 = healthy("n2", false);
    e2.push(xid(
        -0.4,
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python, GPU has fallen off the bus.",
    ));
    let n2 = node("n2", e2, 1.2, false, "n[1-3]");
    let n3 = node("n3", healthy("n3", false), 1.3, false, "n[1-3]");
    let r = report(vec![n1, n2, n3]);
    assert!(
        r.verdict
            .starts_with("PROBABLY THE MACHINE (GPU): n2, GPU 0000:3b:00.0 (GPU-n2-0000): "),
        "{}",
        r.verdict
    );
    assert!(r.verdict.contains("Xid 79"), "{}", r.verdict);
    assert!(
        r.verdict.contains("400 ms before the first NaN"),
        "on the job's clock, against rank 0's NaN on n1: {}",
        r.verdict
    );
    assert!(
        r.verdict.contains("2 other nodes clean (n1, n3)"),
        "{}",
        r.verdict
    );
    assert!(r.verdict.contains("Action: drain n2"), "{}", r.verdict);
    assert_eq!(r.node.as_deref(), Some("n2"));
    assert_eq!(r.family, "GPU");
    assert!(r.missing.is_empty(), "{:?}", r.missing);
    assert_eq!(r.jobs, ["4711"]);
    assert!(r.reference.contains("on n1"), "{}", r.reference);
    let md = markdown(&r);
    assert!(md.contains("| n2 | job 4711, procid 1 |"), "{md}");
}

#[test]
fn retransmits_on_one_node_name_it_against_its_peers() {
    let n1 = node("n1", [healthy("n1", true), vec![json!({ "time": at(0.0), "source": "log", "pid": 100, "job": true, "line": "step 300 | loss 1.9" })]].concat(), 0.0, false, "n[1-3]");
    let mut e2 = healthy("n2", false);
    for i in 0..60 {
        e2.push(json!({ "time": at(-30.0 + f64::from(i) * 0.5), "source": "tcp_retransmit", "saddr": "10.0.0.2", "sport": 40000, "daddr": "10.0.0.1", "dport": 29500, "state": "ESTABLISHED", "job": true, "pid": 0 }));
    }
    // Another user's loopback retransmits on n3: never the fabric.
    let mut e3 = healthy("n3", false);
    for i in 0..60 {
        e3.push(json!({ "time": at(-30.0 + f64::from(i) * 0.5), "source": "tcp_retransmit", "saddr": "127.0.0.1", "sport": 5000, "daddr": "127.0.0.1", "dport": 6000, "job": false, "pid": 0 }));
    }
    let r = report(vec![
        n1,
        node("n2", e2, 0.1, false, "n[1-3]"),
        node("n3", e3, 0.2, false, "n[1-3]"),
    ]);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    assert_eq!(r.family, "network", "{}", r.verdict);
    assert!(
        r.verdict
            .contains("n2: tcp retransmits 60, the median of 2 peers is 0"),
        "the peers' comparison supports it: {}",
        r.verdict
    );
    assert_eq!(r.outliers.len(), 1, "{:?}", r.outliers);
    assert!(
        r.verdict
            .starts_with("PROBABLY THE MACHINE (network): n2: ")
            || r.verdict.starts_with("POSSIBLY THE MACHINE (network): n2"),
        "{}",
        r.verdict
    );
    // Only a PROBABLY verdict says to drain.
    assert_eq!(
        r.verdict.starts_with("POSSIBLY"),
        !r.verdict.contains("Action: drain"),
        "{}",
        r.verdict
    );
}

#[test]
fn a_numeric_divergence_with_every_node_clean_is_not_the_machine() {
    let n1 = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-3]",
    );
    let r = report(vec![
        n1,
        node("n2", healthy("n2", false), 0.5, false, "n[1-3]"),
        node("n3", healthy("n3", false), 0.6, false, "n[1-3]"),
    ]);
    assert!(
        r.verdict
            .starts_with("NOT THE MACHINE, as far as nantrace can see: 3 nodes alike"),
        "{}",
        r.verdict
    );
    assert_eq!(r.node, None);
    assert_eq!(r.family, "none");
    assert!(r.outliers.is_empty(), "{:?}", r.outliers);
    // n2 and n3 are quiet: the differential test read them from their summaries (n1 has
    // the NaN line, a line with something to say: read whole) and found the same report.
    assert_eq!(SUMMARISED.with(std::cell::Cell::get), 2);
}

/// Rank 0's NaN ends the job; the other ranks then lose their connection to it and say so:
/// those are consequences, after the cause, and never name a node.
#[test]
fn the_other_ranks_broken_connections_after_the_nan_are_consequences() {
    let n1 = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-3]",
    );
    let mut e2 = healthy("n2", false);
    let line = "rank 1 step 16 | connection to rank 0 lost: ConnectionResetError(104, 'Connection reset by peer')";
    let mut l = json!({ "time": at(0.3), "source": "log", "pid": 100, "job": true, "line": line });
    let f = crate::joblog::classify(line).expect("a network failure line of the job");
    l["fault"] = serde_json::to_value(f).unwrap();
    e2.push(l);
    let r = report(vec![
        n1,
        node("n2", e2, 0.5, false, "n[1-3]"),
        node("n3", healthy("n3", false), 0.6, false, "n[1-3]"),
    ]);
    assert!(
        r.verdict
            .starts_with("NOT THE MACHINE, as far as nantrace can see: 3 nodes alike"),
        "{}",
        r.verdict
    );
    assert!(
        r.verdict
            .contains("After the first NaN, consequences, not the cause: n2: "),
        "{}",
        r.verdict
    );
    assert_eq!(r.node, None);
}

#[test]
fn a_node_without_a_bundle_is_named_and_the_verdict_is_incomplete() {
    let n1 = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-3]",
    );
    let r = report(vec![
        n1,
        node("n2", healthy("n2", false), 0.5, false, "n[1-3]"),
    ]);
    assert_eq!(r.missing, ["n3"]);
    assert!(
        r.verdict.contains("INCOMPLETE: no bundle from n3"),
        "{}",
        r.verdict
    );
    assert!(
        r.verdict.contains("on the 2 nodes seen"),
        "never a plain NOT THE MACHINE with a node missing: {}",
        r.verdict
    );
    assert!(markdown(&r).contains("| n3 | | MISSING: no bundle | |"));
}

#[test]
fn the_job_words_of_one_node_are_at_most_possibly() {
    let n1 = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-2]",
    );
    let mut e2 = healthy("n2", false);
    let line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python, GPU has fallen off the bus.";
    let mut l = json!({ "time": at(-1.0), "source": "log", "pid": 100, "job": true, "line": line });
    if let Some(f) = crate::joblog::classify(line) {
        l["fault"] = serde_json::to_value(f).unwrap();
    }
    e2.push(l);
    let r = report(vec![n1, node("n2", e2, 0.5, false, "n[1-2]")]);
    assert!(
        r.verdict
            .starts_with("POSSIBLY THE MACHINE (GPU), in the job's own words only: n2: "),
        "a job printing a kernel-like line is not the kernel: {}",
        r.verdict
    );
    assert_eq!(
        r.action, None,
        "nothing to drain on the job's words: {}",
        r.verdict
    );
}

#[test]
fn host_lists_expand_as_slurm_writes_them() {
    assert_eq!(
        expand_hostlist("gpu[01-03,07],login1"),
        ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    );
    assert_eq!(expand_hostlist("n[1-2]-ib"), ["n1-ib", "n2-ib"]);
    assert_eq!(expand_hostlist("a[9-11]"), ["a9", "a10", "a11"]);
    assert_eq!(expand_hostlist("x[0-99999999]").len(), MAX_NODES, "bounded");
    assert!(expand_hostlist("bad[").is_empty());
}

#[test]
fn two_nodes_cannot_tell_which_is_odd() {
    let mut a = BTreeMap::new();
    a.insert("tcp_retransmits", 100.0);
    let mut b = BTreeMap::new();
    b.insert("tcp_retransmits", 0.0);
    assert!(outliers(&[("a".into(), a.clone()), ("b".into(), b.clone())]).is_empty());
    let o = outliers(&[("a".into(), a), ("b".into(), b.clone()), ("c".into(), b)]);
    assert_eq!(o.len(), 1);
    assert_eq!(o[0].node, "a");
}

/// A node that dumped twice in one incident (the job-wide dump, then its own NaN) is one node:
/// its NaN is the job's reference, and no `n1#2` appears.
#[test]
fn two_bundles_of_one_node_in_an_incident_are_one_node() {
    let early = node("n1", healthy("n1", true), -3.0, false, "n[1-2]");
    let late = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-2]",
    );
    let mut e2 = healthy("n2", false);
    e2.push(xid(
        -3.4,
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python, GPU has fallen off the bus.",
    ));
    let mut nodes = one_per_host(vec![early, late, node("n2", e2, -3.2, false, "n[1-2]")]);
    assert_eq!(nodes.len(), 2);
    let merged = crate::merge::merge(&mut nodes);
    let r = build(&merged, &nodes);
    assert_eq!(
        r.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        ["n1", "n2"]
    );
    assert!(r.reference.contains("first NaN, on n1"), "{}", r.reference);
    assert!(
        r.verdict
            .starts_with("PROBABLY THE MACHINE (GPU): n2, GPU 0000:3b:00.0"),
        "{}",
        r.verdict
    );
    assert!(
        r.verdict.contains("3.4 s before the first NaN"),
        "{}",
        r.verdict
    );
}

/// A GPU fault in the job's words after the NaN is not explained away as a consequence: the
/// job report never says NOT THE MACHINE while a node's own output names a GPU fault.
#[test]
fn a_gpu_fault_in_the_jobs_words_after_the_nan_is_still_machine_evidence() {
    let n1 = node(
        "n1",
        [healthy("n1", true), vec![nan_line()]].concat(),
        0.0,
        true,
        "n[1-3]",
    );
    let mut e2 = healthy("n2", false);
    let line = "RuntimeError: CUDA error: uncorrectable ECC error encountered";
    let mut l = json!({ "time": at(1.0), "source": "log", "pid": 100, "job": true, "line": line });
    l["fault"] =
        serde_json::to_value(crate::joblog::classify(line).expect("a GPU fault line")).unwrap();
    e2.push(l);
    let r = report(vec![
        n1,
        node("n2", e2, 0.5, false, "n[1-3]"),
        node("n3", healthy("n3", false), 0.6, false, "n[1-3]"),
    ]);
    assert!(
        r.verdict
            .starts_with("POSSIBLY THE MACHINE (GPU), in the job's own words only: n2: "),
        "{}",
        r.verdict
    );
}

/// Node N's port on the job's connections (rank 0, n1, listens on 29500).
fn port(n: u8) -> u16 {
    if n == 1 {
        29500
    } else {
        40000 + u16::from(n)
    }
}

/// A retransmit from `from` to `to` on the job's connection (addresses 10.77.0.1N), at `t`.
fn retx(t: f64, from: u8, to: u8) -> Value {
    json!({ "time": at(t), "source": "tcp_retransmit", "saddr": format!("10.77.0.1{from}"), "sport": port(from), "daddr": format!("10.77.0.1{to}"), "dport": port(to), "state": "ESTABLISHED", "job": false, "pid": 0 })
}

/// The job's sockets on node `me`: to each of `peers`.
fn sockets(n: &mut Node, me: u8, peers: &[u8]) {
    n.snapshot["network"]["job_sockets"] = Value::Array(peers.iter().map(|p| json!({ "pid": 100, "local": format!("10.77.0.1{me}:{}", port(me)), "remote": format!("10.77.0.1{p}:{}", port(*p)), "state": "Established" })).collect());
}

/// Packet loss on n2's link (the VM cluster's packet-loss case): both ends retransmit, rank
/// 0 (n1) more than n2, since its replies go unacknowledged. Counting per node named n1; the
/// links name n2: the lossy link n1–n2 ends at both, but n1's link to n3 stayed clean.
#[test]
fn packet_loss_on_one_nodes_link_names_that_node_not_the_busier_end() {
    let mut e1 = [healthy("n1", true), vec![nan_line()]].concat();
    let mut e2 = healthy("n2", false);
    for i in 0..60 {
        e1.push(retx(-50.0 + f64::from(i) * 0.5, 1, 2));
        if i % 2 == 0 {
            e2.push(retx(-50.0 + f64::from(i) * 0.5, 2, 1));
        }
    }
    let mut n1 = node("n1", e1, 0.0, true, "n[1-3]");
    let mut n2 = node("n2", e2, 0.4, false, "n[1-3]");
    let mut n3 = node("n3", healthy("n3", false), 0.4, false, "n[1-3]");
    // Rank 0 stopped at its NaN before its dump listed its connections: its peers list them.
    sockets(&mut n1, 1, &[]);
    n1.snapshot["network"]["job_sockets"] = json!([{ "pid": 538, "local": "10.77.0.11:42579", "remote": "10.77.0.13:34924", "state": "Established" }]);
    sockets(&mut n2, 2, &[1]);
    sockets(&mut n3, 3, &[1]);
    // Another program's connection between n3 and n1 (slurmd's 6818) retransmitting: not
    // the job's, not a link of it.
    for i in 0..10 {
        n3.timeline["events"].as_array_mut().unwrap().push(json!({ "time": at(-20.0 + f64::from(i)), "source": "tcp_retransmit", "saddr": "10.77.0.13", "sport": 6818, "daddr": "10.77.0.11", "dport": 44342, "job": false, "pid": 0 }));
    }
    let r = report(vec![n1, n2, n3]);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    assert_eq!(r.family, "network", "{}", r.verdict);
    assert!(r.verdict.contains("every lossy link of the job ends at n2 (n1–n2: n1 60, n2 30 retransmits), while the other nodes' links stayed clean (n1–n3)"), "{}", r.verdict);
    // Without the job's sockets there is no telling the ends apart: the count decides, as before.
    let mut e1 = [healthy("n1", true), vec![nan_line()]].concat();
    e1.extend((0..60).map(|i| retx(-50.0 + f64::from(i) * 0.5, 1, 2)));
    let r = report(vec![
        node("n1", e1, 0.0, true, "n[1-3]"),
        node("n2", healthy("n2", false), 0.4, false, "n[1-3]"),
        node("n3", healthy("n3", false), 0.4, false, "n[1-3]"),
    ]);
    assert!(!r.verdict.contains("lossy link"), "{}", r.verdict);
    // A ring: n2's two links lossy, n1–n3 clean: n2 is at the end of every lossy link.
    let mut e1 = [healthy("n1", true), vec![nan_line()]].concat();
    let mut e3 = healthy("n3", false);
    for i in 0..20 {
        e1.push(retx(-50.0 + f64::from(i), 1, 2));
        e3.push(retx(-50.0 + f64::from(i), 3, 2));
    }
    let (mut n1, mut n2, mut n3) = (
        node("n1", e1, 0.0, true, "n[1-3]"),
        node("n2", healthy("n2", false), 0.4, false, "n[1-3]"),
        node("n3", e3, 0.4, false, "n[1-3]"),
    );
    sockets(&mut n1, 1, &[2, 3]);
    sockets(&mut n2, 2, &[1, 3]);
    sockets(&mut n3, 3, &[1, 2]);
    let r = report(vec![n1, n2, n3]);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
}

#[test]
fn a_nodes_ranks_are_said_as_its_bundle_says() {
    let d = json!({ "launcher": "torch", "world_size": 16, "node_rank": 1, "ranks": [{ "pid": 9, "rank": 9 }, { "pid": 8, "rank": 8 }, { "pid": 10, "rank": 10 }] });
    assert_eq!(
        super::ranks_text(&d).as_deref(),
        Some("ranks 8-10 of 16 (torch, node rank 1)")
    );
    assert_eq!(
        super::ranks_text(&json!({ "launcher": "mpi", "ranks": [{ "rank": 0 }, { "rank": 4 }] }))
            .as_deref(),
        Some("ranks 0,4 (mpi)")
    );
    assert_eq!(super::ranks_text(&Value::Null), None);
}

/// The VM cluster's second failure of 12-02: n1 dumped twice into the packet-loss incident,
/// at its NaN (with the job's connections) and at the job's exit (with none left). The
/// newest snapshot alone left n1 without its addresses, and the loss on n2's link was
/// blamed on n1 by the count; both dumps' connections count.
#[test]
fn a_nodes_two_dumps_keep_the_job_sockets_of_either() {
    let lossy = |from: u8, to: u8, every: usize| -> Vec<Value> {
        (0..60)
            .filter(|i| i % every == 0)
            .map(|i| retx(-50.0 + i as f64 * 0.5, from, to))
            .collect()
    };
    let e1 = [healthy("n1", true), vec![nan_line()], lossy(1, 2, 1)].concat();
    let mut at_nan = node("n1", e1.clone(), 0.0, true, "n[1-3]");
    sockets(&mut at_nan, 1, &[2, 3]);
    let mut at_exit = node("n1", e1, 2.0, false, "n[1-3]");
    sockets(&mut at_exit, 1, &[]);
    at_exit.dir = PathBuf::from("/jobs/4711/inc/n1-2");
    let mut n2 = node(
        "n2",
        [healthy("n2", false), lossy(2, 1, 2)].concat(),
        0.4,
        false,
        "n[1-3]",
    );
    sockets(&mut n2, 2, &[1]);
    let mut n3 = node("n3", healthy("n3", false), 0.4, false, "n[1-3]");
    sockets(&mut n3, 3, &[1]);
    let mut nodes = one_per_host(vec![at_nan, at_exit, n2, n3]);
    assert_eq!(nodes.len(), 3);
    assert_eq!(
        nodes[0].snapshot["network"]["job_sockets"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "n1's connections from its first dump"
    );
    let merged = crate::merge::merge(&mut nodes);
    let r = build(&merged, &nodes);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    assert_eq!(r.family, "network", "{}", r.verdict);
}

/// A bundle's snapshot is its node's claim: a later dump whose snapshot (or its network part)
/// is not an object is kept as it is, never indexed into (that panicked).
#[test]
fn a_second_dump_with_a_malformed_snapshot_does_not_panic() {
    for bad in [json!([1, 2]), json!({ "network": "down" }), json!("x")] {
        let e1 = [healthy("n1", true), vec![nan_line()]].concat();
        let mut at_nan = node("n1", e1.clone(), 0.0, true, "n[1-2]");
        sockets(&mut at_nan, 1, &[2]);
        let mut at_exit = node("n1", e1, 2.0, false, "n[1-2]");
        at_exit.snapshot = bad.clone();
        at_exit.dir = PathBuf::from("/jobs/4711/inc/n1-2");
        let n2 = node("n2", healthy("n2", false), 0.4, false, "n[1-2]");
        let mut nodes = one_per_host(vec![at_nan, at_exit, n2]);
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].snapshot, bad, "the newest snapshot kept as it is");
        let merged = crate::merge::merge(&mut nodes);
        let _ = build(&merged, &nodes);
    }
}
