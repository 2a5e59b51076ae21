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
}

pub fn spawn(ring: RingBuf<MapData>, tx: mpsc::Sender<Vec<Event>>) -> (Arc<ReaderStats>, tokio::task::JoinHandle<std::io::Result<()>>) {
    let stats = Arc::new(ReaderStats::default());
    let st = stats.clone();
    let h = tokio::spawn(async move {
        // SAFETY: the ring buffer owns its fd for as long as the AsyncFd holds it.
        let mut afd = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| std::io::Error::other(format!("registering the ring buffer fd: {e:?}")))?;
        loop {
            let mut guard = afd.readable_mut().await?;
            let mut batch = Vec::new();
            {
                let ring = guard.get_inner_mut();
                while let Some(item) = ring.next() {
                    st.records.fetch_add(1, Ordering::Relaxed);
                    match decode(&item) {
                        Ok(e) => batch.push(e),
                        Err(_) => {
                            st.decode_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if batch.len() >= 4096 {
                        break;
                    }
                }
            }
            if batch.len() < 4096 {
                guard.clear_ready();
            }
            if !batch.is_empty() && tx.send(batch).await.is_err() {
                return Ok(());
            }
        }
    });
    (stats, h)
}
