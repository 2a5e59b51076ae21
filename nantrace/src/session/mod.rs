//! The incident recorder's engine, shared by `run`, `attach` and `demo`: kernel events, the
//! job's output and collector samples flow into the flight recorder; triggers open an incident;
//! after the post-window (or the job's end) the bundle is written.
use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tokio::sync::mpsc;

mod dump;
mod logs;
mod pipes;
use dump::{DumpDone, OwnedDump};
use pipes::{check_log, job_got_it_from_the_terminal, one_pipe_for_both, same_destination};
pub use logs::{LineReader, LineSplitter};

use crate::bundle::{Host, JobInfo};
use crate::clock::{monotonic_ns, ClockMap};
use crate::event::{comm_from, Detail, Event};
use crate::nanscan::Scanner;
use logs::{follow_file, pump};
use crate::recorder::Recorder;
use crate::trigger::{self, Enabled, Fired, TriggerKind};
use crate::watch::{start_probes, Accounting};

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

enum Input {
    Kernel(Vec<Event>),
    Log(Event),
    Samples(Vec<Event>),
    JobExit { code: Option<i32>, signal: Option<i32> },
    /// A trigger from outside, with the time it was received.
    Fire(TriggerKind, String, u64),
}

/// What the session did, for the caller (exit code) and tests.
pub struct Outcome {
    pub exit_code: i32,
    pub bundles: Vec<PathBuf>,
    /// An incident was dumped (even when its bundle could not be written).
    pub dumped: bool,
}

