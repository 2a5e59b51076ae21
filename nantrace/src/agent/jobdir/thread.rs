//! The job directory's thread: all the shared filesystem's I/O, so a hung mount never holds
//! a job's session. What the agent tells it (a job watched, an incident opened, a bundle
//! written) and, between messages, its poll for the incidents other nodes opened.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;

use super::{same_owner, time_of, Root, JOIN_WINDOW_S, POLL};
use crate::safefs;
use crate::session::Input;
use crate::trigger::TriggerKind;

/// What the agent tells the job directory's thread.
pub enum Msg {
    /// A watched job that has a name in the job directory, and its session's input.
    Watch {
        job: String,
        key: String,
        /// Whose job it is ([`owner`](super::owner)).
        owner: Value,
        tx: mpsc::Sender<Input>,
    },
    Unwatch {
        key: String,
    },
    /// The job's session opened an incident (its own trigger), at `at` (wall clock, ns).
    Opened {
        key: String,
        trigger: String,
        reason: String,
        at: i128,
    },
    /// The job's session wrote a bundle (`None`: the dump failed; the incident is over here).
    Dumped {
        key: String,
        bundle: Option<PathBuf>,
    },
}

struct Watched {
    job: String,
    owner: Value,
    tx: mpsc::Sender<Input>,
    /// Incidents already dumped or seen (never dumped twice).
    seen: BTreeSet<String>,
    /// The incident the job's open dump belongs to, and since when: given up after
    /// `CURRENT_MAX` without a bundle (a dump that failed, a job-wide trigger turned off).
    current: Option<(String, std::time::Instant)>,
    /// When the incidents this node opened or put a bundle into were opened (the newest
    /// [`TOOK_MAX`]): another node's incident within the join window of one of them is the
    /// same incident of the job (an earlier agent's, opened at the same moment and then
    /// settled here), not one to dump again.
    took: Vec<i128>,
}

const TOOK_MAX: usize = 16;

impl Watched {
    fn took(&mut self, t: Option<i128>) {
        if let Some(t) = t {
            if self.took.len() == TOOK_MAX {
                self.took.remove(0);
            }
            self.took.push(t);
        }
    }

    fn took_within(&self, t: Option<i128>) -> bool {
        t.is_some_and(|t| {
            self.took
                .iter()
                .any(|x| (x - t).abs() as f64 <= JOIN_WINDOW_S * 1e9)
        })
    }
}

const CURRENT_MAX: Duration = Duration::from_secs(300);

/// Where the job-directory thread reports what it did (for the agent's log and metrics).
pub type Report = Box<dyn Fn(&str, &str) + Send>;

/// The agent's job directory (`job_dir`; empty: off): its thread, or why there is none (said,
/// and `nantrace_job_dir_ok 0`); the agent goes on with per-node bundles either way.
pub fn start(
    job_dir: &Path,
    host: &str,
    metrics: &std::sync::Arc<crate::agent::Metrics>,
) -> Option<std_mpsc::Sender<Msg>> {
    if job_dir.as_os_str().is_empty() {
        return None;
    }
    match Root::open(job_dir) {
        Ok(root) => {
            let m = metrics.clone();
            metrics.set("nantrace_job_dir_ok", &[], 1.0);
            Some(spawn(
                root,
                host.to_string(),
                Box::new(move |key, what| {
                    if what.starts_with("WARNING") {
                        m.inc("nantrace_job_dir_failures_total", &[]);
                    }
                    crate::say!("nantrace: job {key}: {what}");
                }),
            ))
        }
        Err(e) => {
            metrics.set("nantrace_job_dir_ok", &[], 0.0);
            crate::say!("nantrace: ERROR: {e:#}; job-wide dumps are off, each node's bundles stay in its spool");
            None
        }
    }
}

/// Start the job directory's thread.
pub fn spawn(root: Root, host: String, report: Report) -> std_mpsc::Sender<Msg> {
    let (tx, rx) = std_mpsc::channel::<Msg>();
    let r = std::thread::Builder::new()
        .name("nantrace-jobdir".into())
        .spawn(move || {
            let mut jobs: BTreeMap<String, Watched> = BTreeMap::new();
            let mut said: BTreeSet<String> = BTreeSet::new();
            loop {
                match rx.recv_timeout(POLL) {
                    Ok(m) => handle(&root, &host, &mut jobs, &report, m),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
                }
                poll(&root, &host, &mut jobs, &report, &mut said);
            }
        });
    if let Err(e) = r {
        crate::say!("nantrace: WARNING: no thread for the job directory ({e}): no job-wide dumps");
    }
    tx
}

