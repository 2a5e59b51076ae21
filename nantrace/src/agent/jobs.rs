//! A job's life in the agent: found by a scan (`reconcile`), watched (`start_job`: its
//! session, its log files, its share of the budget, its processes in the kernel map), ended.
use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::discover::Found;
use super::{incident, jobdir, lock, logs, Agent, Job, State};
use crate::bundle::JobInfo;
use crate::clock::monotonic_ns;
use crate::session::{follow_file, Input, LogFormat, Mode, Session};

impl Agent {
    /// Follow every process of a job in the kernel map (threads and children included).
    fn adopt(&self, st: &mut State, key: &str, pids: &BTreeSet<u32>) {
        let all = crate::correlate::descendants(&pids.iter().copied().collect::<Vec<_>>());
        for p in all.into_iter().chain(pids.iter().copied()) {
            if st.pid_job.insert(p, key.to_string()).is_none() {
                for t in crate::correlate::threads(p).into_iter().chain([p]) {
                    self.kernel.add_pid(t);
                }
            }
        }
    }

    /// A scan's jobs: new processes of a watched job followed, a new job watched when the
    /// limits allow (else said once and counted).
    pub(super) fn reconcile(&self, mut found: Vec<Found>) {
        let mut st = lock(&self.state);
        let now = monotonic_ns();
        st.ended.retain(|_, t| now - t.0 < 30_000_000_000);
        // Jobs a scheduler vouches for, or that hold a GPU, come first when places are few.
        found.sort_by_key(|f| (u8::from(f.reason == "command"), f.root));
        let mut not_watched = 0usize;
        for f in found {
            if let Some(j) = st.jobs.get_mut(&f.key) {
                let new: BTreeSet<u32> = f
                    .pids
                    .iter()
                    .copied()
                    .filter(|p| !j.found.pids.contains(p))
                    .collect();
                j.found.pids.extend(new.iter().copied());
                j.found.gpus.extend(f.gpus.iter().copied());
                j.found.devices.extend(f.devices.iter().cloned());
                let key = f.key.clone();
                if !new.is_empty() {
                    self.adopt(&mut st, &key, &new);
                }
                continue;
            }
            if st.ended.get(&f.key).is_some_and(|e| e.1 == f.root)
                || !crate::correlate::alive(f.root)
            {
                continue;
            }
            // One user's many jobs do not hide another user's (review 4): both limits, said
            // once per job and counted.
            let of_user = st.jobs.values().filter(|j| j.found.uid == f.uid).count();
            if st.jobs.len() >= self.cfg.max_jobs || of_user >= self.cfg.max_jobs_per_user {
                not_watched += 1;
                if st.not_watched_said.len() < 10_000 && st.not_watched_said.insert(f.key.clone()) {
                    crate::say!(
                        "nantrace: WARNING: job {} (uid {}) is not watched: {} jobs watched (max_jobs {}), {} of uid {} (max_jobs_per_user {})",
                        f.key, f.uid, st.jobs.len(), self.cfg.max_jobs, of_user, f.uid, self.cfg.max_jobs_per_user
                    );
                }
                continue;
            }
            self.start_job(&mut st, f);
        }
        let n = st.jobs.len();
        self.metrics.set("nantrace_jobs_watched", &[], n as f64);
        self.metrics
            .set("nantrace_jobs_not_watched", &[], not_watched as f64);
        st.not_watched = not_watched;
    }

    /// Watch a job: its session (fed by the router, its log files and its liveness), its
    /// share of the budget, its processes in the kernel map.
    fn start_job(&self, st: &mut State, f: Found) {
        let key = f.key.clone();
        let identity = f.identity();
        let (tx, rx) = mpsc::channel::<Input>(4096);
        let session = self.job_session(&f, &identity, &tx);
        let share = self.share(st.jobs.len() + 1);
        let _ = tx.try_send(Input::Budget(share));
        crate::session::spawn_context_refresh(f.root, session.job_ctx.clone(), tx.clone());
        crate::session::watch_root_alive(f.root, tx.clone(), session.logs_behind.clone());
        self.follow_logs(&f, &tx, &session.logs_behind);
        let (kernel, node, done) = (self.kernel.clone(), self.node.clone(), self.done_tx.clone());
        let key3 = key.clone();
        tokio::spawn(async move {
            let _ = session.drive(rx, kernel, Some(node)).await;
            let _ = done.send(key3).await;
        });
        crate::say!(
            "nantrace: watching job {key} (root pid {}, {} process(es), uid {}, found by {}{}): {}",
            f.root,
            f.pids.len(),
            f.uid,
            f.reason,
            if f.gpus.is_empty() {
                String::new()
            } else {
                format!(", GPUs {:?}", f.gpus)
            },
            crate::term::clean(&identity.to_string())
        );
        self.metrics.inc(
            "nantrace_jobs_seen_total",
            &[("kind", identity["kind"].as_str().unwrap_or("process"))],
        );
        let pids = f.pids.clone();
        st.jobs.insert(
            key.clone(),
            Job {
                found: f,
                tx,
                since_ns: monotonic_ns(),
                logs: Vec::new(),
                incidents: 0,
            },
        );
        self.adopt(st, &key, &pids);
        // The others' shares shrink.
        let share = self.share(st.jobs.len());
        for j in st.jobs.values() {
            let _ = j.tx.try_send(Input::Budget(share));
        }
    }

