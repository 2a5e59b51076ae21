//! gpucheck.json read back (the check itself is `crate::gpucheck`, which runs it and writes
//! the file): what it found, as sentences the node report cites.
use std::collections::BTreeMap;

use serde_json::Value;

/// What the check found, as sentences: a GPU whose repetitions disagree, a GPU that disagrees
/// with its peers of the same model, memory errors, a check that could not run.
pub fn findings(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let gpus = v["gpus"].as_array().cloned().unwrap_or_default();
    if let Some(e) = v["error"].as_str() {
        out.push(format!("the check could not run: {e}"));
    }
    for g in &gpus {
        let id = format!("GPU {} ({})", g["index"], g["pci"].as_str().unwrap_or("?"));
        if let Some(why) = g["skipped"].as_str() {
            out.push(format!("{id} not checked: {why}"));
        }
        if let Some(e) = g["error"].as_str() {
            out.push(format!("{id}: the check did not complete: {e}"));
        }
        for (prec, c) in g["compute"].as_object().into_iter().flatten() {
            let bad = c["mismatching_reps"].as_array().map_or(0, Vec::len);
            if bad > 0 {
                let m = &c["mismatching_reps"][0];
                out.push(format!(
                    "{id} gave different {} results in {bad} of {} runs (first in repetition {}, element {}: {} instead of {})",
                    prec.to_uppercase(),
                    c["reps"],
                    m["rep"],
                    m["first_index"],
                    m["got_bits"].as_str().unwrap_or("?"),
                    m["want_bits"].as_str().unwrap_or("?")
                ));
            }
        }
        for p in g["memory"]["patterns"].as_array().into_iter().flatten() {
            if p["errors"].as_u64().unwrap_or(0) > 0 {
                out.push(format!(
                    "{id}: {} memory errors with the {} pattern (first bad word {})",
                    p["errors"],
                    p["pattern"].as_str().unwrap_or("?"),
                    p["first_bad_word"]
                ));
            }
        }
    }
    // Across GPUs of one model: the fingerprint most of them share is the reference.
    let mut by_model: BTreeMap<(String, String), Vec<(String, String)>> = BTreeMap::new();
    for g in &gpus {
        for (prec, c) in g["compute"].as_object().into_iter().flatten() {
            by_model
                .entry((g["name"].as_str().unwrap_or("?").to_string(), prec.clone()))
                .or_default()
                .push((
                    format!("GPU {}", g["index"]),
                    c["fingerprint"].as_str().unwrap_or("").to_string(),
                ));
        }
    }
    for ((model, prec), list) in by_model {
        if list.len() < 2 {
            continue;
        }
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, f) in &list {
            *counts.entry(f.as_str()).or_default() += 1;
        }
        let (majority, n) = counts
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(f, n)| (*f, *n))
            .unwrap_or(("", 0));
        for (gpu, f) in &list {
            if f != majority {
                let peers: Vec<&str> = list
                    .iter()
                    .filter(|(_, x)| x == majority)
                    .map(|(g, _)| g.as_str())
                    .collect();
                out.push(format!(
                    "{gpu} gave different {} results than its {model} peers ({}) [{n} of {} agree]",
                    prec.to_uppercase(),
                    peers.join(", "),
                    list.len()
                ));
            }
        }
    }
    out
}