fn handle(root: &Root, host: &str, jobs: &mut BTreeMap<String, Watched>, report: &Report, m: Msg) {
    match m {
        Msg::Watch {
            job,
            key,
            owner,
            tx,
        } => {
            // Incidents long over when the job is first seen here are not this node's to dump;
            // one opened within the join window is (this node saw the job late).
            let now = crate::clock::realtime_ns();
            let seen = root
                .incidents(&job)
                .into_iter()
                .filter(|x| time_of(&x.1).is_none_or(|t| (now - t) as f64 > JOIN_WINDOW_S * 1e9))
                .map(|x| x.0)
                .collect();
            jobs.insert(
                key,
                Watched {
                    job,
                    owner,
                    tx,
                    seen,
                    current: None,
                    took: Vec::new(),
                },
            );
        }
        Msg::Unwatch { key } => {
            jobs.remove(&key);
        }
        Msg::Opened {
            key,
            trigger,
            reason,
            at,
        } => {
            let Some(w) = jobs.get_mut(&key) else { return };
            if w.current
                .as_ref()
                .is_some_and(|c| c.1.elapsed() < CURRENT_MAX)
            {
                return; // the marker of another node opened it, or this one already did
            }
            match root.open_incident_of(&w.job, &w.owner, host, &trigger, &reason, at) {
                Ok(id) => {
                    report(&key, &format!("job-wide incident {id} ({trigger} here)"));
                    w.took(root.time_of_incident(&w.job, &id).or(Some(at)));
                    w.seen.insert(id.clone());
                    w.current = Some((id, std::time::Instant::now()));
                }
                Err(e) => report(
                    &key,
                    &format!("WARNING: job directory: no incident opened: {e}"),
                ),
            }
        }
        Msg::Dumped { key, bundle } => {
            let Some(w) = jobs.get_mut(&key) else { return };
            let Some(bundle) = bundle else {
                w.current = None;
                return;
            };
            // A bundle without a trigger of its own, or whose incident an earlier agent
            // removed with none of its window seen here: a new incident, never that one
            // recreated without its marker.
            let open = |why: &str| {
                root.open_incident_of(&w.job, &w.owner, host, "dump", why, crate::clock::realtime_ns())
            };
            let id = match w.current.take() {
                Some((id, _)) => Ok(id),
                None => open("a bundle without a trigger of its own"),
            }
            .and_then(|id| {
                w.seen.insert(id.clone());
                match root.settle_of(&w.job, &w.owner, &id) {
                    Some(id) => Ok(id),
                    None => open("a bundle whose incident was removed by an earlier agent"),
                }
            });
            let id = match id {
                Ok(id) => id,
                Err(e) => {
                    return report(&key, &format!("WARNING: job directory: bundle not shared: {e}"))
                }
            };
            w.seen.insert(id.clone());
            let t = root.time_of_incident(&w.job, &id);
            w.took(t);
            match root.put_bundle(&w.job, &id, host, &bundle) {
                Ok(p) => report(&key, &format!("bundle shared as {}", p.display())),
                Err(e) => report(
                    &key,
                    &format!("WARNING: job directory: bundle not shared under incident {id}: {e}"),
                ),
            }
        }
    }
}

/// Incidents other nodes opened for the jobs watched here: each one dumps this node's window.
fn poll(
    root: &Root,
    host: &str,
    jobs: &mut BTreeMap<String, Watched>,
    report: &Report,
    said: &mut BTreeSet<String>,
) {
    for (key, w) in jobs.iter_mut() {
        let jd = root.path.join(&w.job);
        if jd.exists() && !root.trusted_dir(&jd) && said.insert(w.job.clone()) {
            report(key, &format!("WARNING: {} is not the agents' alone (owner or mode): its incidents are ignored", jd.display()));
        }
        let all = root.incidents(&w.job);
        for (id, marker) in all.clone() {
            if w.current
                .as_ref()
                .is_some_and(|c| c.1.elapsed() >= CURRENT_MAX)
            {
                w.current = None;
            }
            if w.seen.contains(&id) || w.current.is_some() {
                // Done, or this node's own incident is open: the next one after its dump.
                continue;
            }
            if marker["host"] == safefs::sanitize(host, "host").as_str() {
                w.seen.insert(id.clone());
                continue;
            }
            if !same_owner(&marker, &w.owner) {
                // The same job id on another cluster, or another user's job: not this job.
                w.seen.insert(id.clone());
                report(key, &format!(
                    "WARNING: incident {id} under job {} is another job's (owner {}; this job's {}): not dumped",
                    w.job,
                    crate::term::clean(&marker["owner"].to_string()),
                    w.owner
                ));
                continue;
            }
            if w.took_within(time_of(&marker)) {
                // Opened at the moment this node opened or joined one (an earlier agent's,
                // which then settles on the earliest): the same incident of the job.
                w.seen.insert(id.clone());
                continue;
            }
            let why = format!(
                "job-wide dump: incident {id} ({} on {})",
                crate::term::clean(marker["trigger"].as_str().unwrap_or("?")),
                crate::term::clean(marker["host"].as_str().unwrap_or("?"))
            );
            match w.tx.try_send(Input::Fire(
                TriggerKind::JobWide,
                why.clone(),
                crate::clock::monotonic_ns(),
            )) {
                Ok(()) => {
                    report(key, &why);
                    // Its neighbours within the join window are the same incident of the job.
                    let t = time_of(&marker);
                    for (other, m) in &all {
                        if t.zip(time_of(m))
                            .is_some_and(|(a, b)| (a - b).abs() as f64 <= JOIN_WINDOW_S * 1e9)
                        {
                            w.seen.insert(other.clone());
                        }
                    }
                    w.seen.insert(id.clone());
                    w.current = Some((id, std::time::Instant::now()));
                }
                // The session's queue is full (a flood): tried again at the next poll.
                Err(_) => report(
                    key,
                    &format!(
                        "WARNING: job-wide dump of incident {id} delayed: the job's queue is full"
                    ),
                ),
            }
        }
    }
}
