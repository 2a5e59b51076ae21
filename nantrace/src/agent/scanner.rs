//! The discovery thread: `/proc` scans block, so they run on a thread of their own, every
//! `scan_interval_ms` or at once when asked (a Slurm prolog, `ctl scan`), and their results
//! go to the agent's loop.
use std::time::Duration;

use tokio::sync::mpsc;

use super::config::Config;
use super::discover::{Discovery, Found};
use crate::clock::monotonic_ns;

/// To the discovery thread.
pub enum DiscMsg {
    Config(Box<Config>),
    WantSlurm(String),
    ForgetSlurm(String),
}

/// The agent's ends of the discovery thread's channels.
pub struct Scanner {
    /// Each scan's jobs and how long it took (seconds).
    pub results: mpsc::Receiver<(Vec<Found>, f64)>,
    /// Scan now instead of at the next interval.
    pub scan_now: std::sync::mpsc::Sender<()>,
    pub control: std::sync::mpsc::Sender<DiscMsg>,
}

pub fn spawn(mut d: Discovery, cfg: &Config) -> std::io::Result<Scanner> {
    let (disc_tx, results) = mpsc::channel::<(Vec<Found>, f64)>(4);
    let (scan_now, scan_rx) = std::sync::mpsc::channel::<()>();
    let (control, cfg_rx) = std::sync::mpsc::channel::<DiscMsg>();
    let mut every = Duration::from_millis(cfg.scan_interval_ms.max(50));
    std::thread::Builder::new()
        .name("nantrace-discover".into())
        .spawn(move || loop {
            let t0 = std::time::Instant::now();
            let found = d.scan(monotonic_ns());
            if disc_tx
                .blocking_send((found, t0.elapsed().as_secs_f64()))
                .is_err()
            {
                return;
            }
            let _ = scan_rx.recv_timeout(every);
            while let Ok(m) = cfg_rx.try_recv() {
                match m {
                    DiscMsg::Config(c) => {
                        d.configure(&c);
                        every = Duration::from_millis(c.scan_interval_ms.max(50));
                    }
                    DiscMsg::WantSlurm(id) => {
                        d.slurm_wanted.insert(id);
                    }
                    DiscMsg::ForgetSlurm(id) => {
                        d.slurm_wanted.remove(&id);
                    }
                }
            }
        })?;
    Ok(Scanner {
        results,
        scan_now,
        control,
    })
}
