//! Numerics: the fp16 loss scale collapsing, the loss growing before the NaN.

use serde_json::Value;

use super::{Acc, Ctx};
use crate::report::rules::signal;
use crate::source::Source;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    // Numerics: the loss scale and the loss curve before the NaN.
    let logs: Vec<(f64, &Value)> = ctx
        .src(Source::Log)
        .filter(|(r, _)| *r <= 0.0)
        .map(|(r, e)| (*r, *e))
        .collect();
    {
        let scales: Vec<(f64, f64, Option<u64>)> = logs
            .iter()
            .filter_map(|(r, e)| {
                Some((*r, crate::report::f(&e["loss_scale"])?, e["step"].as_u64()))
            })
            .collect();
        let overflow = logs.iter().any(|(_, e)| e["overflow"] == true);
        if let (Some(max), Some(last)) =
            (scales.iter().map(|s| s.1).reduce(f64::max), scales.last())
        {
            let sig = signal("loss_scale_collapse");
            if overflow
                && (max / last.1.max(1e-12) >= sig.threshold || (last.1 <= 1.0 && max > 1.0))
            {
                let first_max = scales.iter().find(|s| s.1 == max).unwrap();
                let steps = match (first_max.2, last.2) {
                    (Some(a), Some(b)) if b > a => format!(" over {} steps", b - a),
                    _ => String::new(),
                };
                acc.add(sig, "scale", last.0, true, || format!("loss scale fell from {max} to {}{steps} (fp16 overflow messages before it)", last.1));
            }
        }
        let losses: Vec<(f64, f64, Option<u64>)> = logs
            .iter()
            .filter_map(|(r, e)| Some((*r, crate::report::f(&e["loss"])?, e["step"].as_u64())))
            .filter(|l| l.1.is_finite())
            .collect();
        let tail = &losses[losses.len().saturating_sub(100)..];
        if let (Some(min), Some(last)) = (tail.iter().map(|l| l.1).reduce(f64::min), tail.last()) {
            let sig = signal("loss_spike");
            if min > 0.0 && last.1 / min >= sig.threshold {
                acc.add(sig, "loss", last.0, true, || {
                    format!("loss grew from {min:.4} to {:.4e} before the NaN", last.1)
                });
            }
        }
    }
}
