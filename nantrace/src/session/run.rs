//! The session's inputs: `run` and `attach` (the job, its output, signals to nantrace, the
//! trigger file, samplers) feeding one [`Session`]; the job's context and liveness watchers the
//! agent uses too.
use std::os::unix::process::ExitStatusExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tokio::sync::mpsc;

use super::follow::{follow_file, LogFormat};
use super::logs::pump;
use super::pipes::{check_log, job_got_it_from_the_terminal, one_pipe_for_both, same_destination};
use super::{Input, Job, Kernel, Mode, Outcome, Session, SessionOpts};
use crate::bundle::JobInfo;
use crate::clock::monotonic_ns;
use crate::event::comm_from;
use crate::nanscan::Scanner;
use crate::trigger::TriggerKind;

/// Refresh the job's context while it is alive (every 5 s); a changed container id (restart,
/// migration) or a rising cgroup OOM counter is an event.
pub fn spawn_context_refresh(
    root: u32,
    ctx: Arc<Mutex<Option<serde_json::Value>>>,
    tx: mpsc::Sender<Input>,
) {
    tokio::spawn(async move {
        let mut wait = Duration::from_millis(500);
        loop {
            tokio::time::sleep(wait).await;
            wait = Duration::from_secs(5);
            if tx.is_closed() {
                break;
            }
            match tokio::task::spawn_blocking(move || crate::collect::job_context(root)).await {
                Ok(Some(c)) => {
                    let prev = ctx
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .replace(c.clone());
                    let changes = prev
                        .map(|p| {
                            crate::collect::scheduler::changes(&p["scheduler"], &c["scheduler"])
                        })
                        .unwrap_or_default();
                    if !changes.is_empty() {
                        let batch = changes
                            .into_iter()
                            .map(|change| {
                                let mut f = serde_json::Map::new();
                                f.insert("change".into(), json!(change));
                                crate::collect::system::sample_event(
                                    monotonic_ns(),
                                    crate::source::Source::SchedulerChange,
                                    f,
                                )
                            })
                            .collect();
                        let _ = tx.send(Input::Samples(batch)).await;
                    }
                }
                _ => break,
            }
        }
    });
}

/// Run a session to its end; returns the job's exit code (run mode) and the bundles written.
pub async fn run(job: Job, opts: SessionOpts) -> anyhow::Result<Outcome> {
    // Whether the trigger file was there before anything else: one made after this moment
    // (by the job, as soon as it starts) is a trigger, however long the probes take to load.
    let trigger_file_existed = opts.trigger_file.as_ref().map(|p| p.exists());
    let mut scanner = Scanner::new(&opts.nan_patterns).context("--nan-pattern")?;
    scanner.grad_rule = opts.grad_rule;
    // A bundle that cannot be written must be said before hours of training, not after.
    crate::safefs::check_out_dir(&opts.out)?;
    // An earlier run's dump cut short (killed, out of memory) is kept, said, never hidden (D-8).
    let (kept, problems) = crate::bundle::recover::recover(&opts.out);
    crate::bundle::recover::say(&kept, &problems);
    let (tx, rx) = mpsc::channel::<Input>(4096);

    let kernel = Arc::new(load_kernel(&job, &opts));
    crate::say!(
        "nantrace: recording ({} kernel probes attached; window {} s, cap {} MiB, post-window {} s)",
        kernel.attached(),
        opts.window_s,
        opts.mem_cap_mb,
        opts.post_s
    );
    forward_kernel(&kernel, &tx)?;

    let mode = if matches!(job, Job::Spawn(_)) {
        Mode::Spawn
    } else {
        Mode::Follow
    };
    let mut session = Session::new(opts.clone(), JobInfo::default(), mode);
    // The job.
    match &job {
        Job::Spawn(argv) => spawn_job(argv, &opts, &kernel, &mut session, &scanner, &tx)?,
        Job::Attach { pid, logs } => attach_job(*pid, logs, &mut session, &scanner, &tx)?,
    }

    let child = session
        .info
        .root_pid
        .filter(|_| matches!(job, Job::Spawn(_)));
    arm_signals(child, &opts, &tx)?;
    if let Some(tf) = opts.trigger_file.clone() {
        watch_trigger_file(tf, trigger_file_existed.unwrap_or(false), tx.clone());
    }
    crate::collect::spawn_samplers(opts.sample_s, session.info.root_pid, {
        let tx2 = tx.clone();
        move |batch| tx2.try_send(Input::Samples(batch)).is_ok()
    });
    if let Some(root) = session.info.root_pid {
        spawn_context_refresh(root, session.job_ctx.clone(), tx.clone());
    }
    drop(tx);
    Ok(session.drive(rx, kernel, None).await)
}

