//! `nantrace agent`: one process per node that finds training jobs by itself and records each
//! one as `run`/`attach` would, from one shared set of probes.
//!
//! Data flow: the probes' ring -> the router (here) -> the job whose process tree the event
//! belongs to (its `Session`), or the node-wide recorder (hardware, other processes); the
//! collectors' samples -> the node-wide recorder; each job's log files -> its session. A job's
//! bundle is its own window joined with the node's. Node-wide triggers (a fatal Xid) go to the
//! jobs on that GPU.
pub mod config;
pub mod ctl;
pub mod discover;
pub mod drain;
pub mod history;
mod incident;
pub mod jobdir;
mod logs;
pub mod metrics;
pub use crate::collect::ranks;
mod scanner;
pub mod spool;
pub mod trust;
pub mod webhook;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::bundle::JobInfo;
use crate::classify::KmsgClass;
use crate::clock::monotonic_ns;
use crate::event::{Detail, Event};
use crate::recorder::Recorder;
use crate::session::{follow_file, Input, Kernel, LogFormat, Mode, Session};
use crate::trigger::TriggerKind;
pub use config::Args;
use config::Config;
use discover::Found;
use metrics::Metrics;

/// One watched job.
struct Job {
    found: Found,
    tx: mpsc::Sender<Input>,
    since_ns: u64,
    logs: Vec<PathBuf>,
    incidents: u32,
}

/// What the agent knows, shared by its loop, the dump callbacks and the control socket.
struct State {
    jobs: BTreeMap<String, Job>,
    /// Process (tgid) -> job key, grown by the fork events of job processes.
    pid_job: HashMap<u32, String>,
    incidents: VecDeque<Value>,
    /// NaN bundles without hardware evidence, waiting for the GPUs to be free (gpucheck).
    gpucheck_queue: Vec<PathBuf>,
    /// Jobs that ended recently (key -> when): a /proc scan taken just before the end does
    /// not bring them back.
    ended: HashMap<String, (u64, u32)>,
    /// A bundle was written: the spool's usage is measured again.
    spool_dirty: bool,
    /// Jobs over the limits at the last scan, and those already said.
    not_watched: usize,
    not_watched_said: std::collections::HashSet<String>,
    /// Whose bundle is whose (uid), for the spool's per-user eviction.
    bundle_uid: HashMap<PathBuf, u32>,
}

const MAX_INCIDENTS_LISTED: usize = 200;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct Agent {
    cfg: Config,
    args: Args,
    kernel: Arc<Kernel>,
    node: Arc<Mutex<Recorder>>,
    state: Arc<Mutex<State>>,
    metrics: Arc<Metrics>,
    webhook: Option<mpsc::Sender<Value>>,
    done_tx: mpsc::Sender<String>,
    host: String,
    started: u64,
    proc_root: PathBuf,
    /// The job directory's thread (`job_dir`), when there is one.
    jobdir: Option<std::sync::mpsc::Sender<jobdir::Msg>>,
    /// Drains through the scheduler (`drain`), when not off.
    drainer: Option<Arc<drain::Drainer>>,
    /// The durable index of this node's incidents (`<spool>/.history.jsonl`).
    history: Arc<Mutex<history::History>>,
}

impl Agent {
    /// Each job's share of the jobs' half of the budget.
    fn share(&self, jobs: usize) -> usize {
        (self.cfg.mem_cap_mb << 20) / 2 / jobs.max(1)
    }

