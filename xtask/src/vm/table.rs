//! The kernel matrix's table: one row per kernel, then each kernel's problems and flaky tests
//! (printed, written next to the logs, and into docs/kernel-matrix.md with `--docs`).
use std::fmt::Write as _;
use std::process::Command;

use serde_json::Value;

use super::outcome::{key_line, Outcome};
use super::Kernel;
use crate::root;

fn probe_cell(d: &Value) -> (String, String, String, String) {
    let Some(probes) = d["probes"].as_array() else {
        return ("-".into(), "-".into(), "-".into(), "-".into());
    };
    let attached = probes.iter().filter(|p| p["attached"] == true).count();
    let count = |path: &str| {
        probes
            .iter()
            .filter(|p| p["attached"] == true && p["path"] == path)
            .count()
    };
    let short = |tp: &str| {
        tp.rsplit(':')
            .next()
            .unwrap_or(tp)
            .trim_start_matches("sched_process_")
            .trim_start_matches("block_")
            .to_string()
    };
    let btf: Vec<String> = probes
        .iter()
        .filter(|p| p["attached"] == true && p["path"] == "btf")
        .map(|p| short(p["tracepoint"].as_str().unwrap_or("?")))
        .collect();
    let fallback: Vec<String> = probes
        .iter()
        .filter(|p| p["path"] == "tracefs" && p["btf_fallback"].is_string())
        .map(|p| {
            format!(
                "{}: {}",
                short(p["tracepoint"].as_str().unwrap_or("?")),
                key_line(p["btf_fallback"].as_str().unwrap_or(""))
            )
        })
        .collect();
    let not: Vec<String> = probes
        .iter()
        .filter(|p| p["attached"] != true)
        .map(|p| p["tracepoint"].as_str().unwrap_or("?").to_string())
        .collect();
    (
        format!(
            "{attached}/{} (btf {}, tracefs {}, kmsg {})",
            probes.len(),
            count("btf"),
            count("tracefs"),
            count("kmsg")
        ),
        if btf.is_empty() {
            "-".into()
        } else {
            btf.join(", ")
        },
        if fallback.is_empty() {
            "-".into()
        } else {
            fallback.join("; ").replace('|', "\\|")
        },
        if not.is_empty() {
            not.join(", ")
        } else {
            "-".into()
        },
    )
}

pub(super) fn table(rows: &[(&Kernel, Outcome)], total_s: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Kernel matrix, {} UTC, nantrace at {}; {} kernels in {:.0} s (TCG, 2 vCPUs).\n",
        now_utc(),
        git_rev(),
        rows.len(),
        total_s
    );
    let _ = writeln!(s, "| kernel | package | boot→init s | probes attached | on BTF | on tracefs, and why | not attached | kernel log | tests (btf) | tests (tracefs) | wall s | result |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (k, o) in rows {
        let (att, btf, fb, not) = probe_cell(&o.doctor);
        let suites = |path: &str| {
            o.suites
                .iter()
                .filter(|x| x.0 == path)
                .map(|(_, t, p, _, total, secs, _)| format!("{t} {p}/{total} ({secs:.0} s)"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let klog = o.doctor["kernel_log"]["source"].as_str().unwrap_or("-");
        let _ = writeln!(
            s,
            "| {} ({}) | {} | {} | {att} | {btf} | {fb} | {not} | {klog} | {} | {} | {:.0} | {} |",
            k.label,
            if o.uname.is_empty() { "?" } else { &o.uname },
            o.package,
            o.boot_s,
            suites("btf"),
            suites("tracefs"),
            o.wall_s,
            match (o.problems.len(), o.flaky.len()) {
                (0, 0) => "ok".to_string(),
                (0, f) => format!("ok, **{f} flaky**"),
                (p, 0) => format!("**{p} problem(s)**"),
                (p, f) => format!("**{p} problem(s), {f} flaky**"),
            }
        );
    }
    for (k, o) in rows {
        let why = o.doctor["kernel_log"]["why"].as_str().unwrap_or("-");
        let _ = writeln!(s, "\n{}: kernel log: {why}", k.label);
        for p in &o.problems {
            let _ = writeln!(s, "- PROBLEM: {p}");
        }
        for f in &o.flaky {
            let _ = writeln!(s, "- FLAKY: {f}");
        }
    }
    s
}

pub(super) fn now_utc() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn git_rev() -> String {
    Command::new("git")
        .current_dir(root())
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