/// Kernel probes: degrade to log-only evidence when they cannot load, and say so.
fn load_kernel(job: &Job, opts: &SessionOpts) -> Kernel {
    match job {
        _ if opts.no_probes => Kernel::none("disabled with --no-probes"),
        Job::Attach { pid, .. } => Kernel::load(&[*pid], opts.slow_io_ms, false),
        // In run mode the probes follow the job from nantrace's own fork of it (`spawn_job`).
        Job::Spawn(_) => Kernel::load(&[], opts.slow_io_ms, true),
    }
}

/// The probes' batches into the session's input.
fn forward_kernel(kernel: &Kernel, tx: &mpsc::Sender<Input>) -> anyhow::Result<()> {
    let (ktx, mut krx) = mpsc::channel(256);
    kernel.start_stream(ktx)?;
    let tx2 = tx.clone();
    tokio::spawn(async move {
        while let Some(b) = krx.recv().await {
            if tx2.send(Input::Kernel(b)).await.is_err() {
                break;
            }
        }
    });
    Ok(())
}

/// Run mode: start the job, its output through nantrace (scanned on the way), and its end
/// reported once its last lines are in.
fn spawn_job(
    argv: &[String],
    opts: &SessionOpts,
    kernel: &Kernel,
    session: &mut Session,
    scanner: &Scanner,
    tx: &mpsc::Sender<Input>,
) -> anyhow::Result<()> {
    anyhow::ensure!(!argv.is_empty(), "no command given after --");
    let (mut cmd, merged) = job_command(argv, opts);
    // nantrace's own pid is in the job map while it forks the child, so the kernel map
    // holds the child from its first instruction (no race with early worker forks); only
    // then: a thread nantrace starts while its pid is marked is marked too (by tid), and the
    // exit and signal programs take a marked tid as the job's.
    kernel.add_pid(std::process::id());
    let spawned = cmd.spawn();
    if let Some(pid) = spawned.as_ref().ok().and_then(tokio::process::Child::id) {
        kernel.add_pid(pid);
    }
    kernel.remove_pid(std::process::id());
    let mut child = spawned.with_context(|| format!("starting {:?}", argv[0]))?;
    let pid = child.id().unwrap_or(0);
    session.info.root_pid = Some(pid);
    session.info.command = crate::collect::redact::argv(argv);
    let comm = comm_from(
        std::path::Path::new(&argv[0])
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or("job"),
    );
    let pumps = Pumps {
        pid,
        comm,
        scanner,
        tx,
        not_scanned: &session.not_scanned,
    };
    let (out, err) = match merged {
        Some(rx) => (
            pumps.spawn(rx, tokio::io::stdout(), 3),
            tokio::spawn(async { None }),
        ),
        None => (
            pumps.spawn(child.stdout.take().unwrap(), tokio::io::stdout(), 1),
            pumps.spawn(child.stderr.take().unwrap(), tokio::io::stderr(), 2),
        ),
    };
    spawn_exit_wait(child, out, err, tx.clone());
    Ok(())
}

/// The job's command: its environment, its identity, and its output to pipes; with the one
/// pipe for both streams when they share it.
fn job_command(
    argv: &[String],
    opts: &SessionOpts,
) -> (
    tokio::process::Command,
    Option<tokio::net::unix::pipe::Receiver>,
) {
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
    let merged = if same_destination() {
        one_pipe_for_both(&mut cmd)
    } else {
        None
    };
    if merged.is_none() {
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    }
    (cmd, merged)
}

/// A pump's task: the scanner's thread, when it has one, to wait for at the end.
type PumpTask = tokio::task::JoinHandle<Option<std::thread::JoinHandle<()>>>;

/// What each of the job's output streams is pumped with.
struct Pumps<'a> {
    pid: u32,
    comm: crate::event::Comm,
    scanner: &'a Scanner,
    tx: &'a mpsc::Sender<Input>,
    not_scanned: &'a Arc<AtomicU64>,
}

impl Pumps<'_> {
    /// Pass `from` through to `to` as stream `stream` (1 stdout, 2 stderr, 3 both), scanned.
    fn spawn<R, W>(&self, from: R, to: W, stream: u8) -> PumpTask
    where
        R: tokio::io::AsyncRead + Unpin + Send + 'static,
        W: tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        tokio::spawn(pump(
            from,
            to,
            stream,
            self.pid,
            self.comm,
            self.scanner.clone(),
            self.tx.clone(),
            self.not_scanned.clone(),
        ))
    }
}

