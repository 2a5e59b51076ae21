//! The ranks' lanes of job-report.html: under each node its ranks on the job's clock, each
//! with its last step/loss line, its first watchdog line, its collective and its stack group,
//! the named rank highlighted with its frame, its Flight Recorder dump's last collective as a
//! mark where its node's clock puts it on the job's (or why not); on the recorded real PyTorch
//! hang (loaded in headless chromium too), on a storage variant of it, on torch's own dumps of
//! tests/flight with their times moved or not, on NCCL watchdog lines, on hostile text, and
//! past the cap.
use std::process::Command;

use serde_json::{json, Value};

use super::tests::{line, node, page, self_contained, R0, R0_TIMEOUT, R1, R2};
use crate::jobreport::JobReport;
use crate::merge::Node;

/// The recorded hang (`nantrace demo --scenario hang`) read as `nantrace report` reads it,
/// `patch` applied to its nodes, the report made again from them.
fn recorded_hang(tag: &str, patch: impl Fn(&mut [Node])) -> (JobReport, String) {
    let d = std::env::temp_dir().join(format!("nt-jobhtml-ranks-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let inc = crate::demo::multinode::recording("hang")
        .expect("the hang recording")
        .write(&d)
        .unwrap();
    let (_, merged, mut nodes) = crate::jobreport::from_dir(&inc).unwrap();
    let _ = std::fs::remove_dir_all(&d);
    patch(&mut nodes);
    let r = crate::jobreport::build(&merged, &nodes);
    let html = super::render(&r, &merged);
    (r, html)
}

/// The words and marks of rank `rank`'s lane.
fn words(html: &str, rank: u32) -> &str {
    let at = format!("<g class=\"rank-marks\" data-rank=\"{rank}\">");
    let s = &html[html
        .find(&at)
        .unwrap_or_else(|| panic!("rank {rank}'s lane"))..];
    &s[..s.find("</g>").unwrap()]
}

/// Where `what` is in `html` (it must be there).
fn pos(html: &str, what: &str) -> usize {
    html.find(what)
        .unwrap_or_else(|| panic!("{what} not in the page"))
}

/// `html` in Debian's headless chromium as `tests/report_outputs.rs` loads the pages (no
/// network): the DOM after load and the console's messages. `None` where chromium is not
/// installed (a failure in CI, which installs it).
fn in_chromium(html: &str, tag: &str) -> Option<(String, Vec<String>)> {
    let ok = Command::new("chromium")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is not installed (cargo xtask test installs it)"
        );
        eprintln!("SKIPPED the browser half of the rank lanes' check: chromium not installed");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("nt-chromium-ranks-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("job-report.html");
    std::fs::write(&page, html).unwrap();
    let o = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .args(["--virtual-time-budget=2000", "--dump-dom"])
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let console = String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(String::from)
        .collect();
    Some((String::from_utf8_lossy(&o.stdout).into_owned(), console))
}

#[test]
fn the_recorded_hang_draws_each_rank_under_its_node_with_its_collective_group_and_frame() {
    let (r, html) = recorded_hang("python", |_| {});
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    self_contained(&html);
    assert_eq!(
        html.matches("<g class=\"rank-lane").count(),
        3,
        "a lane per rank"
    );
    // Under each node its rank, on the nodes' clock.
    let order = [
        pos(&html, "<g class=\"lane\" data-node=\"n1\">"),
        pos(&html, "<g class=\"rank-lane\" data-rank=\"0\" data-node=\"n1\" data-group=\"A\">"),
        pos(&html, "<g class=\"lane named lagging\" data-node=\"n2\">"),
        pos(&html, "<g class=\"rank-lane named suspect\" data-rank=\"1\" data-node=\"n2\" data-group=\"B\">"),
        pos(&html, "<g class=\"lane\" data-node=\"n3\">"),
        pos(&html, "<g class=\"rank-lane\" data-rank=\"2\" data-node=\"n3\" data-group=\"A\">"),
    ];
    assert!(order.is_sorted(), "{order:?}");
    assert!(html.contains("<h2>The nodes and, under each, its ranks on one clock"));
    // The named rank: its frame, no watchdog line, no dump, silent since its last step.
    let r1 = words(&html, 1);
    assert!(
        r1.contains("<tspan class=\"frame\">rank 1 on n2: S in hrtimer_nanosleep, torch_train.py:50 wait_for_the_flag</tspan> (group B, outside the largest)"),
        "{r1}"
    );
    assert!(
        r1.contains("last step/loss line -4.1 s: step 4 | loss 0.7000 · no watchdog line"),
        "{r1}"
    );
    assert!(
        r1.contains("no watchdog counters, no Flight Recorder dump"),
        "{r1}"
    );
    assert!(
        r1.contains("class=\"ev k-progress\"") && !r1.contains("k-hang"),
        "{r1}"
    );
    assert!(r1.contains("<line class=\"since\""), "{r1}");
    // The others: the collective their dumps end in, their timeout, the largest group.
    for rank in [0, 2] {
        let w = words(&html, rank);
        assert!(w.contains("first watchdog / timeout line +6.2 s"), "{w}");
        assert!(
            w.contains("last enqueued 6, completed – (its Flight Recorder dump: gloo:all_reduce, scheduled)"),
            "{w}"
        );
        assert!(
            w.contains("group A: S in futex_do_wait, distributed_c10d.py:4181 all_reduce"),
            "{w}"
        );
        assert_eq!(w.matches("class=\"ev k-hang\"").count(), 1, "{w}");
        assert!(!w.contains("class=\"frame\""), "{w}");
    }
    assert!(html.contains("<p id=\"named-rank\"><b>▶ rank 1 on n2: S in hrtimer_nanosleep, torch_train.py:50 wait_for_the_flag</b>"));
    let legend = &html[pos(&html, "<p id=\"stack-group-legend\"")..];
    assert!(
        legend.contains("A (ranks 0, 2): S in futex_do_wait")
            && legend.contains("B (rank 1): S in hrtimer_nanosleep"),
        "{legend}"
    );
    assert!(html.contains("<p id=\"rank-lanes-note\" class=\"note\">Under each node its ranks, each on its own lane (3).</p>"));
    assert!(html.contains("<table id=\"ranks\">"), "the table kept");
    // The table as job-report.md's: the named rank first (no watchdog line of its own, no
    // dump), then each rank's Flight Recorder columns.
    let table = &html[pos(&html, "<table id=\"ranks\">")..];
    let table = &table[..pos(table, "</table>")];
    assert!(table.contains("<th>Flight Recorder: last collective</th><th>Flight Recorder: last completed</th>"), "{table}");
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("<tr")).collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert!(
        rows[0].starts_with("<tr class=\"lagging\"><td class=\"num\">1</td><td>n2</td><td>0</td>")
            && rows[0].contains("<td>–</td><td class=\"num\">–</td><td><code>–</code></td>"),
        "{}",
        rows[0]
    );
    for (row, rank) in rows[1..].iter().zip([0, 2]) {
        assert!(
            row.starts_with(&format!("<tr><td class=\"num\">{rank}</td>"))
                && row.contains("<td>6 gloo:all_reduce scheduled</td><td class=\"num\">–</td>"),
            "{row}"
        );
    }
    // As the browser draws it: the same lanes, no console message (a CSP violation, an error).
    let Some((dom, console)) = in_chromium(&html, "python") else {
        return;
    };
    assert!(console.is_empty(), "console messages: {console:#?}");
    assert_eq!(
        dom.matches("<g class=\"rank-lane").count(),
        3,
        "{}",
        &dom[..dom.len().min(600)]
    );
    assert!(dom.contains("data-rank=\"1\" data-node=\"n2\" data-group=\"B\""));
    assert!(
        dom.contains("rank 1 on n2: S in hrtimer_nanosleep, torch_train.py:50 wait_for_the_flag")
    );
    assert!(dom.contains("last enqueued 6, completed – (its Flight Recorder dump"));
    assert_eq!(
        dom.matches("class=\"ev k-fr\"").count(),
        2,
        "ranks 0 and 2's dumps"
    );
    assert!(dom.contains("FR: collective 6 gloo:all_reduce created -3.8 s"));
}

/// The page's axis (its main lanes): seconds from the reference to x, from its first and last
/// ticks (`<text x="..." ... class="tick" ...>+1.0s</text>`).
fn axis(html: &str) -> impl Fn(f64) -> f64 {
    let svg = &html[pos(html, "<svg id=\"lanes\"")..];
    let svg = &svg[..svg.find("</svg>").unwrap()];
    let ticks: Vec<(f64, f64)> = svg
        .match_indices("class=\"tick\"")
        .map(|(i, _)| {
            let x = &svg[svg[..i].rfind("<text x=\"").unwrap() + 9..];
            let t = &svg[i + svg[i..].find('>').unwrap() + 1..];
            (
                t[..t.find("s<").unwrap()].parse::<f64>().unwrap(),
                x[..x.find('"').unwrap()].parse::<f64>().unwrap(),
            )
        })
        .collect();
    assert!(ticks.len() >= 2, "{svg}");
    let ((t1, x1), (t2, x2)) = (ticks[0], ticks[ticks.len() - 1]);
    move |t| x1 + (t - t1) * (x2 - x1) / (t2 - t1)
}

/// The x of a lane's mark: `what` opens its attribute (`class="ev k-fr" d="M`: the path's
/// apex after its `L`; `class="ev k-hang" cx="`; `class="ev k-progress" x="`: its centre).
fn mark_x(lane: &str, what: &str) -> f64 {
    let at = &lane[pos(lane, what) + what.len()..];
    let num = |s: &str| {
        let end = s.find(|c: char| c != '.' && c != '-' && !c.is_ascii_digit());
        s[..end.unwrap()].parse::<f64>().unwrap()
    };
    match what {
        w if w.contains("k-fr") => num(&at[at.find('L').unwrap() + 1..]),
        w if w.contains("k-progress") => num(at) + 4.0,
        _ => num(at),
    }
}

#[test]
fn the_flight_recorders_last_collective_is_a_mark_where_its_nodes_clock_puts_it() {
    // The real job: ranks 0 (n1) and 2 (n3) dumped, their last collective 6 created at
    // 20:34:50.324128148 and 20:34:50.323010660 on their nodes' clocks (torch's epoch ns);
    // the reference is the first trigger, n1's at 20:34:54.136429054; no correction (the
    // nodes' NTP is unsynchronised: 0).
    let (_, html) = recorded_hang("fr", |_| {});
    let x_of = axis(&html);
    for (rank, t, title) in [
        (0, -3.812_300_906, "-3.812 s"),
        (2, -3.813_418_394, "-3.813 s"),
    ] {
        let w = words(&html, rank);
        assert_eq!(w.matches("class=\"ev k-fr\"").count(), 1, "{w}");
        assert!(
            w.contains(&format!("<title>rank {rank}: FR: collective 6 gloo:all_reduce created: {title} (its Flight Recorder dump; its node's clock put on the job's)</title>")),
            "{w}"
        );
        assert!(
            w.contains("FR: collective 6 gloo:all_reduce created -3.8 s (its node's clock put on the job's)"),
            "{w}"
        );
        let x = mark_x(w, "class=\"ev k-fr\" d=\"M");
        assert!(
            (x - x_of(t)).abs() < 0.3,
            "rank {rank}: x {x}, want {}",
            x_of(t)
        );
        // Created after its last step line (-4.1 s), before its timeout (+6.2 s).
        let (step, timeout) = (
            mark_x(w, "class=\"ev k-progress\" x=\""),
            mark_x(w, "class=\"ev k-hang\" cx=\""),
        );
        assert!(step < x && x < timeout, "{step} {x} {timeout}");
        assert!((step - x_of(-4.063)).abs() < 0.3, "{step}");
    }
    // Rank 1 wrote no dump: no mark, no third line.
    let r1 = words(&html, 1);
    assert!(!r1.contains("k-fr") && !r1.contains("FR: "), "{r1}");
    assert!(html.contains(
        "<span class=\"sw k-fr\"></span>its Flight Recorder dump's last collective created"
    ));
}

/// Moves the times of `n`'s dump (torch's spacing kept) so that its last entry was created
/// `at_s` from the builders' zero, on `n`'s clock.
fn created_at(n: &mut Node, at_s: f64) {
    let zero = crate::clock::parse_rfc3339_ns(&super::tests::at(0.0)).unwrap();
    let entries = n.snapshot["flight_recorder"]["read"]["ranks"][0]["dump"]["entries"]
        .as_array_mut()
        .unwrap();
    let t = |e: &Value| i128::from(e["time_created_ns"].as_i64().unwrap());
    let last = entries.iter().map(t).max().unwrap();
    let to = zero + (at_s * 1e9) as i128;
    for e in entries {
        e["time_created_ns"] = json!(i64::try_from(t(e) - last + to).unwrap());
    }
}

#[test]
fn a_dump_time_goes_on_the_jobs_clock_with_its_nodes_correction_and_one_outside_its_window_is_said()
{
    // torch's dumps of tests/flight/stopped on the job of `jobreport::flight_tests`, their
    // times moved to this incident: rank 0's last collective 1 s before n1's trigger, rank 1's
    // 2 s before n2's on n2's clock, which is 0.25 s behind (its correction), rank 2's two
    // hours before n3's trigger, outside the 300 s n3's bundle recorded.
    let mut nodes = crate::jobreport::flight_tests::job("stopped");
    created_at(&mut nodes[0], -1.0);
    created_at(&mut nodes[1], -2.0);
    nodes[1].correction_s = 0.25;
    nodes[1].timeline["clock"]["correction_s"] = json!(0.25);
    created_at(&mut nodes[2], -7200.0);
    let (r, html) = page(nodes);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    let x_of = axis(&html);
    let r1 = words(&html, 1);
    assert!(
        r1.contains("<title>rank 1: FR: collective 5 gloo:all_reduce created: -1.750 s (its Flight Recorder dump; its node's clock put on the job's)</title>"),
        "{r1}"
    );
    assert!(
        r1.contains("FR: collective 5 gloo:all_reduce created -1.8 s"),
        "{r1}"
    );
    let x = mark_x(r1, "class=\"ev k-fr\" d=\"M");
    assert!((x - x_of(-1.75)).abs() < 0.3, "x {x}, want {}", x_of(-1.75));
    let r0 = words(&html, 0);
    assert!(
        r0.contains("FR: collective 6 gloo:all_reduce created: -1.000 s"),
        "{r0}"
    );
    let r2 = words(&html, 2);
    assert!(!r2.contains("k-fr"), "{r2}");
    assert!(
        r2.contains("FR: collective 6 gloo:all_reduce created: not drawn: -7200.0 s, before the window n3's bundle recorded (-300.0 s to +0.0 s)"),
        "{r2}"
    );
    // The axis is not stretched to it.
    assert!(x_of(-7200.0) < 0.0, "the page's axis reaches -7200 s");
}

#[test]
fn a_dump_time_days_from_its_nodes_trigger_is_not_drawn_and_said() {
    // torch's dumps of tests/flight/stopped as written (2026-12-04 20:19:58 UTC: epoch ns)
    // on nodes whose triggers are 2026-11-30's (the builders' zero): 4.8 days apart.
    let (r, html) = page(crate::jobreport::flight_tests::job("stopped"));
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    assert!(!html.contains("class=\"ev k-fr\""), "nothing drawn");
    for (rank, node, last, at) in [
        (0, "n1", 6, "20:19:58.125"),
        (1, "n2", 5, "20:19:58.068"),
        (2, "n3", 6, "20:19:58.125"),
    ] {
        let w = words(&html, rank);
        assert!(
            w.contains(&format!("FR: collective {last} gloo:all_reduce created: not drawn: 2026-12-04T{at}Z on {node}'s clock, 4.8 days after its trigger: not this incident's time (a wrong clock)")),
            "{w}"
        );
    }
}

#[test]
fn the_storage_variant_draws_the_rank_in_d_state_with_its_frame() {
    // Rank 1 read a shard in D state instead of sleeping in its own branch (the storage run
    // of `tests/torch_job.rs`, recorded nowhere: made here from the recorded hang).
    let (r, html) = recorded_hang("storage", |nodes| {
        let n2 = nodes.iter_mut().find(|n| n.name == "n2").unwrap();
        let p = &mut n2.snapshot["stacks"]["processes"][0];
        let t = &mut p["threads"][0];
        t["state"] = json!(["D", "D"]);
        t["wchan"] = json!(["submit_bio_wait", "submit_bio_wait"]);
        t["kernel_stack"] = json!([
            "submit_bio_wait",
            "__blkdev_direct_IO_simple",
            "blkdev_read_iter",
            "vfs_read"
        ]);
        let dump = &mut n2.snapshot["stacks"]["python"]["dumps"]["11034"]["lines"];
        dump[4] = json!("    load_shard (torch_train.py:70)");
    });
    assert!(r.verdict.contains("storage"), "{}", r.verdict);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    self_contained(&html);
    assert!(html.contains(
        "<g class=\"rank-lane named suspect\" data-rank=\"1\" data-node=\"n2\" data-group=\"B\">"
    ));
    let r1 = words(&html, 1);
    assert!(
        r1.contains("<tspan class=\"frame\">rank 1 on n2: D in submit_bio_wait, torch_train.py:70 load_shard</tspan>"),
        "{r1}"
    );
    assert!(html.contains("<p id=\"named-rank\"><b>▶ rank 1 on n2: D in submit_bio_wait, torch_train.py:70 load_shard</b>"));
}

#[test]
fn nccl_watchdog_lines_give_each_rank_its_counters_and_its_progress() {
    let n1 = node("n1", vec![line(-0.3, R0_TIMEOUT), line(-0.2, R0)], false, 0);
    let n2 = node("n2", vec![line(0.2, R1)], false, 1);
    let n3 = node("n3", vec![line(-0.1, R2)], false, 2);
    let (r, html) = page(vec![n1, n2, n3]);
    assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
    assert!(html.contains(
        "<g class=\"rank-lane named\" data-rank=\"1\" data-node=\"n2\" data-group=\"\">"
    ));
    // The reference is the first trigger, 0.5 s after the lines' zero.
    let r1 = words(&html, 1);
    assert!(
        r1.contains("last enqueued 41, completed 41 (its watchdog line)"),
        "{r1}"
    );
    assert!(r1.contains("first watchdog / timeout line -0.3 s"), "{r1}");
    // Its step line has no rank prefix: its pid is the bundle's rank 1.
    assert!(
        r1.contains("last step/loss line -30.5 s: step 1 | loss 2.5"),
        "{r1}"
    );
    assert!(r1.contains("no stacks of it"), "{r1}");
    let r0 = words(&html, 0);
    assert!(
        r0.contains(
            "last enqueued 42, completed 41 (its watchdog line; timed out in 42, ALLREDUCE)"
        ),
        "{r0}"
    );
    assert!(r0.contains("first watchdog / timeout line -0.8 s"), "{r0}");
    assert!(html.contains("<p id=\"named-rank\"><b>▶ rank 1 on n2: no stacks of it</b>"));
    assert!(
        !html.contains("id=\"stack-group-legend\""),
        "no stacks, no groups"
    );
}

/// A node's stacks at the trigger: each (rank, pid, wait channel, Python frame) a rank's
/// main process.
fn stacks(ranks: &[(u32, u64, &str, &str)]) -> Value {
    let procs: Vec<Value> = ranks
        .iter()
        .map(|(rank, pid, wchan, _)| json!({ "pid": pid, "rank": rank, "rank_main": true, "comm": "python", "io": { "read_bytes": [0, 0], "write_bytes": [0, 0] }, "threads": [{ "tid": pid, "comm": "python", "state": ["S", "S"], "wchan": [wchan, wchan], "kernel_stack": [wchan] }] }))
        .collect();
    let mut dumps = serde_json::Map::new();
    for (_, pid, _, frame) in ranks {
        dumps.insert(
            pid.to_string(),
            json!({ "lines": [format!("Process {pid}: python train.py"), format!("Thread {pid} (idle): \"MainThread\""), format!("    {frame}")] }),
        );
    }
    json!({ "gap_ms": 300, "processes": procs, "python": { "dumps": dumps } })
}

/// A node's `flight_recorder` section holding one dump of `rank`: its collective 41 of the
/// default group, operation `op`, created at `at_s` from the builders' zero (its node's clock).
fn fr_section(rank: u32, op: &str, at_s: f64) -> Value {
    let ns = crate::clock::parse_rfc3339_ns(&super::tests::at(at_s)).unwrap();
    let entry = json!({ "pg_id": 0, "pg_name": "0", "pg_desc": "default_pg", "collective_seq_id": 41, "profiling_name": op, "time_created_ns": i64::try_from(ns).unwrap(), "state": "scheduled", "input_sizes": [], "input_dtypes": [], "output_sizes": [], "output_dtypes": [] });
    let dump =
        json!({ "version": "2.10", "entries_total": 1, "entries_not_kept": 0, "entries": [entry] });
    json!({ "sources": [], "read": { "schema": crate::collect::flight::SCHEMA, "ranks_read": 1, "ranks": [{ "rank": rank, "pid": 100, "status": "read", "path": "/tmp/fr", "dump": dump }] } })
}

#[test]
fn hostile_frames_lines_and_host_names_on_the_rank_lanes_are_text() {
    let evil_frame = "<img src=x onerror=alert(5)> (train.py:1)";
    let evil_step = json!({ "time": super::tests::at(-2.0), "source": "log", "pid": 300, "job": true, "line": "[rank2]: step 3 | loss 0.5 </text><script>alert(6)</script>", "step": 3, "loss": 0.5 });
    let mut n1 = node("n1", vec![line(-0.3, R0_TIMEOUT), line(-0.2, R0)], false, 0);
    n1.snapshot["stacks"] = stacks(&[(0, 100, "futex_wait_queue", "all_reduce (c10d.py:10)")]);
    let mut n2 = node("n2<script>alert(3)</script>", vec![line(0.2, R1)], false, 1);
    n2.snapshot["stacks"] = stacks(&[(1, 100, "hrtimer_nanosleep", evil_frame)]);
    // A bundle's dump is read as written: its operation and its node's name go into the
    // mark's label and the words on why a time is not drawn (three days from the trigger).
    n1.snapshot["flight_recorder"] = fr_section(0, "<img src=x onerror=alert(7)>", -0.2);
    n2.snapshot["flight_recorder"] =
        fr_section(1, "</text><script>alert(8)</script>", 3.0 * 86_400.0);
    let name3 = "n3\" onmouseover=\"alert(4)";
    let mut n3 = node(name3, vec![line(-0.1, R2), evil_step], false, 2);
    n3.snapshot["stacks"] = stacks(&[(2, 300, "futex_wait_queue", "all_reduce (c10d.py:10)")]);
    let (r, html) = page(vec![n1, n2, n3]);
    assert_eq!(
        r.hang.as_ref().map(|h| h.lagging.clone()),
        Some(vec![(1, Some("n2<script>alert(3)</script>".to_string()))])
    );
    self_contained(&html);
    assert!(
        !html.contains("<img") && !html.contains("</text><script"),
        "no element from the job's text"
    );
    assert!(
        !html.contains("\" onmouseover"),
        "no attribute from a host name"
    );
    assert!(html.contains("data-node=\"n3&quot; onmouseover=&quot;alert(4)\""));
    let r1 = words(&html, 1);
    assert!(
        r1.contains("rank 1 on n2&lt;script&gt;alert(3)&lt;/script&gt;: S in hrtimer_nanosleep, train.py:1 &lt;img src=x onerror=alert(5)&gt;"),
        "{r1}"
    );
    assert!(
        words(&html, 2).contains("step 3 | loss 0.5 &lt;/text&gt;&lt;script&gt;"),
        "cut and escaped"
    );
    let r0 = words(&html, 0);
    assert!(
        r0.contains(
            "<title>rank 0: FR: collective 41 &lt;img src=x onerror=alert(7)&gt; created: -0.700 s"
        ),
        "{r0}"
    );
    assert!(
        r1.contains("FR: collective 41 &lt;/text&gt;&lt;script&gt;alert(8)&lt;/script&gt; created: not drawn: 2026-12-03T00:53:20.000Z on n2&lt;script&gt;alert(3)&lt;/script&gt;'s clock, 3.0 days after its trigger"),
        "{r1}"
    );
    assert!(html.contains(
        "data-rank=\"1\" data-node=\"n2&lt;script&gt;alert(3)&lt;/script&gt;\" data-group=\"B\""
    ));
    let Some((dom, console)) = in_chromium(&html, "hostile") else {
        return;
    };
    assert!(console.is_empty(), "console messages: {console:#?}");
    // Chromium writes text's quotes as they are, an attribute's escaped.
    assert!(
        !dom.contains("<img") && !dom.contains("onmouseover=\"alert(4)\""),
        "{dom}"
    );
    assert!(dom.contains("data-node=\"n3&quot; onmouseover=&quot;alert(4)\""));
    assert_eq!(dom.matches("<g class=\"rank-lane").count(), 3);
}

/// A watchdog line of `rank`: waiting in collective 42, `enqueued` the last it enqueued.
fn watchdog(rank: u32, enqueued: i64) -> String {
    format!("[rank{rank}]:[E1202 04:54:03.100 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Exception (either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: {enqueued}, last completed NCCL work: 41.")
}

#[test]
fn past_the_rank_lane_cap_the_named_rank_and_its_neighbours_are_drawn_and_the_rest_counted() {
    // 40 nodes of 5 ranks (more nodes than lanes): rank 101 on n20 never enqueued 42.
    const NODES: u32 = 40;
    let nodes: Vec<Node> = (0..NODES)
        .map(|i| {
            let lines = (0..5)
                .map(|k| {
                    let rank = i * 5 + k;
                    let text = if rank == 101 {
                        R1.replace("rank1]", "rank101]")
                            .replace("Rank 1]", "Rank 101]")
                    } else {
                        watchdog(rank, 42)
                    };
                    line(-0.1 + f64::from(k) * 0.01, &text)
                })
                .collect();
            node(&format!("n{i:02}"), lines, false, u64::from(i * 5))
        })
        .collect();
    let (r, html) = page(nodes);
    let h = r.hang.as_ref().expect("the hang");
    assert_eq!(
        h.lagging,
        vec![(101, Some("n20".to_string()))],
        "{}",
        r.verdict
    );
    self_contained(&html);
    let cap = super::RANK_LANES_MAX;
    assert_eq!(html.matches("<g class=\"rank-lane").count(), cap);
    assert!(html.contains("<g class=\"rank-lane named\" data-rank=\"101\" data-node=\"n20\""));
    for n in [99, 100, 102, 103] {
        assert!(
            html.contains(&format!("data-rank=\"{n}\" data-node=\"n")),
            "rank {n} drawn"
        );
    }
    let drawn = html.matches("<g class=\"lane").count();
    assert_eq!(drawn, super::LANES_MAX);
    let off = (NODES as usize - drawn) * 5;
    assert!(
        html.contains(&format!("{cap} of 200 ranks drawn under their nodes: the named rank, its neighbours and the ranks outside the largest stack group first; {} not drawn ({off} of them on nodes not drawn", 200 - cap)),
        "the page says how many are not drawn"
    );
    assert!(
        html.len() < 512 * 1024,
        "a bounded page: {} bytes",
        html.len()
    );
}