/// Run a session to its end; returns the job's exit code (run mode) and the bundles written.
pub async fn run(job: Job, opts: SessionOpts) -> anyhow::Result<Outcome> {
    let mut scanner = Scanner::new(&opts.nan_patterns).context("--nan-pattern")?;
    scanner.grad_rule = opts.grad_rule;
    // A bundle that cannot be written must be said before hours of training, not after.
    crate::safefs::check_out_dir(&opts.out)?;
    let enabled = Enabled::all_but(&opts.no_trigger);
    let host = Host::read();
    let (tx, mut rx) = mpsc::channel::<Input>(4096);
    // Bytes of the job's output passed through but not scanned (the scanner was behind).
    let not_scanned = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut counts: BTreeMap<&'static str, u64> = BTreeMap::new();

    // Kernel probes: degrade to log-only evidence when they cannot load, and say so.
    let attach_pid = match &job {
        Job::Attach { pid, .. } => vec![*pid],
        Job::Spawn(_) => vec![],
    };
    let (mut probes, probe_error) = load_probes(&job, &attach_pid, &opts);
    let mut acct = probes.as_ref().map(|p| Accounting::with_probes(&p.status)).unwrap_or_default();
    crate::say!(
        "nantrace: recording ({} kernel probes attached; window {} s, cap {} MiB, post-window {} s)",
        probes.as_ref().map_or(0, |p| p.attached()),
        opts.window_s,
        opts.mem_cap_mb,
        opts.post_s
    );
    let mut reader_stats = None;
    if let Some(p) = probes.as_mut() {
        let ring = p.take_ring()?;
        let (ktx, mut krx) = mpsc::channel(256);
        let (stats, _h) = crate::stream::spawn(ring, ktx);
        reader_stats = Some(stats);
        let tx2 = tx.clone();
        tokio::spawn(async move {
            while let Some(b) = krx.recv().await {
                if tx2.send(Input::Kernel(b)).await.is_err() {
                    break;
                }
            }
        });
    }

    // The job.
    let mut info = JobInfo::default();
    match &job {
        Job::Spawn(argv) => {
            anyhow::ensure!(!argv.is_empty(), "no command given after --");
            let mut cmd = tokio::process::Command::new(&argv[0]);
            if opts.unbuffered && std::env::var_os("PYTHONUNBUFFERED").is_none() {
                // Block-buffered Python output arrives late and is stamped late (2.14).
                cmd.env("PYTHONUNBUFFERED", "1");
            }
            match &opts.run_as {
                Some(ra) => {
                    ra.apply(cmd.as_std_mut());
                    crate::say!("nantrace: the job runs as {}", ra.describe());
                }
                None => {
                    // SAFETY: geteuid has no failure mode.
                    if unsafe { libc::geteuid() } == 0 {
                        crate::say!("nantrace: the job runs as root");
                    }
                }
            }
            cmd.args(&argv[1..]).stdin(std::process::Stdio::inherit());
            // When nantrace's stdout and stderr go to the same place (`2>&1`, one terminal),
            // the job gets one pipe for both, so their order survives (redteam 2.7).
            let merged = if same_destination() { one_pipe_for_both(&mut cmd) } else { None };
            if merged.is_none() {
                cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            }
            // nantrace's own pid is in the job map while it forks the child, so the kernel map
            // holds the child from its first instruction (no race with early worker forks).
            let spawned = cmd.spawn();
            let me = std::process::id();
            if let Some(p) = probes.as_mut() {
                if let Ok(c) = &spawned {
                    if let Some(pid) = c.id() {
                        let _ = p.add_job_pid(pid);
                    }
                }
                let _ = p.remove_job_pid(me);
            }
            let mut child = spawned.with_context(|| format!("starting {:?}", argv[0]))?;
            let pid = child.id().unwrap_or(0);
            info.root_pid = Some(pid);
            info.command = crate::collect::redact::argv(argv);
            let comm = comm_from(std::path::Path::new(&argv[0]).file_name().and_then(|s| s.to_str()).unwrap_or("job"));
            let (out, err) = match merged {
                Some(rx) => (
                    tokio::spawn(pump(rx, tokio::io::stdout(), 3, pid, comm, scanner.clone(), tx.clone(), not_scanned.clone())),
                    tokio::spawn(async { None }),
                ),
                None => (
                    tokio::spawn(pump(child.stdout.take().unwrap(), tokio::io::stdout(), 1, pid, comm, scanner.clone(), tx.clone(), not_scanned.clone())),
                    tokio::spawn(pump(child.stderr.take().unwrap(), tokio::io::stderr(), 2, pid, comm, scanner.clone(), tx.clone(), not_scanned.clone())),
                ),
            };
            let tx2 = tx.clone();
            tokio::spawn(async move {
                let st = child.wait().await;
                // Let the last lines arrive before the exit is processed (bounded: a grandchild
                // may hold the pipes open), then let the scanners finish their backlog (at
                // most 64 MiB per stream: seconds).
                let scanners = tokio::time::timeout(Duration::from_secs(2), async { (out.await.ok().flatten(), err.await.ok().flatten()) }).await.unwrap_or((None, None));
                for h in [scanners.0, scanners.1].into_iter().flatten() {
                    let _ = tokio::time::timeout(Duration::from_secs(120), tokio::task::spawn_blocking(move || h.join())).await;
                }
                let (code, signal) = match st {
                    Ok(s) => (s.code(), s.signal()),
                    Err(_) => (None, None),
                };
                let _ = tx2.send(Input::JobExit { code, signal }).await;
            });
        }
        Job::Attach { pid, logs } => {
            info.root_pid = Some(*pid);
            info.command = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| crate::collect::redact::argv(&b.split(|&c| c == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect::<Vec<_>>()))
                .unwrap_or_default();
            if !crate::correlate::alive(*pid) {
                anyhow::bail!("pid {pid} does not exist");
            }
            for l in logs {
                check_log(l)?;
                follow_file(l.clone(), *pid, scanner.clone(), tx.clone());
            }
            // The root's end: from /proc (the kernel exit event, when seen, gives the code).
            let (tx2, pid) = (tx.clone(), *pid);
            tokio::spawn(async move {
                while crate::correlate::alive(pid) {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = tx2.send(Input::JobExit { code: None, signal: None }).await;
            });
        }
    }

    // Signals to nantrace.
    {
        use tokio::signal::unix::{signal, SignalKind};
        let tx2 = tx.clone();
        let mut usr1 = signal(SignalKind::user_defined1())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut hup = signal(SignalKind::hangup())?;
        let child = info.root_pid.filter(|_| matches!(job, Job::Spawn(_)));
        // Run mode: SIGINT, SIGHUP and SIGTERM go on to the job at once (6.1, 6.3, 6.6); the
        // bundle is written when the job has ended (or the post-window is over), and nantrace
        // exits with the job's status. A terminal's Ctrl-C or hangup already reached the job
        // (same foreground process group): those are not sent a second time.
        let forward = move |sig: libc::c_int| {
            if let Some(c) = child {
                if sig == libc::SIGTERM || !job_got_it_from_the_terminal() {
                    // SAFETY: sending a signal to our own child; no memory is involved.
                    unsafe { libc::kill(c as i32, sig) };
                }
            }
        };
        tokio::spawn(async move {
            loop {
                let (kind, why) = tokio::select! {
                    _ = usr1.recv() => (TriggerKind::Usr1, "SIGUSR1 sent to nantrace"),
                    _ = int.recv() => { forward(libc::SIGINT); (TriggerKind::Manual, "SIGINT to nantrace") }
                    _ = term.recv() => { forward(libc::SIGTERM); (TriggerKind::Manual, "SIGTERM to nantrace") }
                    _ = hup.recv() => { forward(libc::SIGHUP); (TriggerKind::Manual, "SIGHUP to nantrace") }
                };
                if tx2.send(Input::Fire(kind, why.into(), monotonic_ns())).await.is_err() {
                    break;
                }
            }
        });
    }
    if let Some(tf) = opts.trigger_file.clone() {
        let existed = tf.exists();
        let tx2 = tx.clone();
        tokio::spawn(async move {
            let mut was = existed;
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let now = tf.exists();
                if now && !was {
                    let _ = tx2.send(Input::Fire(TriggerKind::File, format!("trigger file {} appeared", tf.display()), monotonic_ns())).await;
                }
                was = now;
            }
        });
    }
    crate::collect::spawn_samplers(opts.sample_s, info.root_pid, {
        let tx2 = tx.clone();
        move |batch| tx2.try_send(Input::Samples(batch)).is_ok()
    });
    // The job's context (environment, libraries, cgroup) while it is alive, refreshed; a
    // changed container id (restart, migration) or a rising cgroup OOM counter is an event.
    let job_ctx = std::sync::Arc::new(std::sync::Mutex::new(None::<serde_json::Value>));
    if let Some(root) = info.root_pid {
        let ctx = job_ctx.clone();
        let tx3 = tx.clone();
        tokio::spawn(async move {
            let mut wait = Duration::from_millis(500);
            loop {
                tokio::time::sleep(wait).await;
                wait = Duration::from_secs(5);
                match tokio::task::spawn_blocking(move || crate::collect::job_context(root)).await {
                    Ok(Some(c)) => {
                        let prev = ctx.lock().unwrap().replace(c.clone());
                        let changes = prev.map(|p| crate::collect::scheduler::changes(&p["scheduler"], &c["scheduler"])).unwrap_or_default();
                        if !changes.is_empty() {
                            let batch = changes.into_iter().map(|change| {
                                let mut f = serde_json::Map::new();
                                f.insert("change".into(), json!(change));
                                crate::collect::system::sample_event(monotonic_ns(), crate::source::Source::SchedulerChange, f)
                            }).collect();
                            let _ = tx3.send(Input::Samples(batch)).await;
                        }
                    }
                    _ => break,
                }
            }
        });
    }
    let mut snapshot_task: Option<tokio::task::JoinHandle<serde_json::Value>> = None;
    drop(tx);

    let mut rec = Recorder::new((opts.window_s * 1e9) as u64, opts.mem_cap_mb.saturating_mul(1 << 20));
    let mut clock = ClockMap::sample();
    let mut last_clock = monotonic_ns();
    let mut incident: Vec<Fired> = Vec::new();
    let mut deadline: Option<u64> = None;
    let mut seen_nan = false;
    let mut seen_job_error = false;
    let mut last_job_error = 0u64;
    let mut job_done = false;
    let mut finish = false;
    let mut bundles = Vec::new();
    // When the last dump ended: a signal received while dumping is answered by that dump,
    // not by a second, duplicate bundle (6.5, 6.6).
    let mut last_dump_end = 0u64;
    let mut dumped_any = false;
    // The dump runs on a blocking thread while this loop goes on draining the job's output
    // and the kernel stream (redteam 2.8: the job was blocked 12.9 s by an inline dump).
    let mut dump_task: Option<tokio::task::JoinHandle<DumpDone>> = None;
    let mut dumping_since: Option<u64> = None;
    let mut quiet_exit = false;
    let root = info.root_pid.unwrap_or(0);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let post_ns = (opts.post_s * 1e9) as u64;
    let grace_ns = 500_000_000u64;

    let fire = |f: Fired, incident: &mut Vec<Fired>, deadline: &mut Option<u64>, rec: &mut Recorder| {
        if !enabled.on(f.kind) {
            return;
        }
        crate::say!("nantrace: trigger {}: {}", f.kind.name(), crate::term::clean(&f.reason.chars().take(160).collect::<String>()));
        rec.push(Event { mono_ns: f.mono_ns, pid: 0, tid: 0, comm: crate::event::Comm::NONE, job: false, detail: Detail::Trigger { kind: f.kind.name(), reason: Box::new(f.reason.clone()) } });
        if incident.is_empty() {
            *deadline = Some(monotonic_ns() + post_ns);
        }
        incident.push(f);
    };

    loop {
        tokio::select! {
            input = rx.recv() => {
                let Some(input) = input else { break };
                match input {
                    Input::Kernel(batch) | Input::Samples(batch) => {
                        for e in batch {
                            *counts.entry(e.source()).or_default() += 1;
                            if let Some(f) = trigger::from_event(&e, seen_nan) {
                                fire(f, &mut incident, &mut deadline, &mut rec);
                            }
                            if matches!(job, Job::Attach { .. }) {
                                if let Detail::Exit { code, signal } = e.detail {
                                    if e.pid == root {
                                        info.exit_code = (code >= 0).then_some(code);
                                        info.exit_signal = (signal > 0).then_some(signal);
                                    }
                                }
                            }
                            rec.push(e);
                        }
                    }
                    Input::Log(e) => {
                        *counts.entry("log").or_default() += 1;
                        if let Some(f) = trigger::from_event_seen(&e, seen_nan, seen_job_error) {
                            seen_nan |= f.kind == TriggerKind::Nan;
                            if f.kind == TriggerKind::JobError {
                                seen_job_error = true;
                                last_job_error = monotonic_ns();
                            }
                            fire(f, &mut incident, &mut deadline, &mut rec);
                        }
                        rec.push(e);
                    }
                    Input::JobExit { code, signal } => {
                        job_done = true;
                        if matches!(job, Job::Spawn(_)) {
                            info.exit_code = code;
                            info.exit_signal = signal;
                        }
                        let now = monotonic_ns();
                        let (code, signal) = (info.exit_code, info.exit_signal);
                        if quiet_exit && incident.is_empty() {
                            crate::say!("nantrace: the job ended ({}) after the signal that the last bundle answered", crate::export::exit_text(code, signal));
                        } else if let Some(s) = signal {
                            fire(Fired { kind: TriggerKind::Signal, mono_ns: now, reason: format!("job {root} ended by {}", crate::event::signal_name(s)) }, &mut incident, &mut deadline, &mut rec);
                        } else if let Some(c) = code.filter(|c| *c != 0) {
                            fire(Fired { kind: TriggerKind::Exit, mono_ns: now, reason: format!("job {root} exited with code {c}") }, &mut incident, &mut deadline, &mut rec);
                        }
                        if incident.is_empty() {
                            finish = true;
                        } else {
                            deadline = Some(deadline.unwrap_or(now).min(now + grace_ns));
                        }
                    }
                    Input::Fire(kind, reason, at) => {
                        let now = monotonic_ns();
                        let during_dump = at <= last_dump_end || dumping_since.is_some_and(|s| at >= s);
                        if !during_dump {
                            fire(Fired { kind, mono_ns: now, reason }, &mut incident, &mut deadline, &mut rec);
                        }
                        if kind == TriggerKind::Manual {
                            if matches!(job, Job::Spawn(_)) && !job_done {
                                // The signal went on to the job: its end ends the session. Its
                                // death by a signal that the last dump already answered is
                                // not a new incident.
                                quiet_exit |= during_dump;
                            } else {
                                finish = true;
                                if !incident.is_empty() {
                                    deadline = Some(now + 300_000_000);
                                }
                            }
                        }
                    }
                }
            }
            _ = tick.tick() => {}
        }
        if !incident.is_empty() && snapshot_task.is_none() {
            // The state at the trigger (not at the dump, when the job may be gone).
            let (root, cached) = (info.root_pid, job_ctx.lock().unwrap().clone());
            snapshot_task = Some(tokio::task::spawn_blocking(move || crate::collect::snapshot_with(root, cached)));
        }
        let now = monotonic_ns();
        if now - last_clock > 10_000_000_000 {
            clock = ClockMap::sample();
            last_clock = now;
        }
        rec.expire(now);
        // Once its incident is written, a later failure line can open the next one (at most
        // one a minute: a job that prints an error per step does not write a bundle per step).
        if seen_job_error && incident.is_empty() && dump_task.is_none() && now.saturating_sub(last_job_error) > 60_000_000_000 {
            seen_job_error = false;
        }
        if let Some(t) = dump_task.as_ref().filter(|t| t.is_finished()) {
            let _ = t;
            let done = dump_task.take().expect("checked").await.unwrap_or_else(|e| DumpDone { lines: vec![format!("nantrace: ERROR: the dump failed: {e}")], dir: None, lanes: None });
            if let Some(l) = done.lanes {
                rec.restore(l);
            }
            for l in &done.lines {
                crate::say!("{l}");
            }
            bundles.extend(done.dir);
            dumped_any = true;
            last_dump_end = monotonic_ns();
            dumping_since = None;
            if job_done && incident.is_empty() {
                finish = true;
            }
        }
        if deadline.is_some_and(|d| now >= d) && !incident.is_empty() && dump_task.is_none() {
            // From here a signal is answered by this dump, not by a second bundle (6.5, 6.6).
            dumping_since = Some(monotonic_ns());
            if let Some(p) = probes.as_ref() {
                acct.kernel_drops = p.drops().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            }
            acct.events = counts.iter().map(|(k, v)| ((*k).to_string(), *v)).collect();
            acct.decode_errors = reader_stats.as_ref().map_or(0, |s| s.decode_errors.load(Ordering::Relaxed));
            let mut accounting = serde_json::to_value(&acct)?;
            accounting["recorder"] = serde_json::to_value(rec.stats())?;
            accounting["probes_error"] = json!(probe_error);
            if let Some(p) = probes.as_ref() {
                accounting["io_latency_histograms_log2_us"] = json!(p.io_histograms().into_iter().map(|(d, h)| (format!("{}:{}", d >> 20, d & 0xfffff), h)).collect::<BTreeMap<_, _>>());
            }
            accounting["injected"] = json!(opts.injected);
            accounting["log_bytes_not_scanned"] = json!(not_scanned.load(Ordering::Relaxed));
            // The window moves to the dump (no copy: the dump's memory is the recorder's).
            let d = OwnedDump {
                out: opts.out.clone(),
                host: host.clone(),
                clock,
                triggers: std::mem::take(&mut incident),
                job: info.clone(),
                accounting,
                lanes: rec.take_lanes(),
                window_pre_s: opts.window_s,
                post_s: opts.post_s,
                snapshot: snapshot_task.take(),
            };
            dump_task = Some(tokio::task::spawn_blocking(move || d.write()));
            deadline = None;
        }
        if finish && incident.is_empty() && dump_task.is_none() {
            break;
        }
    }
    // A dump still running when the inputs ended is waited for, not abandoned.
    if let Some(t) = dump_task.take() {
        if let Ok(done) = t.await {
            for l in &done.lines {
                crate::say!("{l}");
            }
            bundles.extend(done.dir);
            dumped_any = true;
        }
    }
    let unscanned = not_scanned.load(Ordering::Relaxed);
    if unscanned > 0 {
        crate::say!("nantrace: WARNING: {unscanned} bytes of the job's output were passed through but not scanned (a flood faster than the scanner): a NaN or an error line in them was not seen");
    }
    let exit_code = match (info.exit_code, info.exit_signal) {
        (_, Some(s)) => 128 + s,
        (Some(c), None) => c,
        (None, None) => 0,
    };
    Ok(Outcome { exit_code, bundles, dumped: dumped_any })
}

/// The kernel probes, or why there are none (log-only evidence then, and the bundle says so).
fn load_probes(job: &Job, attach_pid: &[u32], opts: &SessionOpts) -> (Option<crate::probes::Probes>, Option<String>) {
    if opts.no_probes {
        return (None, Some("disabled with --no-probes".to_string()));
    }
    match start_probes(attach_pid, opts.slow_io_ms) {
        Ok(mut p) => {
            // In run mode the probes follow the job from nantrace's own fork of it: see `run`.
            if matches!(job, Job::Spawn(_)) {
                let _ = p.add_job_pid(std::process::id());
            }
            (Some(p), None)
        }
        Err(e) => {
            crate::say!("nantrace: WARNING: kernel probes unavailable, recording the job's output only: {e:#}");
            (None, Some(format!("{e:#}")))
        }
    }
}