/// The job's end, reported once its output is in: its status from `wait`.
fn spawn_exit_wait(
    mut child: tokio::process::Child,
    out: PumpTask,
    err: PumpTask,
    tx: mpsc::Sender<Input>,
) {
    tokio::spawn(async move {
        let st = child.wait().await;
        // Let the last lines arrive before the exit is processed (bounded: a grandchild
        // may hold the pipes open), then let the scanners finish their backlog (at
        // most 64 MiB per stream: seconds).
        let scanners = tokio::time::timeout(Duration::from_secs(2), async {
            (out.await.ok().flatten(), err.await.ok().flatten())
        })
        .await
        .unwrap_or((None, None));
        for h in [scanners.0, scanners.1].into_iter().flatten() {
            let _ = tokio::time::timeout(
                Duration::from_secs(120),
                tokio::task::spawn_blocking(move || h.join()),
            )
            .await;
        }
        let (code, signal, core_dumped) = match st {
            Ok(s) => (s.code(), s.signal(), s.core_dumped()),
            Err(_) => (None, None, false),
        };
        let _ = tx
            .send(Input::JobExit {
                code,
                signal,
                core_dumped,
            })
            .await;
    });
}

/// Attach mode: a running process, its log files followed, its end watched.
fn attach_job(
    pid: u32,
    logs: &[std::path::PathBuf],
    session: &mut Session,
    scanner: &Scanner,
    tx: &mpsc::Sender<Input>,
) -> anyhow::Result<()> {
    session.info.root_pid = Some(pid);
    session.info.command = crate::collect::cmdline(pid);
    if !crate::correlate::alive(pid) {
        anyhow::bail!("pid {pid} does not exist");
    }
    for l in logs {
        check_log(l)?;
        follow_file(
            l.clone(),
            pid,
            LogFormat::Plain,
            None,
            scanner.clone(),
            tx.clone(),
            session.logs_behind.clone(),
        );
    }
    watch_root_alive(pid, tx.clone(), session.logs_behind.clone());
    Ok(())
}

/// Signals to nantrace: SIGUSR1 a dump; SIGINT, SIGTERM and SIGHUP end the session, and in
/// run mode go on to the job (`child`).
fn arm_signals(
    child: Option<u32>,
    opts: &SessionOpts,
    tx: &mpsc::Sender<Input>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let tx2 = tx.clone();
    let mut usr1 = signal(SignalKind::user_defined1())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
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
            if tx2
                .send(Input::Fire(kind, why.into(), monotonic_ns()))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    // Said once the listeners exist (tokio installs a signal's handler a moment before
    // its listener subscribes: a SIGUSR1 sent in between, as soon as the handler shows in
    // /proc/PID/status, was lost in a loaded TCG guest). Operators learn how to ask for a
    // dump; the tests wait for this line before they signal.
    crate::say!(
        "nantrace: signals armed: SIGUSR1 to pid {} {}",
        std::process::id(),
        if opts.no_trigger.contains(&TriggerKind::Usr1) {
            "is turned off (--no-trigger usr1)"
        } else {
            "dumps a bundle now"
        }
    );
    Ok(())
}

/// The trigger file: its appearance (not its presence) is a trigger.
fn watch_trigger_file(tf: std::path::PathBuf, existed: bool, tx: mpsc::Sender<Input>) {
    tokio::spawn(async move {
        let mut was = existed;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = tf.exists();
            if now && !was {
                let _ = tx
                    .send(Input::Fire(
                        TriggerKind::File,
                        format!("trigger file {} appeared", tf.display()),
                        monotonic_ns(),
                    ))
                    .await;
            }
            was = now;
        }
    });
}

/// The end of a process nantrace did not start: from /proc (the kernel's exit event, when
/// seen, gives the code). The end is reported once the log followers have read their files to
/// the end (at most 120 s later): the lines a job printed just before dying are its last words.
pub fn watch_root_alive(pid: u32, tx: mpsc::Sender<Input>, logs_behind: Arc<AtomicU64>) {
    tokio::spawn(async move {
        while crate::correlate::alive(pid) {
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t0 = tokio::time::Instant::now();
        while logs_behind.load(Ordering::SeqCst) > 0 && t0.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = tx
            .send(Input::JobExit {
                code: None,
                signal: None,
                core_dumped: false,
            })
            .await;
    });
}
