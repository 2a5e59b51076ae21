//! docs/performance.md from the results (`cargo xtask bench`, or `--render` alone).
use std::path::Path;

use anyhow::{Context as _, Result};

use crate::root;

/// `cargo xtask bench --render [--previous FILE]`: docs/performance.md from bench/results.json.
pub fn render(previous: Option<&Path>) -> Result<()> {
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("bench/results.json"))
            .context("bench/results.json")?,
    )?;
    let prev: serde_json::Value = previous
        .map(std::fs::read_to_string)
        .transpose()?
        .map(|t| serde_json::from_str(&t))
        .transpose()?
        .unwrap_or_default();
    std::fs::write(root().join("docs/performance.md"), markdown(&r, &prev))?;
    eprintln!("xtask bench: wrote docs/performance.md from bench/results.json");
    Ok(())
}

/// n/a, or the number rounded to a whole one.
fn whole(v: Option<f64>) -> String {
    v.map_or("n/a".to_string(), |x| format!("{x:.0}"))
}

fn f(v: &serde_json::Value, scale: f64, unit: &str) -> String {
    match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
        (Some(m), Some(a), Some(b)) => {
            format!("{:.3}{unit} ({:.3}–{:.3})", m * scale, a * scale, b * scale)
        }
        _ => "n/a".into(),
    }
}

/// One row of the per-program table: a nantrace program, its floor, the path it is on, and
/// the names to compare with: bpftrace's program on the same tracepoint, and the program that
/// held this tracepoint in the "before" run (see `nantrace/src/probes/mod.rs`, PROBES).
struct Row {
    prog: &'static str,
    floor: &'static str,
    path: &'static str,
    bpftrace: Option<&'static str>,
    before: &'static str,
}

const fn row(
    prog: &'static str,
    floor: &'static str,
    path: &'static str,
    bpftrace: Option<&'static str>,
    before: &'static str,
) -> Row {
    Row {
        prog,
        floor,
        path,
        bpftrace,
        before,
    }
}

const ROWS: &[Row] = &[
    row(
        "printk_console",
        "floor_printk",
        "tracefs",
        Some("console"),
        "printk_console",
    ),
    row(
        "oom_mark_victim",
        "floor_oom",
        "tracefs",
        None,
        "oom_mark_victim",
    ),
    row(
        "blk_issue_btf",
        "floor_issue_btf",
        "btf",
        Some("block_rq_issue"),
        "blk_issue_btf",
    ),
    row(
        "block_rq_issue",
        "floor_blk_issue",
        "tracefs",
        Some("block_rq_issue"),
        "block_rq_issue",
    ),
    row(
        "blk_done_btf",
        "floor_done_btf",
        "btf",
        Some("block_rq_comple"),
        "blk_done_btf",
    ),
    row(
        "block_rq_done",
        "floor_blk_done",
        "tracefs",
        Some("block_rq_comple"),
        "block_rq_done",
    ),
    row(
        "tcp_retransmit",
        "floor_tcp",
        "tracefs",
        None,
        "tcp_retransmit",
    ),
    row(
        "fork_btf",
        "floor_fork_btf",
        "btf",
        Some("sched_process_f"),
        "fork_btf",
    ),
    row(
        "sched_fork",
        "floor_fork",
        "tracefs",
        Some("sched_process_f"),
        "sched_fork",
    ),
    row(
        "task_newtask",
        "floor_newtask",
        "tracefs",
        None,
        "task_newtask",
    ),
    row("exec_btf", "floor_exec_btf", "btf", None, "sched_exec"),
    row("sched_exec", "floor_exec", "tracefs", None, "sched_exec"),
    row("exit_btf", "floor_exit_btf", "btf", None, "exit_btf"),
    row("sched_exit", "floor_exit", "tracefs", None, "sched_exit"),
    row(
        "exit_group",
        "floor_exit_grp",
        "tracefs",
        Some("sys_enter_exit_"),
        "exit_group",
    ),
    row(
        "signal_btf",
        "floor_sig_btf",
        "btf",
        Some("signal_generate"),
        "signal_btf",
    ),
    row(
        "signal_generate",
        "floor_signal",
        "tracefs",
        Some("signal_generate"),
        "signal_generate",
    ),
];

