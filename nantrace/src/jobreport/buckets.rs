//! The GPUs' samples of a node in time buckets: what the peer comparison reads of them. A
//! node's summary carries its buckets (kilobytes, not its samples), and the job report reads
//! the same buckets from a timeline, so both give the same measures for any reference the
//! job's other nodes set.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Seconds of node clock per bucket.
pub const BUCKET_S: i64 = 10;

/// What a GPU can report (redteam4 D-9: one bundle's 1e6 W made both healthy peers stand out
/// below half "the median"): a value outside marks its bucket, and a node with such a bucket
/// in the window is not compared on that measure.
pub(super) const BOUNDS: [(&str, f64, f64); 3] = [
    ("power_w", 0.0, 2000.0),
    ("sm_clock_mhz", 0.0, 5000.0),
    ("temp_c", -40.0, 150.0),
];

/// One GPU's samples over one bucket: count and sum of each mean measure (power, SM clock,
/// temperature, in [`BOUNDS`]' order), the range of each counter (corrected ECC, PCIe
/// replays), and which mean measures had a value no GPU reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    pub gpu: u64,
    /// The bucket's start on the node's clock, in units of [`BUCKET_S`] since the epoch.
    pub b: i64,
    pub n: [u32; 3],
    pub sum: [f64; 3],
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc: Option<(f64, f64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<(f64, f64)>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bad: u8,
}

fn is_zero(b: &u8) -> bool {
    *b == 0
}

fn widen(r: &mut Option<(f64, f64)>, v: f64) {
    *r = Some(r.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))));
}

/// A node's buckets, filled from its `gpu` samples (any order).
#[derive(Default)]
pub struct Buckets(BTreeMap<(u64, i64), Bucket>);

impl Buckets {
    /// Adds a `gpu` sample whose node-clock time is `node_time` (RFC 3339); other events and
    /// a sample without a readable time are left out.
    pub fn add(&mut self, e: &Value, node_time: &str) {
        if e["source"] != "gpu" {
            return;
        }
        let Some(ns) = crate::clock::parse_rfc3339_ns(node_time) else {
            return;
        };
        let b = i64::try_from(ns.div_euclid(i128::from(BUCKET_S) * 1_000_000_000)).unwrap_or(0);
        let gpu = e["gpu"].as_u64().unwrap_or(0);
        let k = self.0.entry((gpu, b)).or_insert_with(|| Bucket {
            gpu,
            b,
            ..Bucket::default()
        });
        for (i, (key, lo, hi)) in BOUNDS.iter().enumerate() {
            if let Some(v) = e[*key].as_f64() {
                if !(*lo..=*hi).contains(&v) {
                    k.bad |= 1 << i;
                }
                k.n[i] = k.n[i].saturating_add(1);
                k.sum[i] += v;
            }
        }
        if let Some(v) = e["ecc_corrected_volatile"].as_f64() {
            widen(&mut k.ecc, v);
        }
        if let Some(v) = e["pcie_replay"].as_f64() {
            widen(&mut k.replay, v);
        }
    }

