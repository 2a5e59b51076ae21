//! The kernel side of a session, shared: the probes (loaded once, by `run`, `attach` or the
//! agent), the ring reader's statistics, and the accounting every bundle carries.
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::event::Event;
use crate::probes::Probes;
use crate::stream::ReaderStats;
use crate::watch::{start_probes_with, Accounting};

/// The probes, or why there are none (log-only evidence then, and every bundle says so).
pub struct Kernel {
    probes: Mutex<Option<Probes>>,
    /// Probe status at load (what attached, what did not and why).
    base: Accounting,
    pub error: Option<String>,
    stats: Mutex<Option<Arc<ReaderStats>>>,
}

impl Kernel {
    /// No probes, with the reason (`--no-probes`, tests of the log path).
    pub fn none(why: &str) -> Self {
        Self {
            probes: Mutex::new(None),
            base: Accounting::default(),
            error: Some(why.to_string()),
            stats: Mutex::new(None),
        }
    }

    /// Load the probes; on failure say so and degrade to log-only evidence.
    /// `whole_machine`: abnormal exits and fatal signals of every process, not only the job's.
    pub fn load(pids: &[u32], slow_io_ms: f64, whole_machine: bool) -> Self {
        match start_probes_with(pids, slow_io_ms, whole_machine) {
            Ok(p) => Self {
                base: Accounting {
                    kernel_log: p.klog.clone(),
                    ..Accounting::with_probes(&p.status)
                },
                probes: Mutex::new(Some(p)),
                error: None,
                stats: Mutex::new(None),
            },
            Err(e) => {
                crate::say!("nantrace: WARNING: kernel probes unavailable, recording the job's output only: {e:#}");
                Self::none(&format!("{e:#}"))
            }
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Probes) -> R) -> Option<R> {
        self.probes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_mut()
            .map(f)
    }

    pub fn loaded(&self) -> bool {
        self.with(|_| ()).is_some()
    }

    pub fn attached(&self) -> usize {
        self.base.probes_attached.len()
    }

    pub fn probes_attached(&self) -> &[String] {
        &self.base.probes_attached
    }

    pub fn probes_not_attached(&self) -> &BTreeMap<String, String> {
        &self.base.probes_not_attached
    }

    /// Start the ring reader: decoded batches go to `tx`.
    pub fn start_stream(&self, tx: mpsc::Sender<Vec<Event>>) -> anyhow::Result<()> {
        let stats = self.with(|p| p.start_readers(tx)).transpose()?;
        if let Some(stats) = stats {
            *self
                .stats
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(stats);
        }
        Ok(())
    }

    /// Follow `pid` (and, through the fork probe, its future children) as a job's.
    pub fn add_pid(&self, pid: u32) {
        let _ = self.with(|p| p.add_job_pid(pid));
    }

    pub fn remove_pid(&self, pid: u32) {
        let _ = self.with(|p| p.remove_job_pid(pid));
    }

    /// What the block probes could not keep or attribute (`Probes::block_losses`).
    pub fn block_losses(&self) -> BTreeMap<String, u64> {
        self.with(|p| {
            p.block_losses()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect()
        })
        .unwrap_or_default()
    }

    /// Ring-buffer reserve failures per source.
    pub fn drops(&self) -> BTreeMap<String, u64> {
        self.with(|p| {
            p.drops()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect()
        })
        .unwrap_or_default()
    }

    pub fn decode_errors(&self) -> u64 {
        self.stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(0, |s| s.decode_errors.load(Ordering::Relaxed))
    }

    /// The accounting a bundle carries: events per source (the session's), drops, decode
    /// errors, probes attached and not, block latency histograms.
    pub fn accounting(&self, counts: &BTreeMap<&'static str, u64>) -> Value {
        let mut acct = self.base.clone();
        acct.kernel_drops = self.drops();
        if acct
            .kernel_log
            .as_ref()
            .is_some_and(crate::klog::KlogSource::is_kmsg)
        {
            let missed = self
                .stats
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_ref()
                .map_or(0, |s| s.kmsg_missed.load(Ordering::Relaxed));
            acct.kernel_drops.insert("kmsg_overwritten".into(), missed);
        }
        acct.block_losses = self.block_losses();
        acct.membership_losses = self
            .with(|p| {
                p.membership_losses()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect()
            })
            .unwrap_or_default();
        acct.events = counts.iter().map(|(k, v)| ((*k).to_string(), *v)).collect();
        acct.decode_errors = self.decode_errors();
        let mut v =
            serde_json::to_value(&acct).unwrap_or_else(|e| json!({ "error": e.to_string() }));
        v["probes_error"] = json!(self.error);
        if let Some(h) = self.with(|p| p.io_histograms()) {
            v["io_latency_histograms_log2_us"] = json!(h);
        }
        v
    }
}
