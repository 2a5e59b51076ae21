//! The ring-buffer reader: wakes on epoll readiness, drains everything available, decodes, and
//! hands batches to the consumer. Decode failures are counted, never dropped silently.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

use crate::decode::decode;
use crate::event::Event;

#[derive(Default, Debug)]
pub struct ReaderStats {
    pub records: AtomicU64,
    pub decode_errors: AtomicU64,
    /// `/dev/kmsg` records overwritten before they were read (when it is the log's source).
    pub kmsg_missed: AtomicU64,
}

pub fn spawn(
    ring: RingBuf<MapData>,
    tx: mpsc::Sender<Vec<Event>>,
) -> (
    Arc<ReaderStats>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let stats = Arc::new(ReaderStats::default());
    let st = stats.clone();
    let h = tokio::spawn(async move {
        // Names of the job's processes as their fork and exec events gave them: a block event
        // (whose probe does not copy the issuer's name) is named from here, or from /proc.
        let mut names: std::collections::HashMap<u32, crate::event::Comm> =
            std::collections::HashMap::new();
        // SAFETY: the ring buffer owns its fd for as long as the AsyncFd holds it.
        let mut afd = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| std::io::Error::other(format!("registering the ring buffer fd: {e:?}")))?;
        // The probes wake us only when 256 KiB are waiting (see nantrace-ebpf/src/main.rs);
        // between wakeups, a 25 ms timer drains what has arrived.
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(25));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                g = afd.readable_mut() => {
                    // Clear first, then drain: a wakeup after this point is not lost.
                    g?.clear_ready();
                }
                _ = tick.tick() => {}
            }
            let mut more = true;
            while more {
                let mut batch = Vec::new();
                {
                    let ring = afd.get_mut();
                    while let Some(item) = ring.next() {
                        st.records.fetch_add(1, Ordering::Relaxed);
                        match decode(&item) {
                            Ok(mut e) => {
                                use crate::event::{Comm, Detail};
                                match &mut e.detail {
                                    Detail::Exec { .. } => {
                                        names.insert(e.pid, e.comm);
                                    }
                                    Detail::Fork {
                                        child_pid,
                                        child_comm,
                                        ..
                                    } => {
                                        names.insert(*child_pid, *child_comm);
                                    }
                                    // The block probes do not copy the issuer's name (every
                                    // request pays for what the issue path does): named here,
                                    // for the few requests that are events (slow or failed).
                                    Detail::Block { .. } if e.comm == Comm::NONE && e.pid != 0 => {
                                        e.comm = names.get(&e.pid).copied().unwrap_or_else(|| {
                                            crate::event::comm_from(
                                                std::fs::read_to_string(format!(
                                                    "/proc/{}/comm",
                                                    e.pid
                                                ))
                                                .unwrap_or_default()
                                                .trim(),
                                            )
                                        });
                                    }
                                    // Before 5.14 oom:mark_victim carries the pid only:
                                    // the name from the job's own events, or /proc while
                                    // the victim is still dying.
                                    Detail::Oom(o)
                                        if o.victim_comm == Comm::NONE && o.victim_pid != 0 =>
                                    {
                                        o.victim_comm = names
                                            .get(&o.victim_pid)
                                            .copied()
                                            .unwrap_or_else(|| {
                                                crate::event::comm_from(
                                                    std::fs::read_to_string(format!(
                                                        "/proc/{}/comm",
                                                        o.victim_pid
                                                    ))
                                                    .unwrap_or_default()
                                                    .trim(),
                                                )
                                            });
                                    }
                                    _ => {}
                                }
                                if names.len() > 65_536 {
                                    names.clear();
                                }
                                batch.push(e);
                            }
                            Err(_) => {
                                st.decode_errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        if batch.len() >= 4096 {
                            break;
                        }
                    }
                }
                more = batch.len() >= 4096;
                if !batch.is_empty() && tx.send(batch).await.is_err() {
                    return Ok(());
                }
            }
        }
    });
    (stats, h)
}
