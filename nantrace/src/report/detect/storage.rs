//! Storage: block I/O errors (probe and kernel log), disk stalls (latency vs the minute earlier), network filesystems not responding, stale handles.
use std::collections::{BTreeMap, BTreeSet};

use super::{kernel_events, Acc, Ctx};
use crate::report::rules::signal;
use crate::source::Source;

/// The latency from which a device's p99 is a stall: on a device the job's own requests
/// went to, and on any other.
const STALL_MS_JOB: f64 = 100.0;
const STALL_MS_OTHER: f64 = 1000.0;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    errors(ctx, acc);
    stalls(ctx, acc);
}

/// Network filesystems not responding, stale handles, block I/O errors (kernel log and the
/// block probe).
fn errors(ctx: &Ctx<'_>, acc: &mut Acc) {
    for (rel, e) in &kernel_events(ctx) {
        match e["class"].as_str().unwrap_or("") {
            "net_fs_down" => {
                let key = e["server"].as_str().unwrap_or("");
                acc.add(signal("netfs_down"), key, *rel, false, || {
                    format!(
                        "{} server {} not responding",
                        e["fs"].as_str().unwrap_or("?"),
                        e["server"].as_str().unwrap_or("?")
                    )
                });
                acc.witness(signal("netfs_down"), key, e);
            }
            "stale_handle" => {
                acc.add(signal("stale_handle"), "stale", *rel, false, || {
                    format!(
                        "stale file handle: {}",
                        e["message"]
                            .as_str()
                            .unwrap_or("")
                            .chars()
                            .take(100)
                            .collect::<String>()
                    )
                });
                acc.witness(signal("stale_handle"), "stale", e);
            }
            "block_error" => {
                let dev = e["dev"].as_str().unwrap_or("?");
                acc.add(signal("block_io_error"), dev, *rel, false, || {
                    format!(
                        "{} on {dev} (kernel log)",
                        e["kind"].as_str().unwrap_or("I/O error").replace('_', " ")
                    )
                });
                acc.witness(signal("block_io_error"), dev, e);
            }
            _ => {}
        }
    }
    for (rel, e) in ctx.src(Source::Block) {
        if e["error"].as_i64().is_some_and(|x| x != 0) {
            let dev = e["dev"].as_str().unwrap_or("?");
            acc.add(
                signal("block_io_error"),
                dev,
                *rel,
                e["job"] == true,
                || format!("block I/O error {} on device {dev}", e["error"]),
            );
        }
    }
}

/// A device's block I/O latency: p99 of the minute before vs the minute earlier, per device
/// (by name when the block event could be resolved, so the probe's events and the iostat
/// samples of one disk are one suspect): (recent, earlier, first slow), and the devices the
/// job itself used.
#[expect(
    clippy::type_complexity,
    reason = "one tuple per device, named in the doc"
)]
fn latencies(
    ctx: &Ctx<'_>,
) -> (
    BTreeMap<String, (Vec<f64>, Vec<f64>, f64)>,
    BTreeSet<String>,
) {
    let mut per_dev: BTreeMap<String, (Vec<f64>, Vec<f64>, f64)> = BTreeMap::new();
    let mut job_devs = BTreeSet::new();
    for (r, e) in ctx
        .src(Source::Block)
        .chain(ctx.src(Source::Disk))
        .filter(|(r, _)| *r > -120.0)
    {
        let mut push = |dev: String, v: f64| {
            let slot = per_dev
                .entry(dev)
                .or_insert((Vec::new(), Vec::new(), f64::INFINITY));
            if *r > -60.0 {
                slot.0.push(v);
                if v >= 100.0 {
                    slot.2 = slot.2.min(*r);
                }
            } else {
                slot.1.push(v);
            }
        };
        if e["source"] == "block" {
            let name = e["disk"]
                .as_str()
                .or(e["dev"].as_str())
                .unwrap_or("?")
                .to_string();
            if e["job"] == true {
                job_devs.insert(name.clone());
            }
            if let Some(l) = crate::report::f(&e["latency_ms"]) {
                push(name, l);
            }
        } else if let Some(m) = e["disks"].as_object() {
            for (d, v) in m {
                push(
                    d.clone(),
                    crate::report::f(&v["r_await_ms"])
                        .unwrap_or(0.0)
                        .max(crate::report::f(&v["w_await_ms"]).unwrap_or(0.0)),
                );
            }
        }
    }
    (per_dev, job_devs)
}

/// Rates: the minute before vs the minute earlier.
fn stalls(ctx: &Ctx<'_>, acc: &mut Acc) {
    let sig = signal("disk_stall");
    let (per_dev, job_devs) = latencies(ctx);
    for (dev, (recent, earlier, first_slow)) in per_dev {
        let had_earlier = !earlier.is_empty();
        let (Some(r), e) = (
            crate::report::p99(recent),
            crate::report::p99(earlier).unwrap_or(1.0).max(1.0),
        ) else {
            continue;
        };
        // A slow request the job waited on (its own I/O on the device) is a stall from
        // 100 ms; another device's, only from a full second: a shared virtual disk's p99
        // of a few hundred ms under the machine's other work is not a fault (the net
        // demo's verdict once went to vda's 214 ms over the job's dropped packets).
        let job = job_devs.contains(&dev);
        let floor = if job { STALL_MS_JOB } else { STALL_MS_OTHER };
        if r >= floor && r >= sig.threshold * e {
            let vs = if had_earlier {
                format!("{:.0}× the minute earlier", r / e)
            } else {
                "no I/O seen the minute earlier".to_string()
            };
            acc.add(sig, &dev, first_slow.min(0.0), job, || {
                format!("block I/O p99 on {dev} {r:.0} ms in the minute before ({vs}), slow since")
            });
        }
    }
}
