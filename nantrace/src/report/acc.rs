//! The suspects as the detectors add them: one finding per signal and key, its lines
//! counted, and who saw them (`witness`: the kernel log's lines for a drain's check, or a
//! witness no user writes).
use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use super::rules::Signal;
use super::Finding;

pub(super) struct Acc {
    pub(super) out: BTreeMap<String, Finding>,
    /// Kernel log lines the dump found written from user space: (time, text) -> who.
    pub(super) user_written: HashMap<(u64, String), String>,
    /// Kernel log lines the dump found written by the kernel.
    pub(super) kernels: HashMap<(u64, String), String>,
}

/// A list of `accounting.kernel_writers` (bounded: 64 lines at most are checked at a dump; a
/// hostile bundle's longer list is cut): (time, text) -> who wrote it, said.
pub(super) fn listed(list: &Value, user: bool) -> HashMap<(u64, String), String> {
    list.as_array()
        .into_iter()
        .flatten()
        .take(256)
        .filter_map(|x| {
            let who = if user {
                crate::term::clean(x["writer"].as_str().unwrap_or("written from user space"))
                    .chars()
                    .take(120)
                    .collect()
            } else {
                String::new()
            };
            Some(((x["mono_ns"].as_u64()?, x["text"].as_str()?.to_string()), who))
        })
        .collect()
}

/// What the report says of a finding none of whose kernel log lines the dump found the
/// kernel's: one written from user space (its writer), or, where the dump could not check
/// every line (`truncated`: more than it reads, or /dev/kmsg unreadable), one unchecked.
/// `None`: evidence as before (a line the kernel's, a witness no user writes, or nothing
/// checked at all: a bundle of an agent before the check).
pub(super) fn not_the_kernels(f: &Finding, truncated: bool) -> Option<String> {
    if f.unforgeable || f.lines_kernel > 0 {
        return None;
    }
    f.written_from_user_space.clone().or_else(|| {
        (truncated && f.lines_unknown > 0).then(|| {
            "not checked: the dump could not check every kernel log line of its window in /dev/kmsg, and none of this finding's was found the kernel's".to_string()
        })
    })
}

impl Acc {
    pub(super) fn add(
        &mut self,
        sig: &'static Signal,
        key: &str,
        rel: f64,
        touches: bool,
        text: impl FnOnce() -> String,
    ) {
        let k = format!("{}/{key}", sig.id);
        match self.out.get_mut(&k) {
            Some(x) => {
                x.count += 1;
                x.touches_job |= touches;
                if rel.abs() < x.rel_s.abs() {
                    x.rel_s = rel;
                }
                x.first_rel_s = x.first_rel_s.min(rel);
            }
            None => {
                self.out.insert(
                    k,
                    Finding {
                        signal: sig.id,
                        family: sig.family,
                        severity: sig.severity,
                        rel_s: rel,
                        first_rel_s: rel,
                        text: text(),
                        touches_job: touches,
                        count: 1,
                        score: 0.0,
                        action: None,
                        consequence: false,
                        kernel_lines: Vec::new(),
                        unforgeable: false,
                        written_from_user_space: None,
                        lines_kernel: 0,
                        lines_unknown: 0,
                        not_the_kernels: None,
                    },
                );
            }
        }
    }

    /// A finding's earliest line, where its detector merged lines before adding them.
    pub(super) fn set_first(&mut self, sig: &'static Signal, key: &str, first: f64) {
        if let Some(f) = self.out.get_mut(&format!("{}/{key}", sig.id)) {
            f.first_rel_s = f.first_rel_s.min(first);
        }
    }

    /// Who saw the event `e` behind a finding: a kernel log line (kept, for the drain's check of
    /// its writer) or a witness whose fields no user writes (NVML, a tracepoint).
    pub(super) fn witness(&mut self, sig: &'static Signal, key: &str, e: &Value) {
        let Some(f) = self.out.get_mut(&format!("{}/{key}", sig.id)) else {
            return;
        };
        let printk = matches!(e["source"].as_str(), Some("kmsg" | "xid" | "aer"));
        match e["text"].as_str() {
            Some(t) if printk => {
                let at = e["mono_ns"].as_u64().unwrap_or(0);
                let key = (at, t.to_string());
                if let Some(w) = self.user_written.get(&key) {
                    f.written_from_user_space.get_or_insert_with(|| w.clone());
                } else if self.kernels.contains_key(&key) {
                    f.lines_kernel += 1;
                } else {
                    f.lines_unknown += 1;
                }
                let l = crate::klog::Line::new(
                    t,
                    e["mono_ns"].as_u64().unwrap_or(0),
                    e["kmsg_seq"].as_u64(),
                );
                // Each line at its time (a copy of a real line is another line); the first
                // four and the newest four are kept, so neither earlier nor later copies push
                // the kernel's own line out of a check alone.
                if !f.kernel_lines.contains(&l) {
                    if f.kernel_lines.len() == 8 {
                        f.kernel_lines.remove(4);
                    }
                    f.kernel_lines.push(l);
                }
            }
            _ => f.unforgeable = true,
        }
    }

    pub(super) fn set_action(&mut self, sig: &'static Signal, key: &str, action: &str) {
        if let Some(f) = self.out.get_mut(&format!("{}/{key}", sig.id)) {
            f.action = Some(crate::classify::action_text(action));
        }
    }
}