    fn route(&self, batch: Vec<Event>) {
        let mut per_job: HashMap<String, Vec<Event>> = HashMap::new();
        let mut node_fires: Vec<(TriggerKind, String, Option<u32>)> = Vec::new();
        {
            let mut st = lock(&self.state);
            let mut node = lock(&self.node);
            for e in batch {
                metrics::observe(&self.metrics, &e);
                let mut job = st.pid_job.get(&e.pid).cloned();
                match &e.detail {
                    Detail::Fork { child_pid, .. } => {
                        if let Some(j) = &job {
                            st.pid_job.insert(*child_pid, j.clone());
                        }
                    }
                    // An OOM kill belongs to the victim's job.
                    Detail::Oom(o) => job = st.pid_job.get(&o.victim_pid).cloned(),
                    Detail::Exit { .. } if e.pid == e.tid() => {
                        st.pid_job.remove(&e.pid);
                    }
                    _ => {}
                }
                match job {
                    Some(j) => per_job.entry(j).or_default().push(e),
                    None => {
                        if let Some(f) = crate::trigger::from_event(&e, false) {
                            let minor = match &e.detail {
                                Detail::Kmsg(k) => match k.class() {
                                    Some(KmsgClass::Xid { pci, .. }) => discover::gpu_minor_of(pci),
                                    _ => None,
                                },
                                _ => None,
                            };
                            node_fires.push((f.kind, f.reason, minor));
                        }
                        node.push(e);
                    }
                }
            }
            for (key, batch) in per_job {
                if let Some(j) = st.jobs.get(&key) {
                    let n = batch.len();
                    if j.tx.try_send(Input::Kernel(batch)).is_err() {
                        self.metrics.add(
                            "nantrace_events_dropped_total",
                            &[("reason", "job queue full")],
                            n as f64,
                        );
                    }
                }
            }
            // A fatal Xid dumps every job on that GPU (every GPU job when the GPU is not known,
            // every job when none holds a GPU device).
            for (kind, reason, minor) in node_fires {
                let on_gpu: Vec<&Job> = st
                    .jobs
                    .values()
                    .filter(|j| minor.is_some_and(|m| j.found.gpus.contains(&m)))
                    .collect();
                let targets: Vec<&Job> = if !on_gpu.is_empty() {
                    on_gpu
                } else if st.jobs.values().any(|j| !j.found.devices.is_empty()) {
                    st.jobs
                        .values()
                        .filter(|j| !j.found.devices.is_empty())
                        .collect()
                } else {
                    st.jobs.values().collect()
                };
                for j in targets {
                    let _ =
                        j.tx.try_send(Input::Fire(kind, reason.clone(), monotonic_ns()));
                }
            }
        }
    }

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