/// Median ns/run of one program (by name, before `#id`) over all runs of one tracer.
fn prog_ns(r: &serde_json::Value, tracer: &str, name: &str) -> Option<f64> {
    let mut v: Vec<f64> = r["runs"]
        .as_array()?
        .iter()
        .filter(|x| x["tracer"] == tracer)
        .filter_map(|x| x["programs"].as_object())
        .flat_map(|m| {
            m.iter()
                .filter(|(k, _)| k.split('#').next() == Some(name))
                .filter_map(|(_, p)| p["ns_per_run"].as_f64())
                .collect::<Vec<_>>()
        })
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

pub(super) fn markdown(r: &serde_json::Value, prev: &serde_json::Value) -> String {
    let mut s = format!(
        "# Performance\n\nMeasured by `sudo cargo xtask bench` on {} — kernel {}, {} CPUs (the project's 2-core VM).\nMedians over {} repetitions, (min–max) in brackets. The raw numbers are in `bench/results.json`.\n\n",
        r["date"].as_str().unwrap_or("?"), r["kernel"].as_str().unwrap_or("?"), r["cpus"], r["reps"]
    );
    workload(&mut s, r);
    per_program(&mut s, r, prev);
    building_blocks(&mut s, r);
    membership(&mut s, r);
    s.push_str(&format!("\n## Startup (launch to first event delivered)\n\n| tracer | seconds |\n|---|---|\n| nantrace | {} |\n| bpftrace | {} |\n", f(&r["startup_s"]["nantrace"], 1.0, ""), f(&r["startup_s"]["bpftrace"], 1.0, "")));
    throughput(&mut s, r);
    memory(&mut s, r, prev);
    dumps(&mut s, r, prev);
    s.push_str(&format!(
        "\n## CPU at idle\n\n`nantrace watch` on an idle machine: {} CPU-seconds per second.\n",
        r["idle_cpu_s_per_s"]
    ));
    agent(&mut s, r);
    s.push_str("\n## Against the targets\n\nSee the section written by hand below the generated tables (docs/performance-notes.md).\n");
    s
}

/// The workload's time under each tracer, and the ratios.
fn workload(s: &mut String, r: &serde_json::Value) {
    let w = &r["workload"];
    s.push_str(&format!("## Workload slowdown\n\nThe fixed workload (`nantrace bench-internal workload --n {}`): per iteration one 4 KiB O_DIRECT write + fdatasync, one fork/exec/exit of /bin/true, one TCP round trip over loopback, and a kernel log line every 10 iterations. Tracers: nantrace `attach --pid` (all probes, flight recorder, collectors at 1 s) on its default path (BTF programs for the block pair, fork, exec, exit and signal), the same on the tracefs fallback (`nantrace-tracefs`), the same watching an idle process instead of the workload (`nantrace-outside`: the workload's events are not the job's), and bpftrace running an equivalent script (same tracepoints and fields, `xtask/src/bench/mod.rs`).\n\n| tracer | workload time s | tracer CPU s/s | kernel ns per program run |\n|---|---|---|---|\n", r["workload_iterations"]));
    for k in [
        "none",
        "floor",
        "nantrace",
        "nantrace-tracefs",
        "nantrace-outside",
        "bpftrace",
    ] {
        if w.get(k).is_some() {
            s.push_str(&format!(
                "| {k} | {} | {} | {} |\n",
                f(&w[k]["elapsed_s"], 1.0, ""),
                f(&w[k]["tracer_cpu_s_per_s"], 1.0, ""),
                f(&w[k]["kernel_ns_per_event"], 1.0, "")
            ));
        }
    }
    let ra = &r["ratios"];
    s.push_str(&format!(
        "\nRatios of medians: nantrace/none = {}, bpftrace/none = {}, nantrace/bpftrace = {}.\n\n",
        ra["nantrace_vs_none"], ra["bpftrace_vs_none"], ra["nantrace_vs_bpftrace"]
    ));
}

/// Each program's kernel cost above its floor, here and in the "before" run.
fn per_program(s: &mut String, r: &serde_json::Value, prev: &serde_json::Value) {
    s.push_str("### Per-program kernel cost, above the floor\n\nMedians over the repetitions (`kernel.bpf_stats_enabled=1`). The floor is a do-nothing program of the same kind on the same tracepoint, run under the same workload (`floor_*` in `nantrace-ebpf/src/bench.rs`): what any BPF program there costs (dispatch and run accounting). Path `btf`: the `tp_btf` programs nantrace runs by default where the kernel has BTF (`nantrace-ebpf/src/btf.rs`); `tracefs`: the fallback, measured in a separate run with `NANTRACE_PROBE_PATH=tracefs` (programs on both paths are shown from the default run). \"Outside the job\": the same programs while nantrace watches an idle process, so every event of the workload is someone else's (only the membership check should run). bpftrace's equivalents are listed beside, with the same floor subtracted. The \"before\" columns are the run these results replaced (`--previous FILE`), for the program that held the tracepoint then, above that run's floor; it ran on another instance of the VM, so compare against bpftrace in the same run rather than absolute nanoseconds across runs.\n\n| program | path | runs/iteration | ns/run | floor | above floor | outside the job, above floor | bpftrace above floor | before: above floor | before: outside, above floor | before: bpftrace above floor |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    let iters = r["workload_iterations"].as_f64().unwrap_or(1.0);
    for row in ROWS {
        if let Some(line) = program_row(r, prev, row, iters) {
            s.push_str(&line);
        }
    }
}

/// One program's line of the per-program table; none when it did not run.
fn program_row(
    r: &serde_json::Value,
    prev: &serde_json::Value,
    row: &Row,
    iters: f64,
) -> Option<String> {
    // A program that runs on both paths is read from the default run.
    let tracer = if prog_ns(r, "nantrace", row.prog).is_some() {
        "nantrace"
    } else {
        "nantrace-tracefs"
    };
    let ns = prog_ns(r, tracer, row.prog)?;
    let fl = prog_ns(r, "floor", row.floor);
    let outside_tracer = if tracer == "nantrace" {
        "nantrace-outside"
    } else {
        ""
    };
    let outside = prog_ns(r, outside_tracer, row.prog);
    let runs = r["runs"]
        .as_array()
        .and_then(|a| a.iter().rev().find(|x| x["tracer"] == tracer))
        .and_then(|x| x["programs"].as_object())
        .and_then(|m| {
            m.iter()
                .find(|(k, _)| k.split('#').next() == Some(row.prog))
                .map(|(_, p)| p["runs"].as_f64().unwrap_or(0.0))
        });
    let bt = row.bpftrace.and_then(|b| prog_ns(r, "bpftrace", b));
    // A program new in this run (no floor of its own before): the floor of the program
    // that held the tracepoint then.
    let prev_fl = prog_ns(prev, "floor", row.floor).or_else(|| {
        ROWS.iter()
            .find(|x| x.prog == row.before)
            .and_then(|x| prog_ns(prev, "floor", x.floor))
    });
    let above_prev = |v: Option<f64>| match (v, prev_fl) {
        (Some(x), Some(f)) => Some(x - f),
        _ => None,
    };
    let before = above_prev(
        prog_ns(prev, "nantrace", row.before)
            .or_else(|| prog_ns(prev, "nantrace-tracefs", row.before)),
    );
    let before_outside = above_prev(prog_ns(prev, "nantrace-outside", row.before));
    let bt_before = above_prev(row.bpftrace.and_then(|b| prog_ns(prev, "bpftrace", b)));
    let above = |v: Option<f64>| match (v, fl) {
        (Some(x), Some(f)) => Some(x - f),
        _ => None,
    };
    Some(format!(
        "| {} | {} | {} | {ns:.0} | {} | {} | {} | {} | {} | {} | {} |\n",
        row.prog,
        row.path,
        runs.map_or("?".into(), |x| format!("{:.1}", x / iters)),
        whole(fl),
        whole(above(Some(ns))),
        whole(above(outside)),
        whole(above(bt)),
        whole(before),
        whole(before_outside),
        whole(bt_before)
    ))
}

/// What the building blocks cost alone (`bench-internal microcost`).
fn building_blocks(s: &mut String, r: &serde_json::Value) {
    let mc = &r["microcost"];
    if let Some(rows) = mc["rows"].as_array() {
        s.push_str(&format!("\n### What the building blocks cost here\n\n`bench-internal microcost`: each block alone in a program on `syscalls:sys_enter_getppid` while one process calls getppid {} times (median of {} runs; `mc_*` in `nantrace-ebpf/src/bench.rs`). A hot loop: caches and branch predictors are warm, so a real program, which runs once per I/O or fork among other work, pays more for the same blocks.\n\n| block | ns/run | above the empty program |\n|---|---|---|\n", mc["calls"], mc["reps"]));
        let empty = rows
            .iter()
            .find(|x| x["program"] == "mc_empty")
            .and_then(|x| x["ns_per_run"]["median"].as_f64());
        for x in rows {
            let ns = x["ns_per_run"]["median"].as_f64();
            let above = match (ns, empty) {
                (Some(a), Some(e)) if x["program"] != "mc_empty" => format!("{:.0}", a - e),
                _ => "".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {above} |\n",
                x["what"].as_str().unwrap_or("?"),
                whole(ns)
            ));
        }
    }
}

/// The membership test of a process outside the job, hash against byte map.
fn membership(s: &mut String, r: &serde_json::Value) {
    let ab = &r["membership_ab"];
    if let Some(e) = ab["error"].as_str() {
        s.push_str(&format!(
            "\n### The membership test outside the job\n\nNot measured: {e}\n"
        ));
    }
    if let Some(rows) = ab["rows"].as_array() {
        s.push_str(&format!("\n### The membership test outside the job: hash (before session 11) against the byte map (now)\n\n`bench-internal membership`: on each tracepoint, two programs side by side, one doing the membership test of the current process as the hash of pids did it (`ab_hash_*`, the hash seeded with {} other pids), one as `JOB_MAP` does it now (`ab_byte_*`); both under the same workload ({} iterations, twice: each order of the pair once), so both see the same cold caches. ns per run including the floor (the empty program: see the table above), medians of {} runs.\n\n| tracepoint | hash ns/run | byte ns/run | saved ns/run |\n|---|---|---|---|\n", ab["hash_seeded_pids"], ab["iterations"], ab["reps"]));
        for x in rows {
            let (h, b) = (
                x["hash_ns_per_run"]["median"].as_f64(),
                x["byte_ns_per_run"]["median"].as_f64(),
            );
            let saved = match (h, b) {
                (Some(h), Some(b)) => format!("{:.0}", h - b),
                _ => "n/a".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {saved} |\n",
                x["tracepoint"].as_str().unwrap_or("?"),
                f(&x["hash_ns_per_run"], 1.0, ""),
                f(&x["byte_ns_per_run"], 1.0, "")
            ));
        }
    }
}

