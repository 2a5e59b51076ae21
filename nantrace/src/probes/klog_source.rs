//! The kernel log's source, chosen at load (`crate::klog`): the `printk:console` probe, or
//! `/dev/kmsg` where the probe misses records no console prints; and the readers that start
//! from what the check read.
use aya::maps::RingBuf;
use aya::programs::TracePoint;

use super::{ProbeError, ProbePath, ProbeStatus, Probes};

impl Probes {
    /// Decide where the kernel log comes from (`crate::klog`): the marker at level 7 through
    /// the probe, or `/dev/kmsg`. On `/dev/kmsg` the printk program is unloaded (one source,
    /// no line twice) and a `/dev/kmsg` row joins the status.
    pub(super) fn choose_klog(&mut self) {
        use crate::klog::{self, Check, KlogSource};
        let printk = self
            .status
            .iter()
            .position(|s| s.program == "printk_console" && s.attached);
        let forced = std::env::var("NANTRACE_KLOG").ok();
        let missed = std::sync::atomic::AtomicU64::new(0);
        let mut kmsg = klog::KmsgFile::open_at_end();
        let nonce = (u64::from(std::process::id()) << 32) ^ crate::clock::monotonic_ns();
        let written = klog::write_marker(nonce);
        let seen_by_probe = printk.is_some() && written.is_ok() && self.marker_in_ring(nonce);
        let check = Check {
            console_loglevel: klog::console_loglevel(),
            ignore_loglevel: klog::ignore_loglevel(),
            seen_by_probe,
            written: written.is_ok(),
        };
        let mut src = match printk {
            Some(_) => klog::decide(&check, forced.as_deref()),
            None => KlogSource {
                source: KlogSource::DEV_KMSG,
                why: "printk:console is not attached".into(),
            },
        };
        if src.is_kmsg() {
            match &mut kmsg {
                Ok(k) => {
                    let (before, offset) = match &written {
                        Ok(at) => klog::read_until_marker(k, nonce, *at, &missed),
                        Err(_) => (Vec::new(), None),
                    };
                    self.pending.extend(before);
                    if let Some(i) = printk {
                        if let Some(Ok(tp)) = self
                            .ebpf
                            .program_mut("printk_console")
                            .map(<&mut TracePoint>::try_from)
                        {
                            let _ = tp.unload();
                        }
                        self.status[i].attached = false;
                        self.status[i].reason = Some(format!(
                            "not used, the kernel log is read from /dev/kmsg: {}",
                            src.why
                        ));
                    }
                    self.status.push(ProbeStatus {
                        program: "kmsg_reader",
                        tracepoint: KlogSource::DEV_KMSG.into(),
                        path: ProbePath::Kmsg,
                        btf_fallback: None,
                        attached: true,
                        reason: None,
                        what: "kernel log lines (Xid, AER text, OOM, link, MCE), read in userspace",
                    });
                    // The marker's write time against its record's timestamp; without a
                    // marker, the records' own clock (local_clock, within ms of CLOCK_MONOTONIC).
                    self.kmsg = Some((kmsg.expect("checked Ok above"), offset.unwrap_or(0)));
                }
                Err(e) => {
                    src = KlogSource {
                        source: if printk.is_some() {
                            KlogSource::TRACEPOINT
                        } else {
                            "none"
                        },
                        why: format!(
                            "{}; but /dev/kmsg cannot be opened ({e}), so the probe is kept",
                            src.why
                        ),
                    };
                }
            }
        }
        self.klog = Some(src);
    }

    /// Whether the marker with `nonce` comes through the ring within 500 ms; what else
    /// arrives meanwhile is kept for the reader.
    fn marker_in_ring(&mut self, nonce: u64) -> bool {
        let want = format!("{} {nonce:016x}", crate::klog::MARKER);
        let Some(m) = self.ebpf.map_mut("EVENTS") else {
            return false;
        };
        let Ok(mut ring) = RingBuf::try_from(m) else {
            return false;
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
        while std::time::Instant::now() < deadline {
            let mut any = false;
            while let Some(item) = ring.next() {
                any = true;
                let Ok(e) = crate::decode::decode(&item) else {
                    continue;
                };
                if let crate::event::Detail::Kmsg(k) = &e.detail {
                    if k.text.contains(&want) {
                        return true;
                    }
                }
                if self.pending.len() < 100_000 {
                    self.pending.push(e);
                }
            }
            if !any {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        false
    }

    /// `/dev/kmsg` and its clock offset, when it is the kernel log's source (can be taken once).
    pub fn take_kmsg(&mut self) -> Option<(crate::klog::KmsgFile, i64)> {
        self.kmsg.take()
    }

    /// The events read while the source was checked, for the reader to pass on first.
    pub fn take_pending(&mut self) -> Vec<crate::event::Event> {
        std::mem::take(&mut self.pending)
    }

    /// The ring reader, and the `/dev/kmsg` reader when the kernel log comes from it: every
    /// event into `tx`, the ones read during the startup check first.
    pub fn start_readers(
        &mut self,
        tx: tokio::sync::mpsc::Sender<Vec<crate::event::Event>>,
    ) -> Result<std::sync::Arc<crate::stream::ReaderStats>, ProbeError> {
        let ring = self.take_ring()?;
        let pending = self.take_pending();
        if !pending.is_empty() {
            let _ = tx.try_send(pending);
        }
        let (stats, _h) = crate::stream::spawn(ring, tx.clone());
        let alive = tx.clone();
        self.start_sweep(move || !alive.is_closed());
        if let Some((k, offset)) = self.take_kmsg() {
            let _h = crate::klog::spawn_reader(k, offset, tx, stats.clone());
        }
        Ok(stats)
    }
}
