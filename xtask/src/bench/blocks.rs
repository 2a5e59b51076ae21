//! The kernel-side building blocks: each alone in a program on a hot syscall, and the job
//! membership test of a process outside every job, old against new, under the workload.
use std::path::Path;

use anyhow::Result;

use super::{internal, stats};

/// `bench-internal membership`, `reps` times: the old hash membership test against the
/// `JOB_MAP` byte, side by side under the workload (ns/run of each, medians).
pub(super) fn membership(bin: &Path, n: u64, reps: usize, tmp: &Path) -> Result<serde_json::Value> {
    let dir = tmp.join("membership");
    std::fs::create_dir_all(&dir)?;
    let mut by: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
    for _ in 0..reps {
        let r = internal(
            bin,
            &[
                "membership",
                "--n",
                &n.to_string(),
                "--dir",
                dir.to_str().unwrap_or("/tmp"),
            ],
        )?;
        for row in r["rows"].as_array().cloned().unwrap_or_default() {
            let tp = row["tracepoint"].as_str().unwrap_or("?").to_string();
            let i = by.iter().position(|x| x.0 == tp).unwrap_or_else(|| {
                by.push((tp, Vec::new(), Vec::new()));
                by.len() - 1
            });
            // A tracepoint that did not fire has no cost to show (0 ns would read as a saving).
            if row["runs"].as_u64().unwrap_or(0) > 0 {
                by[i].1.extend(row["hash_ns_per_run"].as_f64());
                by[i].2.extend(row["byte_ns_per_run"].as_f64());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let rows: Vec<serde_json::Value> = by.iter_mut().map(|(tp, h, b)| serde_json::json!({ "tracepoint": tp, "hash_ns_per_run": stats(h), "byte_ns_per_run": stats(b) })).collect();
    Ok(serde_json::json!({ "iterations": n, "reps": reps, "hash_seeded_pids": 4096, "rows": rows }))
}

/// `bench-internal microcost`, `reps` times: median ns/run of each building block.
pub(super) fn microcost(bin: &Path, n: u64, reps: usize) -> Result<serde_json::Value> {
    let mut by: std::collections::BTreeMap<String, (String, Vec<f64>)> =
        std::collections::BTreeMap::new();
    let mut order = Vec::new();
    for _ in 0..reps {
        for row in internal(bin, &["microcost", "--n", &n.to_string()])?
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let p = row["program"].as_str().unwrap_or("?").to_string();
            if !order.contains(&p) {
                order.push(p.clone());
            }
            let e = by
                .entry(p)
                .or_insert_with(|| (row["what"].as_str().unwrap_or("").to_string(), Vec::new()));
            e.1.extend(row["ns_per_run"].as_f64());
        }
    }
    let rows: Vec<serde_json::Value> = order
        .iter()
        .filter_map(|p| by.get_mut(p).map(|(what, v)| serde_json::json!({ "program": p, "what": what, "ns_per_run": stats(v) })))
        .collect();
    Ok(serde_json::json!({ "calls": n, "reps": reps, "rows": rows }))
}
