//! job-report.html on job reports built as `nantrace report` builds them: the job's words
//! never become markup, the named node stands out, a hang's ranks are listed with where they
//! stood, and a job of a thousand nodes draws a bounded page.
use std::path::PathBuf;

use serde_json::{json, Value};

use crate::merge::Node;

const T0: i128 = 1_796_000_000_000_000_000;

pub(super) fn at(offset_s: f64) -> String {
    crate::clock::rfc3339(T0 + (offset_s * 1e9) as i128)
}

/// A line of the job's output, classified as the session does.
pub(super) fn line(t: f64, text: &str) -> Value {
    let mut l = json!({ "time": at(t), "source": "log", "pid": 100, "job": true, "line": text });
    if let Some(f) = crate::joblog::classify(text) {
        l["fault"] = serde_json::to_value(f).unwrap();
    }
    l
}

fn xid(t: f64) -> Value {
    let text =
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python3, GPU has fallen off the bus.";
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

fn retx(t: f64) -> Value {
    json!({ "time": at(t), "source": "tcp_retransmit", "pid": 0, "saddr": "10.0.0.2", "sport": 40000, "daddr": "10.0.0.1", "dport": 29500, "state": "ESTABLISHED" })
}

/// A node bundle as the job report reads it: its events, its trigger at `trigger_s`, the NaN
/// at 0 on the node that has it, the rank it ran.
pub(super) fn node(name: &str, mut events: Vec<Value>, nan: bool, rank: u64) -> Node {
    events.push(json!({ "time": at(-30.0), "source": "log", "pid": 100, "job": true, "line": "step 1 | loss 2.5", "step": 1, "loss": 2.5 }));
    if nan {
        events.push(json!({ "time": at(0.0), "source": "log", "pid": 100, "job": true, "line": "step 2 | loss nan", "step": 2, "loss": "NaN", "nonfinite": true }));
    }
    events.push(json!({ "time": at(0.5), "source": "trigger", "kind": "job_dump", "reason": "the job's incident" }));
    events.sort_by_key(|e| e["time"].as_str().unwrap_or("").to_string());
    let timeline = json!({
        "schema": crate::bundle::SCHEMA,
        "host": { "hostname": name, "boot_id": format!("boot-{name}") },
        "clock": { "correction_s": 0.0, "uncertainty_s": 0.001 },
        "trigger": { "kind": if nan { "nan" } else { "job_dump" }, "time": at(0.5), "mono_ns": 1000, "reason": "" },
        "first_nan": if nan { json!({ "time": at(0.0), "line": "step 2 | loss nan", "step": 2 }) } else { Value::Null },
        "job": { "root_pid": 100, "identity": { "kind": "slurm", "job_id": "4711", "distributed": { "launcher": "torch", "world_size": 3, "ranks": [{ "pid": 100, "rank": rank }] } } },
        "window": { "pre_s": 300.0 },
        "accounting": { "probes_attached": ["printk:console", "sched:sched_process_exit", "tcp:tcp_retransmit_skb"], "events": {} },
        "events": events,
    });
    let snapshot = json!({
        "gpu": { "available": true, "device_count": 1, "devices": [{ "index": 0, "pci": "0000:3b:00.0", "uuid": format!("GPU-{name}"), "compute_processes": [{ "pid": 100 }] }] },
        "scheduler": { "slurm": { "job_id": "4711", "procid": rank.to_string() } },
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

/// The job report and its page, as `nantrace report --write` makes them.
pub(super) fn page(mut nodes: Vec<Node>) -> (crate::jobreport::JobReport, String) {
    let merged = crate::merge::merge(&mut nodes);
    let r = crate::jobreport::build(&merged, &nodes);
    let html = super::render(&r, &merged);
    (r, html)
}

/// The page's self-containment, as the browser check asserts it too.
pub(super) fn self_contained(html: &str) {
    assert!(html.contains("content=\"default-src 'none'; style-src 'unsafe-inline'"));
    // An attribute, not text that reads like one (text has its quotes escaped).
    for bad in ["<script", " src=\"", " href=\"", "url(", "@import"] {
        assert!(!html.contains(bad), "{bad} in the page");
    }
}

#[test]
fn a_hostile_line_and_host_name_are_text_never_markup() {
    let evil = "RuntimeError: CUDA error: an illegal memory access was encountered <script>alert(1)</script><img src=x onerror=alert(2)>";
    let n1 = node("n1", vec![], true, 0);
    let n2 = node(
        "n2<script>alert(3)</script>",
        vec![line(-1.0, evil)],
        false,
        1,
    );
    let n3 = node("n3\" onmouseover=\"alert(4)", vec![], false, 2);
    let (_, html) = page(vec![n1, n2, n3]);
    self_contained(&html);
    assert!(
        html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "the line, escaped"
    );
    assert!(
        html.contains("n2&lt;script&gt;alert(3)"),
        "the host name, escaped"
    );
    assert!(
        !html.contains("\" onmouseover"),
        "no attribute from a host name"
    );
    assert!(!html.contains("<img"), "no element from a line");
}

#[test]
fn the_named_node_is_highlighted_on_its_lane_and_in_the_table() {
    let n1 = node("n1", vec![], true, 0);
    let n2 = node("n2", vec![xid(-4.0), xid(-3.9)], false, 1);
    let n3 = node("n3", vec![], false, 2);
    let (r, html) = page(vec![n1, n2, n3]);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    self_contained(&html);
    assert!(html.contains(&format!(
        "<div id=\"verdict\" class=\"machine\">{}</div>",
        super::esc(&r.verdict)
    )));
    assert!(
        html.contains("<p id=\"action\">Action: drain n2"),
        "the action on top"
    );
    assert_eq!(
        html.matches("<g class=\"lane").count(),
        3,
        "a lane per node"
    );
    assert_eq!(html.matches("class=\"lane named").count(), 1);
    assert!(html.contains("<g class=\"lane named\" data-node=\"n2\">"));
    assert!(html.contains("<tr class=\"named\"><td>n2</td>"));
    assert!(html.contains("class=\"ev k-gpu\""), "the Xid marked");
    assert!(html.contains("class=\"ev k-nan\""), "the first NaN marked");
    assert_eq!(
        html.matches("class=\"ev k-trigger\"").count(),
        3,
        "each node's trigger"
    );
    assert!(html.contains("first NaN (n1)"), "the reference named");
    assert!(html.contains("Every node with a bundle drawn (3)."));
    assert!(html.contains("<p id=\"clock\">events of different nodes are ordered"));
}

pub(super) const R0: &str = "[rank0]:[E1202 04:54:03.100 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 0] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.";
pub(super) const R0_TIMEOUT: &str = "[rank0]:[E1202 04:54:03.090 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.";
pub(super) const R1: &str = "[rank1]:[E1202 04:54:04.000 ProcessGroupNCCL.cpp:1590] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL work: 41.";
pub(super) const R2: &str = "[rank2]:[E1202 04:54:03.200 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 2] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.";

#[test]
fn a_hangs_ranks_are_listed_with_where_each_stood() {
    let n1 = node("n1", vec![line(-0.3, R0_TIMEOUT), line(-0.2, R0)], false, 0);
    let n2 = node("n2", vec![line(0.2, R1)], false, 1);
    let n3 = node("n3", vec![line(-0.1, R2)], false, 2);
    let (r, html) = page(vec![n1, n2, n3]);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    let h = r.hang.as_ref().expect("the hang's view");
    assert_eq!(h.lagging, vec![(1, Some("n2".to_string()))]);
    assert_eq!(h.ranks[0].rank, 1, "the named rank first");
    let table = &html[html.find("<table id=\"ranks\">").expect("the ranks' table")..];
    let table = &table[..table.find("</table>").unwrap()];
    assert!(
        table.contains("<tr class=\"lagging\"><td class=\"num\">1</td><td>n2</td><td>0</td><td class=\"num\">–</td><td>–</td><td class=\"num\">41</td><td class=\"num\">41</td>"),
        "{table}"
    );
    assert!(
        table.contains("<tr><td class=\"num\">0</td><td>n1</td><td>0</td><td class=\"num\">42</td><td>ALLREDUCE</td><td class=\"num\">42</td><td class=\"num\">41</td>"),
        "{table}"
    );
    assert!(
        table.contains("<td class=\"num\">2</td><td>n3</td>"),
        "{table}"
    );
    assert!(html.contains("collective 42 (ALLREDUCE, PG 0): <b>rank 1 on n2</b>: never enqueued"));
    assert!(html.contains("<g class=\"lane named lagging\" data-node=\"n2\">"));
    assert!(
        html.contains("n2 · rank 1"),
        "the hung rank on its node's lane"
    );
    assert!(
        html.contains("class=\"ev k-hang\""),
        "the watchdog lines marked"
    );
}

#[test]
fn past_the_lane_cap_the_named_node_the_evidence_and_neighbours_are_drawn() {
    const N: usize = 1100;
    let nodes: Vec<Node> = (0..N)
        .map(|i| {
            let name = format!("n{i:04}");
            let ev = match i {
                500 => vec![xid(-4.0)],
                7 | 900 => (0..30).map(|k| retx(-20.0 + f64::from(k) * 0.1)).collect(),
                _ => vec![],
            };
            node(&name, ev, i == 0, i as u64)
        })
        .collect();
    let (r, html) = page(nodes);
    assert_eq!(r.node.as_deref(), Some("n0500"), "{}", r.verdict);
    self_contained(&html);
    assert_eq!(html.matches("<g class=\"lane").count(), super::LANES_MAX);
    assert!(html.contains("<g class=\"lane named\" data-node=\"n0500\">"));
    for n in [
        "n0000", "n0007", "n0900", "n0498", "n0499", "n0501", "n0502",
    ] {
        assert!(html.contains(&format!("data-node=\"{n}\"")), "{n} drawn");
    }
    assert!(
        html.contains(&format!("{} of {N} nodes drawn", super::LANES_MAX)),
        "the page says how many are not drawn"
    );
    assert!(html.contains(&format!("{} not drawn", N - super::LANES_MAX)));
    let rows = html.matches("<tr><td>").count() + html.matches("<tr class=\"named\">").count();
    assert!(rows <= super::ROWS_MAX, "{rows} rows");
    assert!(
        html.contains(&format!("<td>of {N} nodes</td>")),
        "the median over all"
    );
    assert!(
        html.len() < 256 * 1024,
        "a bounded page: {} bytes",
        html.len()
    );
}

#[test]
fn text_is_cut_and_escaped() {
    assert_eq!(super::cut("a<b", 10), "a&lt;b");
    assert_eq!(super::cut("abcdef", 3), "abc…");
    assert_eq!(super::cut("a\u{1b}[31mb", 10), "a[31mb");
}
