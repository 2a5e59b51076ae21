//! The incident recorder's engine, shared by `run`, `attach` and `demo`: kernel events, the
//! job's output and collector samples flow into the flight recorder; triggers open an incident;
//! after the post-window (or the job's end) the bundle is written.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::sync::mpsc;

mod cri;
mod dump;
mod follow;
mod inputs;
mod kernel;
mod logs;
mod pipes;
mod progress;
mod run;
mod writers;
use dump::{DumpDone, OwnedDump};
pub use follow::{follow_file, LogFormat};
pub use kernel::Kernel;
pub use logs::{LineReader, LineSplitter};
pub use run::{run, spawn_context_refresh, watch_root_alive};

use crate::bundle::{Host, JobInfo};
use crate::clock::{monotonic_ns, ClockMap};
use crate::event::Event;
use crate::recorder::Recorder;
use crate::trigger::{Enabled, Fired, TriggerKind};

#[derive(Clone, Debug)]
pub struct SessionOpts {
    pub out: PathBuf,
    pub window_s: f64,
    pub mem_cap_mb: usize,
    pub post_s: f64,
    pub no_trigger: Vec<TriggerKind>,
    pub trigger_file: Option<PathBuf>,
    pub nan_patterns: Vec<String>,
    pub grad_rule: crate::nanscan::GradRule,
    pub slow_io_ms: f64,
    pub sample_s: f64,
    /// Run without eBPF (tests of the log path, unprivileged use): said in the bundle.
    pub no_probes: bool,
    /// Label for injected faults (demo scenarios), recorded in the bundle.
    pub injected: Option<String>,
    /// Run mode: the identity the job is switched to (see `privdrop`); None: nantrace's own.
    pub run_as: Option<crate::privdrop::RunAs>,
    /// Run mode: set PYTHONUNBUFFERED=1 for the job unless it is already set (redteam 2.14).
    pub unbuffered: bool,
    /// The stall trigger: no step or loss line for this long (seconds) after one was seen,
    /// while the job runs. 0: off.
    pub hang_after_s: f64,
    /// Kernel log lines root's processes wrote into `/dev/kmsg` count as the kernel's (the
    /// agent's `trust_user_written_kmsg`, a test cluster injecting faults); else each dump
    /// checks who wrote its kernel log lines (`writers`).
    pub trust_user_written_kmsg: bool,
}

impl Default for SessionOpts {
    fn default() -> Self {
        Self {
            out: PathBuf::from("."),
            window_s: 600.0,
            mem_cap_mb: 256,
            post_s: 15.0,
            no_trigger: Vec::new(),
            trigger_file: None,
            nan_patterns: Vec::new(),
            grad_rule: crate::nanscan::GradRule::Auto,
            slow_io_ms: 50.0,
            sample_s: 1.0,
            no_probes: false,
            injected: None,
            run_as: None,
            unbuffered: true,
            hang_after_s: 0.0,
            trust_user_written_kmsg: false,
        }
    }
}

#[derive(Clone, Debug)]
pub enum Job {
    /// `nantrace run -- CMD...`
    Spawn(Vec<String>),
    /// `nantrace attach --pid PID --log FILE...`
    Attach { pid: u32, logs: Vec<PathBuf> },
}

/// What reaches a session: kernel batches, the job's lines, collector samples, the job's end,
/// triggers from outside.
pub enum Input {
    Kernel(Vec<Event>),
    Log(Event),
    Samples(Vec<Event>),
    JobExit {
        code: Option<i32>,
        signal: Option<i32>,
        core_dumped: bool,
    },
    /// A trigger from outside, with the time it was received.
    Fire(TriggerKind, String, u64),
    /// The recorder's share of the agent's budget changed (bytes).
    Budget(usize),
}

/// What the session did, for the caller (exit code) and tests.
pub struct Outcome {
    pub exit_code: i32,
    pub bundles: Vec<PathBuf>,
    /// An incident was dumped (even when its bundle could not be written).
    pub dumped: bool,
}

/// The post-window of a job-wide dump another node asked for (at most `post_s`).
pub const JOB_WIDE_POST_S: f64 = 2.0;

