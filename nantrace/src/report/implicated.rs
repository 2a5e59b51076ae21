//! The GPUs and faults a report implicates (the agent's history, drain and metrics read these).
use serde_json::Value;

use super::*;

/// A finding that implicates a GPU in the node's history: the GPU's own hardware, on the
/// kernel's or NVML's evidence (redteam4 D-6: an Xid NVIDIA lists as possibly the
/// application's, a power cap, a corrected ECC error are not a fault of it). Any GPU of the
/// node, the job's or not (the job's GPUs are unknown without NVML): the history counts each
/// fault once however many jobs' bundles hold it (`implicated_faults`, D-5).
pub(super) fn implicates_a_gpu(f: &Finding) -> bool {
    f.family == Family::Gpu
        && !f.anyones_words()
        && !matches!(
            f.signal,
            "xid_app_possible" | "gpu_power_cap" | "ecc_corrected"
        )
}

/// The faults behind `implicated_gpus`, each once: (PCI, signal, the wall time of its first
/// line in ms), with `reference_wall_ns` the time the analysis counts from (the first NaN, or
/// the trigger). The same Xid in three watched jobs' bundles, or in every later incident's
/// window, is one fault (redteam4 D-5).
pub fn implicated_faults(
    a: &Analysis,
    reference_wall_ns: i128,
) -> Vec<(String, &'static str, i64)> {
    let mut out: Vec<(String, &'static str, i64)> = Vec::new();
    let base_ms = (reference_wall_ns / 1_000_000) as i64;
    for f in a.suspects.iter().filter(|f| implicates_a_gpu(f)) {
        // A finding folds every line of its kind: its earliest and the one nearest the
        // reference (a new Xid that triggered this dump, after one an earlier bundle had).
        let mut times = vec![base_ms + (f.first_rel_s * 1000.0).round() as i64];
        let near = base_ms + (f.rel_s * 1000.0).round() as i64;
        if (near - times[0]).abs() > 250 {
            times.push(near);
        }
        for c in PCI_IN_TEXT.captures_iter(&f.text) {
            let pci = c[1].to_ascii_lowercase();
            for t in &times {
                if out.len() < 64
                    && !out
                        .iter()
                        .any(|(p, s, x)| *p == pci && *s == f.signal && x == t)
                {
                    out.push((pci.clone(), f.signal, *t));
                }
            }
        }
    }
    out
}

/// The GPUs an analysis implicates on the kernel's or NVML's evidence (never the job's words):
/// (PCI address, UUID from NVML when known), at most 16, for the agent's incident history.
pub fn implicated_gpus(a: &Analysis, snapshot: &Value) -> Vec<(String, Option<String>)> {
    let devs = snapshot["gpu"]["devices"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for f in a.suspects.iter().filter(|f| implicates_a_gpu(f)) {
        for c in PCI_IN_TEXT.captures_iter(&f.text) {
            let pci = c[1].to_ascii_lowercase();
            if out.len() < 16 && !out.iter().any(|(p, _)| *p == pci) {
                let uuid = devs
                    .iter()
                    .find(|d| {
                        d["pci"]
                            .as_str()
                            .is_some_and(|p| p.eq_ignore_ascii_case(&pci))
                    })
                    .and_then(|d| d["uuid"].as_str())
                    .map(String::from);
                out.push((pci, uuid));
            }
        }
    }
    out
}

/// Who saw a GPU's implicating faults: a witness no user writes (NVML, a tracepoint), and the
/// kernel log lines behind them (at most 8), for the agent to check who wrote those before the
/// history counts the GPU (`agent::history::record`, as a drain does).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuWitness {
    pub pci: String,
    pub unforgeable: bool,
    pub lines: Vec<crate::klog::Line>,
}

/// The witnesses of each GPU `implicated_gpus` names, in its order.
pub fn implicated_witnesses(a: &Analysis) -> Vec<GpuWitness> {
    let mut out: Vec<GpuWitness> = Vec::new();
    for f in a.suspects.iter().filter(|f| implicates_a_gpu(f)) {
        for c in PCI_IN_TEXT.captures_iter(&f.text) {
            let pci = c[1].to_ascii_lowercase();
            let i = match out.iter().position(|w| w.pci == pci) {
                Some(i) => i,
                None if out.len() < 16 => {
                    out.push(GpuWitness {
                        pci,
                        ..GpuWitness::default()
                    });
                    out.len() - 1
                }
                None => continue,
            };
            let w = &mut out[i];
            w.unforgeable |= f.unforgeable;
            for l in &f.kernel_lines {
                if w.lines.len() < 16 && !w.lines.contains(l) {
                    w.lines.push(l.clone());
                }
            }
        }
    }
    out
}