/// The fork storm on the default and a tiny ring, the synthetic generator, the userspace drain.
fn throughput(s: &mut String, r: &serde_json::Value) {
    let tp = &r["throughput"];
    let tps = &r["throughput_tiny_ring"];
    s.push_str(&format!("\n## Throughput and loss\n\nA fork storm of the watched job (`bench-internal forkstorm`, fork + _exit in a loop), 2 events per fork.\n\n| ring | offered ev/s | delivered ev/s | delivered / expected | drops reported |\n|---|---|---|---|---|\n| {} | {:.0} | {:.0} | {} / {} | {} |\n| {} | {:.0} | {:.0} | {} / {} | {} |\n",
        tp["ring_bytes"], tp["offered_events_per_s"].as_f64().unwrap_or(0.0), tp["delivered_events_per_s"].as_f64().unwrap_or(0.0), tp["delivered_events"], tp["expected_events"], tp["kernel_drops_reported"],
        tps["ring_bytes"], tps["offered_events_per_s"].as_f64().unwrap_or(0.0), tps["delivered_events_per_s"].as_f64().unwrap_or(0.0), tps["delivered_events"], tps["expected_events"], tps["kernel_drops_reported"]));
    let sy = &r["synthetic_throughput"];
    s.push_str(&format!("\n### Synthetic: {:.0} records/s offered for {:.0} s (SYNTHETIC)\n\nThe fork storm cannot offer more than ~16 k events/s on this VM. `bench_emit` (`nantrace-ebpf/src/bench.rs`, attached only by `bench-internal synth`) writes 32 fork-shaped records into the same ring buffer per getppid() of a generator process (2 threads, paced per 0.5 ms); the same reader, decoder and flight recorder as `run` and the agent consume them. Default ring ({} bytes).\n\n| offered | delivered | lost | drops reported | userspace CPU s per million records |\n|---|---|---|---|---|\n| {} ({:.0}/s) | {} ({:.0}/s) | {} | {} | {:.3} |\n",
        sy["offered_per_s"].as_f64().unwrap_or(0.0), sy["seconds"].as_f64().unwrap_or(0.0), sy["ring_bytes"], sy["offered"], sy["offered_per_s"].as_f64().unwrap_or(0.0), sy["delivered"], sy["delivered_per_s"].as_f64().unwrap_or(0.0), sy["lost"], sy["kernel_drops_reported"], sy["userspace_cpu_s_per_million"].as_f64().unwrap_or(f64::NAN)));
    s.push_str(&format!("\nUserspace drain (decode + recorder push of recorded ring-buffer records, `bench-internal drain`): {:.0} events/s.\n", r["userspace_drain"]["events_per_s"].as_f64().unwrap_or(0.0)));
}