/// One bundle written (or not), as the agent's metrics and webhook see it.
#[derive(Clone, Debug, Default)]
pub struct Dumped {
    pub dir: Option<PathBuf>,
    pub verdict: Option<String>,
    pub family: Option<String>,
    pub top_suspect: Option<String>,
    /// The top suspect's signal (`report::rules`) and NVIDIA's recommended action for it,
    /// when it has one: what a drain decides on (`agent::drain`).
    pub top_signal: Option<&'static str>,
    pub top_action: Option<&'static str>,
    /// The top suspect's kernel log lines, and whether a witness no user writes (NVML, a
    /// tracepoint) saw it too: what a drain checks before it acts (`agent::drain`).
    pub top_kernel_lines: Vec<crate::klog::Line>,
    pub top_unforgeable: bool,
    /// The GPUs the verdict implicates on the kernel's or NVML's evidence: (PCI, UUID).
    pub gpus: Vec<(String, Option<String>)>,
    /// The faults behind `gpus`, each once: (PCI, signal, wall time in ms).
    pub faults: Vec<(String, &'static str, i64)>,
    /// Who saw each of `gpus`' faults (what the history checks before it counts them).
    pub gpu_witnesses: Vec<crate::report::GpuWitness>,
    pub trigger: String,
}

type DumpHook = Box<dyn Fn(&Dumped) + Send>;
type FaultHook = Box<dyn Fn(crate::joblog::JobFamily) + Send>;
type OpenHook = Box<dyn Fn(&str, &str) + Send>;
/// See [`Session::on_full`].
pub type RoomHook = Arc<dyn Fn(Option<&std::path::Path>) -> Vec<PathBuf> + Send + Sync>;

/// How the job is tied to the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// nantrace started the job: its exit status comes from `wait`, signals to nantrace go on
    /// to the job.
    Spawn,
    /// A job that was already running (attach, the agent): its exit status comes from the
    /// kernel's exit event of its root.
    Follow,
}

/// One job's recorder: its window, its incident state machine, its dumps. Fed by `on_input`,
/// advanced by `step`; `drive` does both until the job and its last dump are over.
pub struct Session {
    opts: SessionOpts,
    enabled: Enabled,
    /// The triggers turned off that fired: each is said once (an operator sees why nothing
    /// was written).
    said_off: Vec<TriggerKind>,
    host: Host,
    pub info: JobInfo,
    mode: Mode,
    rec: Recorder,
    counts: BTreeMap<&'static str, u64>,
    incident: Vec<Fired>,
    deadline: Option<u64>,
    /// The post-window of the incident being recorded (`post_s`, or `JOB_WIDE_POST_S`).
    post_used_s: f64,
    seen_nan: bool,
    seen_job_error: bool,
    last_job_error: u64,
    /// The last step or loss line (monotonic ns), and whether the stall trigger fired since.
    last_progress: Option<u64>,
    stalled: bool,
    /// The job's I/O and CPU counters at half the stall's silence (see `progress`), and
    /// whether "still reading or writing" was said for this silence.
    stall_probe: Option<progress::Sample>,
    stall_pending: Option<progress::Pending>,
    stall_busy_said: bool,
    job_done: bool,
    finish: bool,
    /// When the last dump ended: a signal received while dumping is answered by that dump,
    /// not by a second, duplicate bundle (6.5, 6.6).
    last_dump_end: u64,
    dumping_since: Option<u64>,
    quiet_exit: bool,
    /// The dump runs on a blocking thread while the session goes on draining the job's output
    /// and the kernel stream (redteam 2.8: the job was blocked 12.9 s by an inline dump).
    dump_task: Option<tokio::task::JoinHandle<DumpDone>>,
    snapshot_task: Option<tokio::task::JoinHandle<serde_json::Value>>,
    /// The job's context (environment, libraries, cgroup), refreshed while it is alive.
    pub job_ctx: Arc<Mutex<Option<serde_json::Value>>>,
    clock: ClockMap,
    last_clock: u64,
    bundles: Vec<PathBuf>,
    dumped_any: bool,
    /// Bytes of the job's output passed through but not scanned (the scanner was behind).
    pub not_scanned: Arc<AtomicU64>,
    /// Log followers not yet at the end of their file (see `follow_file`).
    pub logs_behind: Arc<AtomicU64>,
    /// Said before every line this session prints (the agent: the job's name).
    label: String,
    /// Called with each dump's result (the agent's metrics, webhook, spool).
    on_dump: Option<DumpHook>,
    /// Called with the family of each failure line of the job's output (the agent's metrics).
    on_fault: Option<FaultHook>,
    /// Called when an incident opens, with its first trigger's kind and reason (the agent's
    /// job directory: the other nodes of the job dump too).
    on_open: Option<OpenHook>,
    /// Called when a bundle could not be written for a full disk: frees room (the agent's
    /// spool evicts older bundles) and returns what it removed; the dump is then tried again.
    make_room: Option<RoomHook>,
}

