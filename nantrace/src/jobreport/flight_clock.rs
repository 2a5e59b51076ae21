//! A rank's Flight Recorder time on the job's clock. torch writes an entry's
//! `time_created_ns` from the rank's process's wall clock, in nanoseconds since the epoch
//! (measured on the dumps torch 2.15 wrote, tests/flight and data/demo-hang: each collective is
//! created 4-11 ms before the rank prints its step line, on the same node's clock), so it goes
//! on the job's clock as its node's other events do ([`super::buckets::rel_s`]: the node's
//! correction, from the job's first trigger, against the reference). Only a time inside the
//! window its node's bundle recorded and within a day of the node's trigger is drawn; else
//! the page says why.
use serde_json::Value;

use super::Node;

/// Further than this from its node's trigger, a dump's time is no time of this incident.
const DAY_NS: i128 = 86_400 * 1_000_000_000;

/// When a rank's dump says its last collective was created, on the job's clock.
#[derive(Clone, Debug, PartialEq)]
pub enum FrCreated {
    /// Seconds from the job's reference.
    At(f64),
    /// Not drawn: why, in words (the job's and the bundle's text unescaped).
    NotDrawn(String),
}

/// `ns` (an entry's `time_created_ns`) of a rank that ran on `node`, on the job's clock
/// (`t0_ns`: the job's first trigger; `reference_s`: the reference's offset from it).
pub(super) fn created(
    ns: Option<i64>,
    node: Option<&Node>,
    (t0_ns, reference_s): (i128, f64),
) -> FrCreated {
    use FrCreated::NotDrawn;
    let Some(ns) = ns.filter(|n| *n > 0).map(i128::from) else {
        return NotDrawn("its dump gives no creation time".into());
    };
    let Some(n) = node else {
        return NotDrawn("no bundle of its node: its clock is unknown".into());
    };
    let (tl, name) = (&n.timeline, n.name.as_str());
    let time = |v: &Value| v.as_str().and_then(crate::clock::parse_rfc3339_ns);
    let Some(trigger) = time(&tl["trigger"]["time"]) else {
        return NotDrawn(format!("{name}'s trigger time is unknown"));
    };
    let away = ns - trigger;
    if away.abs() > DAY_NS {
        // To the millisecond: `2026-12-04T20:19:58.068Z`.
        let at = crate::clock::rfc3339(ns);
        let at = match at.split_once('.') {
            Some((s, f)) => format!("{s}.{}Z", f.get(..3).unwrap_or(f)),
            None => at,
        };
        return NotDrawn(format!(
            "{at} on {name}'s clock, {:.1} days {} its trigger: not this incident's time (a wrong clock)",
            away.abs() as f64 / DAY_NS as f64,
            if away < 0 { "before" } else { "after" }
        ));
    }
    let secs = |k: &str| tl["window"][k].as_f64().map(|s| (s * 1e9) as i128);
    let lo =
        time(&tl["window"]["start"]).or_else(|| secs("pre_s").map(|s| trigger.saturating_sub(s)));
    let hi = time(&tl["window"]["end"])
        .unwrap_or_else(|| trigger.saturating_add(secs("post_s").unwrap_or(0)));
    let rel = |t: i128| super::buckets::rel_s(t, n.correction_s, t0_ns, reference_s);
    let Some(lo) = lo else {
        return NotDrawn(format!("{name}'s bundle records no window"));
    };
    if !(lo..=hi).contains(&ns) {
        return NotDrawn(format!(
            "{:+.1} s, {} the window {name}'s bundle recorded ({:+.1} s to {:+.1} s)",
            rel(ns),
            if ns < lo { "before" } else { "after" },
            rel(lo),
            rel(hi)
        ));
    }
    FrCreated::At(rel(ns))
}