    fn reconcile(&self, mut found: Vec<Found>) {
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

    fn start_job(&self, st: &mut State, f: Found) {
        let key = f.key.clone();
        let identity = f.identity();
        let mut opts = self.cfg.session_opts();
        opts.mem_cap_mb = 0; // set in bytes below
        let info = JobInfo {
            root_pid: Some(f.root),
            command: crate::collect::cmdline(f.root),
            exit_code: None,
            exit_signal: None,
            exit_core_dumped: false,
            identity: Some(json!({ "job": key, "found_by": f.reason, "scheduler": identity })),
        };
        let (tx, rx) = mpsc::channel::<Input>(4096);
        let m2 = self.metrics.clone();
        // A job with a name in the job directory: its incidents are the job's on every node.
        let shared = self.jobdir.clone().zip(jobdir::job_key(&identity));
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
        let session = Session::new(opts, info, Mode::Follow)
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
            .on_full(self.make_room());
        let share = self.share(st.jobs.len() + 1);
        let _ = tx.try_send(Input::Budget(share));
        crate::session::spawn_context_refresh(f.root, session.job_ctx.clone(), tx.clone());
        crate::session::watch_root_alive(f.root, tx.clone(), session.logs_behind.clone());
        // Its log files, found without being told (scontrol may take a moment: not here).
        {
            let (f2, tx2, state, pod_dir, proc_root, behind) = (
                f.clone(),
                tx.clone(),
                self.state.clone(),
                self.cfg.pod_log_dir.clone(),
                self.proc_root.clone(),
                session.logs_behind.clone(),
            );
            let mut scanner =
                crate::nanscan::Scanner::new(&self.cfg.nan_patterns).unwrap_or_default();
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

    fn job_ended(&self, key: &str) {
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

    fn housekeeping(&self) {
        let now = monotonic_ns();
        lock(&self.node).expire(now);
        let m = &self.metrics;
        let drops = self.kernel.drops();
        m.set_all(
            "nantrace_ringbuf_drops_total",
            &drops
                .iter()
                .map(|(k, v)| (vec![("source", k.as_str())], *v as f64))
                .collect::<Vec<_>>(),
        );
        m.set(
            "nantrace_probes_attached",
            &[],
            self.kernel.attached() as f64,
        );
        m.set(
            "nantrace_probes_failed",
            &[],
            self.kernel.probes_not_attached().len() as f64,
        );
        m.set(
            "nantrace_recorder_bytes",
            &[("recorder", "node")],
            lock(&self.node).bytes() as f64,
        );
    }

    /// The sessions' hook for a full disk (`spool::room_hook`).
    fn make_room(&self) -> crate::session::RoomHook {
        spool::room_hook(self.cfg.spool_dir.clone(), self.metrics.clone())
    }

    fn spool(&self) {
        let known = lock(&self.state).bundle_uid.clone();
        let removed = spool::enforce(
            &self.cfg.spool_dir,
            self.cfg.spool_max_mb << 20,
            self.cfg.spool_max_age_days * 86_400.0,
            &|p| known.get(p).copied().or_else(|| spool::bundle_uid(p)),
        );
        for r in &removed {
            crate::say!("nantrace: spool: removed {} (size/age limit)", r.display());
        }
        if !removed.is_empty() {
            lock(&self.state)
                .bundle_uid
                .retain(|p, _| !removed.contains(p));
        }
        self.metrics
            .add("nantrace_spool_removed_total", &[], removed.len() as f64);
        let u = spool::usage(&self.cfg.spool_dir);
        self.metrics
            .set("nantrace_spool_bytes", &[], u.bytes as f64);
        self.metrics
            .set("nantrace_spool_bundles", &[], u.bundles as f64);
        self.metrics.set(
            "nantrace_spool_incomplete_bundles",
            &[],
            u.incomplete as f64,
        );
        self.metrics.set(
            "nantrace_spool_limit_bytes",
            &[],
            (self.cfg.spool_max_mb << 20) as f64,
        );
    }
}

/// Run the agent until SIGTERM/SIGINT.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let cfg = args.config()?;
    spool::open_spool(&cfg.spool_dir)?;
    // Dumps a crash cut short (D-8): kept as incomplete bundles, said, and counted below.
    let (kept, problems) = crate::bundle::recover::recover(&cfg.spool_dir);
    crate::bundle::recover::say(&kept, &problems);
    let proc_root = args
        .proc_root
        .clone()
        .unwrap_or_else(|| PathBuf::from("/proc"));
    let pci = metrics::PciDevices::new(
        args.pci_devices
            .as_deref()
            .unwrap_or(Path::new("/sys/bus/pci/devices")),
    );
    let _ = metrics::PCI.set(pci);
    let metrics = Arc::new(Metrics::default());
    metrics.set(
        "nantrace_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    let kernel = Arc::new(if args.no_probes {
        Kernel::none("disabled with --no-probes")
    } else {
        Kernel::load(&[], cfg.slow_io_ms, false)
    });
    let node = Arc::new(Mutex::new(Recorder::new(
        (cfg.window_s * 1e9) as u64,
        (cfg.mem_cap_mb << 20) / 2,
    )));
    let state = Arc::new(Mutex::new(State {
        jobs: BTreeMap::new(),
        pid_job: HashMap::new(),
        incidents: VecDeque::new(),
        gpucheck_queue: Vec::new(),
        ended: HashMap::new(),
        spool_dirty: true,
        not_watched: 0,
        not_watched_said: std::collections::HashSet::new(),
        bundle_uid: HashMap::new(),
    }));
    let webhook = (!cfg.webhook_url.is_empty()).then(|| {
        webhook::spawn(
            cfg.webhook_url.clone(),
            Duration::from_secs_f64(cfg.webhook_timeout_s),
            cfg.webhook_retries,
            metrics.clone(),
        )
    });
    let (done_tx, mut done_rx) = mpsc::channel::<String>(64);
    // The metrics port first: a second agent fails there, before it touches the socket.
    if !cfg.metrics_addr.is_empty() {
        metrics::serve(cfg.metrics_addr.parse()?, metrics.clone())
            .await
            .with_context(|| format!("metrics on {}", cfg.metrics_addr))?;
    }
    let listener = ctl::bind(&cfg.socket)?;
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<ctl::Request>(16);
    ctl::serve(listener, ctl_tx);
    let (ktx, mut krx) = mpsc::channel(256);
    kernel.start_stream(ktx)?;
    {
        let node = node.clone();
        crate::collect::spawn_samplers(cfg.sample_s, None, move |batch| {
            let mut n = lock(&node);
            batch.into_iter().for_each(|e| n.push(e));
            true
        });
    }
    // Discovery on a thread of its own (/proc reads block).
    let scanner::Scanner {
        results: mut disc_rx,
        scan_now,
        control: cfg_tx,
    } = scanner::spawn(discover::Discovery::new(proc_root.clone(), &cfg), &cfg)?;
    let host = crate::bundle::Host::read().hostname;
    let jobdir = jobdir::start(&cfg.job_dir, &host, &metrics);
    let drainer = drain::start(&cfg, &host, jobdir.is_some());
    let history = history::start(&cfg.spool_dir, &metrics);
    let mut agent = Agent {
        cfg,
        args,
        kernel,
        node,
        state,
        metrics,
        webhook,
        done_tx,
        host,
        started: monotonic_ns(),
        proc_root,
        jobdir,
        drainer,
        history,
    };
    crate::say!(
        "nantrace: agent {} on {}: {} probes attached, spool {}, socket {}, metrics {}",
        env!("CARGO_PKG_VERSION"),
        agent.host,
        agent.kernel.attached(),
        agent.cfg.spool_dir.display(),
        agent.cfg.socket.display(),
        if agent.cfg.metrics_addr.is_empty() {
            "off"
        } else {
            &agent.cfg.metrics_addr
        }
    );

    use tokio::signal::unix::{signal, SignalKind};
    let (mut hup, mut term, mut int) = (
        signal(SignalKind::hangup())?,
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut ticks = 0u64;
    let mut gpucheck_task: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        tokio::select! {
            // Without probes the stream is closed from the start: the branch is off, the
            // agent goes on with log and exit evidence (review 1).
            Some(b) = krx.recv() => agent.route(b),
            Some((found, secs)) = disc_rx.recv() => {
                agent.metrics.set("nantrace_discovery_seconds", &[], secs);
                agent.reconcile(found);
            }
            Some((req, reply)) = ctl_rx.recv() => {
                let _ = reply.send(agent.answer(&req, &scan_now, &cfg_tx));
            }
            Some(key) = done_rx.recv() => agent.job_ended(&key),
            _ = hup.recv() => match agent.args.config() {
                Ok(c) => {
                    let _ = cfg_tx.send(scanner::DiscMsg::Config(Box::new(c.clone())));
                    if c.spool_dir != agent.cfg.spool_dir || c.socket != agent.cfg.socket || c.metrics_addr != agent.cfg.metrics_addr || c.webhook_url != agent.cfg.webhook_url {
                        crate::say!("nantrace: config reloaded; spool_dir, socket, metrics_addr and webhook_url take effect at the next start");
                    } else {
                        crate::say!("nantrace: config reloaded");
                    }
                    let (spool_dir, socket, metrics_addr, webhook_url) = (agent.cfg.spool_dir.clone(), agent.cfg.socket.clone(), agent.cfg.metrics_addr.clone(), agent.cfg.webhook_url.clone());
                    agent.cfg = Config { spool_dir, socket, metrics_addr, webhook_url, ..c };
                }
                Err(e) => crate::say!("nantrace: ERROR: config not reloaded (the old one stays): {e:#}"),
            },
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = tick.tick() => {
                ticks += 1;
                agent.housekeeping();
                let dirty = std::mem::take(&mut lock(&agent.state).spool_dirty);
                if dirty || ticks.is_multiple_of(30) {
                    agent.spool();
                }
                if ticks.is_multiple_of(60) {
                    history::set_gauges(&lock(&agent.history), &agent.metrics);
                }
                // gpucheck after a NaN: once no watched job holds a GPU device.
                if gpucheck_task.as_ref().is_none_or(tokio::task::JoinHandle::is_finished) {
                    let mut st = lock(&agent.state);
                    if !st.gpucheck_queue.is_empty() && st.jobs.values().all(|j| j.found.devices.is_empty()) {
                        let bundles = std::mem::take(&mut st.gpucheck_queue);
                        gpucheck_task = Some(tokio::task::spawn_blocking(move || crate::gpucheck::after_nan(&bundles)));
                    }
                }
            }
        }
    }
    // Drain: every open incident is written (the post-window cut short), then exit.
    crate::say!("nantrace: agent stopping: writing open incidents");
    let keys: Vec<String> = {
        let st = lock(&agent.state);
        for j in st.jobs.values() {
            let _ =
                j.tx.try_send(Input::Fire(TriggerKind::Manual, "agent stopping".into(), 0));
        }
        st.jobs.keys().cloned().collect()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut left: BTreeSet<String> = keys.into_iter().collect();
    while !left.is_empty() {
        match tokio::time::timeout_at(deadline, done_rx.recv()).await {
            Ok(Some(k)) => {
                left.remove(&k);
            }
            _ => break,
        }
    }
    let _ = std::fs::remove_file(&agent.cfg.socket);
    crate::say!("nantrace: agent stopped");
    Ok(())
}
