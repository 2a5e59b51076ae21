//! PCIe AER (kernel log and tracepoint): fatal and non-fatal errors, corrected ones only as a burst.
use std::collections::BTreeMap;

use super::{kernel_events, Acc, Ctx};
use crate::report::rules::signal;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    let mut corrected: BTreeMap<String, (Vec<f64>, bool, String)> = BTreeMap::new();
    for (rel, e) in &kernel_events(ctx) {
        if e["source"] == "aer" {
            let dev = e["device"].as_str().unwrap_or("?").to_string();
            let touches = ctx.job_gpus.contains(&dev);
            let sev = e["aer_severity"].as_str().unwrap_or("");
            let ty = e["error_type"]
                .as_str()
                .map_or(String::new(), |t| format!(" ({t})"));
            match sev {
                "uncorrected_fatal" | "uncorrected_nonfatal" => {
                    let sig = if sev == "uncorrected_fatal" {
                        signal("aer_fatal")
                    } else {
                        signal("aer_nonfatal")
                    };
                    acc.add(sig, &dev, *rel, touches, || {
                        format!("PCIe AER {} on {dev}{ty}", sev.replace('_', " "))
                    });
                    acc.witness(sig, &dev, e);
                }
                // Corrected errors count only as a burst (threshold), below.
                _ => corrected
                    .entry(dev)
                    .or_insert_with(|| (Vec::new(), touches, ty))
                    .0
                    .push(*rel),
            }
        }
    }
    {
        let sig = signal("aer_corrected_burst");
        for (dev, (rels, touches, ty)) in corrected {
            if rels.len() as f64 >= sig.threshold {
                for r in &rels {
                    acc.add(sig, &dev, *r, touches, || {
                        format!("PCIe AER corrected on {dev}{ty}")
                    });
                }
            }
        }
    }
}