impl Session {
    pub fn new(opts: SessionOpts, info: JobInfo, mode: Mode) -> Self {
        let rec = Recorder::new(
            (opts.window_s * 1e9) as u64,
            opts.mem_cap_mb.saturating_mul(1 << 20),
        );
        Self {
            enabled: Enabled::all_but(&opts.no_trigger),
            said_off: Vec::new(),
            host: Host::read(),
            info,
            mode,
            rec,
            counts: BTreeMap::new(),
            incident: Vec::new(),
            deadline: None,
            post_used_s: opts.post_s,
            seen_nan: false,
            seen_job_error: false,
            last_job_error: 0,
            last_progress: None,
            stalled: false,
            stall_probe: None,
            stall_pending: None,
            stall_busy_said: false,
            job_done: false,
            finish: false,
            last_dump_end: 0,
            dumping_since: None,
            quiet_exit: false,
            dump_task: None,
            snapshot_task: None,
            job_ctx: Arc::new(Mutex::new(None)),
            clock: ClockMap::sample(),
            last_clock: monotonic_ns(),
            bundles: Vec::new(),
            dumped_any: false,
            not_scanned: Arc::new(AtomicU64::new(0)),
            logs_behind: Arc::new(AtomicU64::new(0)),
            label: String::new(),
            on_dump: None,
            on_fault: None,
            on_open: None,
            make_room: None,
            opts,
        }
    }

    /// A prefix for this session's messages (`job slurm:42: `).
    pub fn with_label(mut self, label: String) -> Self {
        self.label = label;
        self
    }

    pub fn on_dump(mut self, f: impl Fn(&Dumped) + Send + 'static) -> Self {
        self.on_dump = Some(Box::new(f));
        self
    }

    pub fn on_fault(mut self, f: impl Fn(crate::joblog::JobFamily) + Send + 'static) -> Self {
        self.on_fault = Some(Box::new(f));
        self
    }

    pub fn on_open(mut self, f: impl Fn(&str, &str) + Send + 'static) -> Self {
        self.on_open = Some(Box::new(f));
        self
    }

    pub fn on_full(mut self, f: RoomHook) -> Self {
        self.make_room = Some(f);
        self
    }

    /// Bytes held by this session's recorder.
    pub fn recorder_bytes(&self) -> usize {
        self.rec.bytes()
    }

    /// An incident is open or being written.
    pub fn busy(&self) -> bool {
        !self.incident.is_empty() || self.dump_task.is_some()
    }

    fn say(&self, line: &str) {
        if self.label.is_empty() {
            crate::say!("{line}");
        } else {
            crate::say!(
                "nantrace: {}{}",
                self.label,
                line.strip_prefix("nantrace: ").unwrap_or(line)
            );
        }
    }

