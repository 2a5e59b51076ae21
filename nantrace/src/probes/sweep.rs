//! Upkeep of the block probes' `JOB_QUEUED` (the job's requests remembered at `block_getrq`
//! until a kworker dispatches them): a request merged into another before its dispatch is
//! never issued, so its entry would stay. The kernel side never takes an entry older than
//! `BLOCK_QUEUED_MAX_AGE_NS` as the job's; this thread removes such entries, so a job that
//! runs for days does not fill the map with them. What it removed is counted
//! (`block_losses.job_requests_never_dispatched`: merged away, or waiting longer than the
//! bound, which the completion's latency then shows). The same thread removes the job
//! membership map's marks of tasks that no longer exist, and marks the job's tasks the fork
//! program missed (`Probes::sweep_marks`).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use aya::maps::{HashMap, MapData};
use nantrace_common::{BioKey, BioStart, BLOCK_QUEUED_MAX_AGE_NS};

const EVERY: Duration = Duration::from_secs(5);

/// Entries visited per sweep at most: twice the map's size, since the kernel restarts a key
/// walk from the first key when the current one was deleted under it.
const VISITS: usize = 2 * 8192;

/// Remove the entries older than the bound at `now` (the probes' clock); how many.
pub(super) fn sweep(map: &mut HashMap<MapData, BioKey, BioStart>, now: u64) -> u64 {
    let stale: Vec<BioKey> = map
        .iter()
        .take(VISITS)
        .filter_map(Result::ok)
        .filter(|(_, v)| now.saturating_sub(v.ts_ns) >= BLOCK_QUEUED_MAX_AGE_NS)
        .map(|(k, _)| k)
        .collect();
    stale.iter().filter(|k| map.remove(k).is_ok()).count() as u64
}

/// The job membership map and the counts of its sweeps (`Probes::sweep_marks`).
type Marks = (Arc<super::jobmap::JobMap>, Arc<super::marks::MarkState>);

/// Sweep every few seconds while `alive()`; the count of removed entries in `removed`. The
/// membership map's upkeep too (`marks`).
fn spawn(
    mut map: Option<HashMap<MapData, BioKey, BioStart>>,
    removed: Arc<AtomicU64>,
    marks: Marks,
    alive: impl Fn() -> bool + Send + 'static,
) {
    let r = std::thread::Builder::new()
        .name("nantrace-sweep".into())
        .spawn(move || {
            while alive() {
                std::thread::sleep(EVERY);
                if let Some(map) = map.as_mut() {
                    removed.fetch_add(sweep(map, crate::clock::monotonic_ns()), Ordering::Relaxed);
                }
                super::marks::sweep(&marks.0, &marks.1);
            }
        });
    if let Err(e) = r {
        crate::say!("nantrace: WARNING: no thread to sweep the block probes' dispatch table ({e}); a job's requests merged before dispatch stay in it until it is full (then counted)");
    }
}

impl super::Probes {
    /// Start sweeping `JOB_QUEUED` of entries no dispatch will take, while `alive()`.
    pub(super) fn start_sweep(&mut self, alive: impl Fn() -> bool + Send + 'static) {
        let queued = self.ebpf.take_map("JOB_QUEUED").and_then(|m| {
            HashMap::try_from(m)
                .map_err(|e| crate::say!("nantrace: WARNING: JOB_QUEUED: {e}; a job's requests merged before dispatch are not swept"))
                .ok()
        });
        let marks = (self.job_map.clone(), self.mark_state.clone());
        spawn(queued, self.queued_swept.clone(), marks, alive);
    }
}