/// The recorder's bytes per event, here and before.
fn memory(s: &mut String, r: &serde_json::Value, prev: &serde_json::Value) {
    let m = &r["memory"];
    s.push_str(&format!("\n## Memory\n\n{} events pushed at a simulated 1 k events/s (10-minute window; timestamps simulated, not waited for) with the mix of kernel events nantrace records: {:.1} bytes per event in the recorder ({} bytes of `Event` inline + heap for strings), RSS {} KiB after the load (started at {} KiB).\n",
        m["events"], m["bytes_per_event"].as_f64().unwrap_or(0.0), m["event_struct_bytes"], m["rss_kb_after"], m["rss_kb_before"]));
    s.push_str(&format!("\nBefore: {:.1} bytes per event (that run did not count the queue's capacity: see docs/performance-notes.md), RSS {} KiB.\n", prev["memory"]["bytes_per_event"].as_f64().unwrap_or(f64::NAN), prev["memory"]["rss_kb_after"]));
}

/// Trigger to bundle, and a log flood before the dump.
fn dumps(s: &mut String, r: &serde_json::Value, prev: &serde_json::Value) {
    s.push_str(&format!("\n## Dump latency\n\nTrigger to bundle on disk with 100 000 events in the window (timeline, app/kernel logs, report, trace, HTML): {} s (before: {} s).\n", f(&r["dump_s_100k"], 1.0, ""), f(&prev["dump_s_100k"], 1.0, "")));
    let fl = &r["flood_dump"];
    s.push_str(&format!("\n## A log flood, then the dump (redteam 2.8, 7.3, 7.4)\n\n`nantrace run --no-probes --mem-cap-mb {}` of a job that prints {} lines as fast as `yes | head` can, then a NaN: the job took {} s (alone: {} s); nantrace's peak RSS {} MiB = cap + {} MiB (target: cap + 64 MiB); {} bytes of output passed through without the full scan (only their lines with a NaN or failure word were read; counted in the bundle); bundle written: {}.\n",
        fl["cap_mib"], fl["lines"], fl["job_s_under_nantrace"], fl["job_s_alone"], fl["peak_rss_mib"], fl["over_cap_mib"], fl["log_bytes_not_scanned"], fl["bundle"]));
}

/// The node agent's CPU and RSS with 0, 1 and 4 jobs, its start and dump latencies.
fn agent(s: &mut String, r: &serde_json::Value) {
    let ag = &r["agent"];
    s.push_str("\n## The node agent\n\n`nantrace agent` (all probes, collectors at 1 s, /proc scanned every 500 ms), with jobs that print a line every 0.5 s to a log file the agent follows:\n\n| watched jobs | agent CPU s/s | agent RSS MiB |\n|---|---|---|\n");
    for n in [0, 1, 4] {
        let j = &ag[format!("jobs{n}")];
        s.push_str(&format!(
            "| {n} | {:.4} | {:.1} |\n",
            j["cpu_s_per_s"].as_f64().unwrap_or(f64::NAN),
            j["rss_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0
        ));
    }
    s.push_str(&format!("\nJob start to listed by `nantrace ctl jobs`: {} s (5 jobs). `ctl dump` to bundle on disk (post-window 0): {:.2} s.\n", f(&ag["start_to_watched_s"], 1.0, ""), ag["trigger_to_bundle_s"].as_f64().unwrap_or(f64::NAN)));
}