    /// A job's session: its incidents shared through the job directory (when the job has a
    /// name there), its dumps handed to the agent (metrics, spool, history, drains, webhook).
    fn job_session(&self, f: &Found, identity: &Value, tx: &mpsc::Sender<Input>) -> Session {
        let key = f.key.clone();
        let mut opts = self.cfg.session_opts();
        opts.mem_cap_mb = 0; // set in bytes (`Input::Budget`)
        let info = JobInfo {
            root_pid: Some(f.root),
            command: crate::collect::cmdline(f.root),
            exit_code: None,
            exit_signal: None,
            exit_core_dumped: false,
            identity: Some(json!({ "job": key, "found_by": f.reason, "scheduler": identity })),
        };
        let m2 = self.metrics.clone();
        // A job with a name in the job directory: its incidents are the job's on every node.
        let shared = self.jobdir.clone().zip(jobdir::job_key(identity));
        let jd_open = shared.clone();
        if let Some((jd, job)) = &shared {
            let _ = jd.send(jobdir::Msg::Watch {
                job: job.clone(),
                key: key.clone(),
                owner: jobdir::owner(f.uid),
                tx: tx.clone(),
            });
        }
        let key_open = key.clone();
        let hook = incident::Hook {
            key: key.clone(),
            identity: identity.clone(),
            host: self.host.clone(),
            job_uid: f.uid,
            gpucheck: self.cfg.gpucheck_after_nan,
            trust_user_written_kmsg: self.cfg.trust_user_written_kmsg,
            metrics: self.metrics.clone(),
            state: self.state.clone(),
            webhook: self.webhook.clone(),
            jobdir: shared.map(|(jd, _)| jd),
            drainer: self.drainer.clone(),
            history: self.history.clone(),
        };
        Session::new(opts, info, Mode::Follow)
            .with_label(format!("job {key}: "))
            .on_fault(move |fam| {
                m2.inc(
                    "nantrace_job_output_failures_total",
                    &[("family", fam.as_str())],
                )
            })
            .on_open(move |trigger, reason| {
                if let Some((jd, _)) = &jd_open {
                    let _ = jd.send(jobdir::Msg::Opened {
                        key: key_open.clone(),
                        trigger: trigger.to_string(),
                        reason: reason.to_string(),
                        at: crate::clock::realtime_ns(),
                    });
                }
            })
            .on_dump(move |d| hook.dumped(d))
            .on_full(self.make_room())
    }

    /// Its log files, found without being told (scontrol may take a moment: not here), each
    /// followed into the job's session (`tx`).
    fn follow_logs(&self, f: &Found, tx: &mpsc::Sender<Input>, behind: &Arc<AtomicU64>) {
        let (f2, tx2, state, pod_dir, proc_root, behind) = (
            f.clone(),
            tx.clone(),
            self.state.clone(),
            self.cfg.pod_log_dir.clone(),
            self.proc_root.clone(),
            behind.clone(),
        );
        let mut scanner = crate::nanscan::Scanner::new(&self.cfg.nan_patterns).unwrap_or_default();
        scanner.grad_rule = crate::nanscan::GradRule::Auto;
        let host = self.host.clone();
        tokio::spawn(async move {
            let logs = logs::find_logs(&f2, &pod_dir, &proc_root, &host).await;
            for (path, format) in &logs {
                crate::say!(
                    "nantrace: job {}: following {}",
                    f2.key,
                    crate::term::clean(&path.display().to_string())
                );
                // The kubelet's logs belong to root whoever the container runs as.
                let owner = if *format == LogFormat::Cri { 0 } else { f2.uid };
                follow_file(
                    path.clone(),
                    f2.root,
                    *format,
                    Some(owner),
                    scanner.clone(),
                    tx2.clone(),
                    behind.clone(),
                );
            }
            if logs.is_empty() {
                crate::say!("nantrace: job {}: no log file found (its output is a pipe or a terminal): kernel and exit evidence only", f2.key);
            }
            if let Some(j) = lock(&state).jobs.get_mut(&f2.key) {
                j.logs = logs.into_iter().map(|l| l.0).collect();
            }
        });
    }

    /// A job's session is over: forgotten (for a while, so a late scan does not bring it
    /// back), its share given to the others.
    pub(super) fn job_ended(&self, key: &str) {
        let mut st = lock(&self.state);
        let now = monotonic_ns();
        let root = st.jobs.get(key).map_or(0, |j| j.found.root);
        st.ended.insert(key.to_string(), (now, root));
        st.ended.retain(|_, t| now - t.0 < 30_000_000_000);
        if let Some(jd) = &self.jobdir {
            let _ = jd.send(jobdir::Msg::Unwatch {
                key: key.to_string(),
            });
        }
        if let Some(j) = st.jobs.remove(key) {
            crate::say!(
                "nantrace: job {key} ended after {:.0} s ({} incident(s))",
                (monotonic_ns() - j.since_ns) as f64 / 1e9,
                j.incidents
            );
        }
        st.pid_job.retain(|_, k| k != key);
        let share = self.share(st.jobs.len());
        for j in st.jobs.values() {
            let _ = j.tx.try_send(Input::Budget(share));
        }
        self.metrics
            .set("nantrace_jobs_watched", &[], st.jobs.len() as f64);
    }
}