    /// The buckets of a node's events on the job's clock (`time_node_clock` where merged).
    pub fn of_events<'a>(events: impl IntoIterator<Item = &'a Value>) -> Buckets {
        let mut b = Buckets::default();
        for e in events {
            let t = e["time_node_clock"].as_str().or(e["time"].as_str());
            b.add(e, t.unwrap_or(""));
        }
        b
    }

    /// A summary's rows, checked as a timeline's samples are: a mean outside what a GPU
    /// reports marks its bucket (a summary is its node's claim), a sum without a count is
    /// no bucket.
    pub fn from_rows(rows: Vec<Bucket>) -> Buckets {
        Buckets(
            rows.into_iter()
                .filter(|r| (0..3).all(|i| r.n[i] > 0 || r.sum[i] == 0.0))
                .map(|mut r| {
                    for (i, (_, lo, hi)) in BOUNDS.iter().enumerate() {
                        let mean = r.sum[i] / f64::from(r.n[i].max(1));
                        if r.n[i] > 0 && !(*lo..=*hi).contains(&mean) {
                            r.bad |= 1 << i;
                        }
                    }
                    ((r.gpu, r.b), r)
                })
                .collect(),
        )
    }

    pub fn rows(&self) -> Vec<&Bucket> {
        self.0.values().collect()
    }

    /// The GPU measures over the buckets that overlap the peer window: `start_rel(b)` is a
    /// bucket's start on the job's clock relative to the job's reference. Per GPU, then the
    /// node's most extreme GPU (on a node of 8 GPUs one hot or slow GPU moves the node's
    /// mean by an eighth only, and it is one GPU that fails).
    pub fn measures(&self, start_rel: impl Fn(i64) -> f64, m: &mut BTreeMap<&'static str, f64>) {
        let near = |b: &&Bucket| {
            let s = start_rel(b.b);
            s + BUCKET_S as f64 > -super::PEER_BEFORE_S && s <= super::PEER_AFTER_S
        };
        let mut per: BTreeMap<u64, Bucket> = BTreeMap::new();
        for k in self.0.values().filter(near) {
            let g = per.entry(k.gpu).or_default();
            for i in 0..3 {
                g.n[i] = g.n[i].saturating_add(k.n[i]);
                g.sum[i] += k.sum[i];
            }
            g.bad |= k.bad;
            for (r, v) in [(&mut g.ecc, k.ecc), (&mut g.replay, k.replay)] {
                if let Some((lo, hi)) = v {
                    widen(r, lo);
                    widen(r, hi);
                }
            }
        }
        let names = [
            "gpu_power_w_mean",
            "gpu_sm_clock_mhz_mean",
            "gpu_temp_c_mean",
        ];
        for (i, name) in names.into_iter().enumerate() {
            if per.values().any(|g| g.bad & (1 << i) != 0) {
                let (k, lo, hi) = BOUNDS[i];
                crate::say!("nantrace: WARNING: a node's GPU {k} samples lie outside {lo}..{hi} (no GPU reports that): it is not compared with its peers on them");
                continue;
            }
            let means = per
                .values()
                .filter(|g| g.n[i] > 0)
                .map(|g| g.sum[i] / f64::from(g.n[i]));
            // The worst GPU: the hottest, the slowest, the one drawing least power.
            let worst = if i == 2 {
                means.reduce(f64::max)
            } else {
                means.reduce(f64::min)
            };
            if let Some(x) = worst {
                m.insert(name, x);
            }
        }
        for (name, range) in [
            (
                "gpu_ecc_corrected_increase",
                per.values().map(|g| g.ecc).collect::<Vec<_>>(),
            ),
            (
                "gpu_pcie_replay_increase",
                per.values().map(|g| g.replay).collect(),
            ),
        ] {
            if let Some(x) = range
                .into_iter()
                .flatten()
                .map(|(lo, hi)| hi - lo)
                .reduce(f64::max)
            {
                m.insert(name, x);
            }
        }
    }
}

/// A bucket's start on the job's clock, in seconds relative to the job's reference: the
/// node's clock correction applied, counted from the job's first trigger `t0_ns`.
pub fn start_rel(b: i64, correction_s: f64, t0_ns: i128, reference_s: f64) -> f64 {
    let start = i128::from(b) * i128::from(BUCKET_S) * 1_000_000_000;
    rel_s(start, correction_s, t0_ns, reference_s)
}

/// An instant of a node's wall clock (`ns` since the epoch) on the job's clock, in seconds
/// relative to the job's reference, as `merge` puts the node's events there: the node's clock
/// correction applied, counted from the job's first trigger `t0_ns`.
pub fn rel_s(ns: i128, correction_s: f64, t0_ns: i128, reference_s: f64) -> f64 {
    let on_job_clock = ns.saturating_add((correction_s * 1e9) as i128);
    on_job_clock.saturating_sub(t0_ns) as f64 / 1e9 - reference_s
}