    /// Periodic work: the snapshot at the first trigger, the window's expiry, a finished dump
    /// collected, a due dump started. `node`: the agent's node-wide recorder, whose window
    /// joins this job's in its bundle. Returns true when the session is over.
    pub async fn step(&mut self, kernel: &Kernel, node: Option<&Mutex<Recorder>>) -> bool {
        if !self.incident.is_empty() && self.snapshot_task.is_none() {
            // The state at the trigger (not at the dump, when the job may be gone).
            let (root, cached) = (
                self.info.root_pid,
                self.job_ctx
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone(),
            );
            self.snapshot_task = Some(tokio::task::spawn_blocking(move || {
                crate::collect::snapshot_with(root, cached)
            }));
        }
        let now = monotonic_ns();
        self.check_stall(now);
        if now - self.last_clock > 10_000_000_000 {
            self.clock = ClockMap::sample();
            self.last_clock = now;
        }
        self.rec.expire(now);
        // Once its incident is written, a later failure line can open the next one (at most
        // one a minute: a job that prints an error per step does not write a bundle per step).
        if self.seen_job_error
            && self.incident.is_empty()
            && self.dump_task.is_none()
            && now.saturating_sub(self.last_job_error) > 60_000_000_000
        {
            self.seen_job_error = false;
        }
        if self
            .dump_task
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished)
        {
            let done = self
                .dump_task
                .take()
                .expect("checked")
                .await
                .unwrap_or_else(|e| {
                    DumpDone::failed(format!("nantrace: ERROR: the dump failed: {e}"))
                });
            self.collect_dump(done);
            if self.job_done && self.incident.is_empty() {
                self.finish = true;
            }
        }
        if self.deadline.is_some_and(|d| now >= d)
            && !self.incident.is_empty()
            && self.dump_task.is_none()
        {
            self.start_dump(kernel, node);
        }
        self.finish && self.incident.is_empty() && self.dump_task.is_none()
    }

    fn collect_dump(&mut self, mut done: DumpDone) {
        if let Some(l) = done.lanes.take() {
            self.rec.restore(l);
        }
        for l in &done.lines {
            self.say(l);
        }
        if let Some(f) = &self.on_dump {
            f(&done.result);
        }
        self.bundles.extend(done.result.dir.clone());
        self.dumped_any = true;
        self.last_dump_end = monotonic_ns();
        self.dumping_since = None;
    }

    fn start_dump(&mut self, kernel: &Kernel, node: Option<&Mutex<Recorder>>) {
        // From here a signal is answered by this dump, not by a second bundle (6.5, 6.6).
        self.dumping_since = Some(monotonic_ns());
        let mut accounting = kernel.accounting(&self.counts);
        accounting["recorder"] = serde_json::to_value(self.rec.stats()).unwrap_or_default();
        accounting["injected"] = json!(self.opts.injected);
        accounting["log_bytes_not_scanned"] = json!(self.not_scanned.load(Ordering::Relaxed));
        // The node's window (the agent): copied, as other jobs share it.
        let shared = node.map(|n| {
            let n = n.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            accounting["node_recorder"] = serde_json::to_value(n.stats()).unwrap_or_default();
            n.iter().cloned().collect::<Vec<Event>>()
        });
        // The window moves to the dump (no copy: the dump's memory is the recorder's).
        let d = OwnedDump {
            out: self.opts.out.clone(),
            host: self.host.clone(),
            clock: self.clock,
            triggers: std::mem::take(&mut self.incident),
            job: self.info.clone(),
            accounting,
            lanes: self.rec.take_lanes(),
            shared: shared.unwrap_or_default(),
            window_pre_s: self.opts.window_s,
            post_s: self.post_used_s,
            snapshot: self.snapshot_task.take(),
            make_room: self.make_room.clone(),
            check_writers: !self.opts.trust_user_written_kmsg,
        };
        self.dump_task = Some(tokio::task::spawn_blocking(move || d.write()));
        self.deadline = None;
    }

    /// Feed and advance the session until it is over; then wait for a dump still running.
    pub async fn drive(
        mut self,
        mut rx: mpsc::Receiver<Input>,
        kernel: Arc<Kernel>,
        node: Option<Arc<Mutex<Recorder>>>,
    ) -> Outcome {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                input = rx.recv() => match input {
                    Some(i) => self.on_input(i),
                    None => break,
                },
                _ = tick.tick() => {}
            }
            if self.step(&kernel, node.as_deref()).await {
                break;
            }
        }
        // A dump still running when the inputs ended is waited for, not abandoned.
        if let Some(t) = self.dump_task.take() {
            if let Ok(done) = t.await {
                self.collect_dump(done);
            }
        }
        let unscanned = self.not_scanned.load(Ordering::Relaxed);
        if unscanned > 0 {
            self.say(&format!("nantrace: WARNING: {unscanned} bytes of the job's output were passed through without the full scan (a flood faster than the scanner): only their lines with a NaN or failure word were read"));
        }
        let exit_code = match (self.info.exit_code, self.info.exit_signal) {
            (_, Some(s)) => 128 + s,
            (Some(c), None) => c,
            (None, None) => 0,
        };
        Outcome {
            exit_code,
            bundles: self.bundles,
            dumped: self.dumped_any,
        }
    }
}
