//! nantrace CLI: wiring only; the work lives in the library.
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use nantrace::session::{Job, SessionOpts};
use nantrace::trigger::TriggerKind;
use nantrace::{say, sayout};

#[derive(Parser)]
#[command(
    name = "nantrace",
    version,
    about = "Flight recorder for GPU training nodes: was it the machine?"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Options of the incident recorder (run, attach, demo).
#[derive(Args, Clone)]
struct RecArgs {
    /// Directory under which bundles are written
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// Flight-recorder time window, seconds (1 to 604800)
    #[arg(long, default_value_t = 600.0, value_parser = secs(1.0, 604_800.0))]
    window: f64,
    /// Flight-recorder memory cap, MiB (1 to 1048576)
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    mem_cap_mb: u64,
    /// Seconds to keep recording after a trigger, 0 to 86400 (ends early when the job exits)
    #[arg(long, default_value_t = 15.0, value_parser = secs(0.0, 86_400.0))]
    post: f64,
    /// Turn a trigger off: nan, exit, signal, oom, xid, job-error, usr1, file, manual, stall (repeatable)
    #[arg(long = "no-trigger", value_parser = parse_trigger)]
    no_trigger: Vec<TriggerKind>,
    /// Dump when this file appears (e.g. on a shared filesystem, for all nodes at once)
    #[arg(long)]
    trigger_file: Option<PathBuf>,
    /// Extra regex that counts as a non-finite loss (repeatable; must not match an empty line)
    #[arg(long = "nan-pattern", value_parser = parse_nan_pattern)]
    nan_patterns: Vec<String>,
    /// A non-finite gradient norm with a finite loss is: auto = a precursor only when the log
    /// shows the loss scaler skipped that step (fp16), else the incident (bf16); incident; precursor
    #[arg(long, value_enum, default_value_t = nantrace::nanscan::GradRule::Auto)]
    nonfinite_grad_norm: nantrace::nanscan::GradRule,
    /// Block requests at least this slow (ms) are events (0 to 600000)
    #[arg(long, default_value_t = 50.0, value_parser = secs(0.0, 600_000.0))]
    slow_io_ms: f64,
    /// Collector sampling interval, seconds (0.1 to 3600; GPU and system); never below 1 s for NVML
    #[arg(long, default_value_t = 1.0, value_parser = secs(0.1, 3600.0))]
    sample: f64,
    /// Do not load the eBPF probes (log and collectors only)
    #[arg(long)]
    no_probes: bool,
    /// Dump when the job stops making progress: no step or loss line for this many seconds
    /// after one was seen (set it below the job's collective timeout; 0 = off, else 1 to 86400)
    #[arg(long, default_value_t = 0.0, value_parser = hang_secs)]
    hang_after: f64,
}

/// A finite number in `lo..=hi` (no NaN, no infinity, no negative durations: redteam 1.25–1.35).
fn secs(lo: f64, hi: f64) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let v: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number"))?;
        if !v.is_finite() || v < lo || v > hi {
            return Err(format!(
                "{s} is out of range: give a number from {lo} to {hi}"
            ));
        }
        Ok(v)
    }
}

/// 0 (off) or 1 to 86400 seconds: a stall shorter than a second is every step's gap.
fn hang_secs(s: &str) -> Result<f64, String> {
    let v = secs(0.0, 86_400.0)(s)?;
    if v > 0.0 && v < 1.0 {
        return Err(format!("{s}: give 0 (off) or at least 1 second"));
    }
    Ok(v)
}

fn parse_nan_pattern(s: &str) -> Result<String, String> {
    let re = regex::Regex::new(s).map_err(|e| e.to_string())?;
    if re.is_match("") {
        return Err(format!(
            "{s:?} matches an empty line, so every line would be a NaN (1.37)"
        ));
    }
    Ok(s.to_string())
}

fn parse_trigger(s: &str) -> Result<TriggerKind, String> {
    TriggerKind::parse(s).ok_or_else(|| format!("unknown trigger {s:?}"))
}

impl RecArgs {
    fn opts(&self) -> SessionOpts {
        SessionOpts {
            out: self.out.clone(),
            window_s: self.window,
            mem_cap_mb: usize::try_from(self.mem_cap_mb).unwrap_or(usize::MAX),
            post_s: self.post,
            no_trigger: self.no_trigger.clone(),
            trigger_file: self.trigger_file.clone(),
            nan_patterns: self.nan_patterns.clone(),
            grad_rule: self.nonfinite_grad_norm,
            slow_io_ms: self.slow_io_ms,
            sample_s: self.sample,
            no_probes: self.no_probes,
            injected: None,
            run_as: None,
            unbuffered: true,
            hang_after_s: self.hang_after,
            trust_user_written_kmsg: false,
        }
    }
}

/// Who the job runs as (run only): see docs/security.md, "Privilege model".
#[derive(Args, Clone)]
struct UserArgs {
    /// Run the job as this user (name or uid), with its groups and HOME. Default: the user who
    /// ran sudo (SUDO_UID), else nantrace's own user
    #[arg(long, conflicts_with = "as_root")]
    user: Option<String>,
    /// Keep root for the job even when started through sudo (prints a warning)
    #[arg(long)]
    as_root: bool,
    /// Do not set PYTHONUNBUFFERED=1 for the job
    #[arg(long)]
    no_unbuffered: bool,
    /// After the job has exited, if a NaN bundle has no hardware evidence, check the GPUs for
    /// silent data corruption (`nantrace gpucheck`, ~10 s per GPU) and add it to the bundle
    #[arg(long)]
    gpucheck: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a job under the recorder: `nantrace run [OPTIONS] -- CMD ARGS...`
    Run {
        #[command(flatten)]
        rec: RecArgs,
        #[command(flatten)]
        who: UserArgs,
        #[arg(trailing_var_arg = true, required = true)]
        cmd: Vec<String>,
    },
    /// Follow an already running job (all its descendants) and its log files
    Attach {
        #[arg(long)]
        pid: u32,
        /// Log file(s) to follow like `tail -F`
        #[arg(long = "log")]
        logs: Vec<PathBuf>,
        #[command(flatten)]
        rec: RecArgs,
    },
    /// Run the built-in diverging training job under the recorder
    Demo {
        /// numeric (default); xid (an NVRM Xid line written to /dev/kmsg), oom (a worker
        /// OOM-killed in a 64 MiB cgroup), net (packets dropped in a netns), io (writes through a
        /// loop device throttled at its backing disk), ecc: injected, labelled; multinode: the
        /// job report of a recorded 3-node incident (no cluster needed); hang: the job report of
        /// a recorded real PyTorch job whose rank 1 stopped (no cluster, no torch needed)
        #[arg(long, default_value = "numeric")]
        scenario: String,
        #[command(flatten)]
        rec: RecArgs,
    },
    /// Print kernel events live (JSON Lines with --json)
    Watch {
        /// Root pid(s) of the job; descendants are followed. Without it: the whole machine.
        #[arg(long = "pid")]
        pids: Vec<u32>,
        /// Stop after this many seconds (0 to 31536000)
        #[arg(long, value_parser = secs(0.0, 31_536_000.0))]
        duration: Option<f64>,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
        /// Block requests at least this slow (ms) are events; errors always are
        #[arg(long, default_value_t = 50.0, value_parser = secs(0.0, 600_000.0))]
        slow_io_ms: f64,
    },
    /// Answer "was it the machine?" for a bundle: ranked suspects, what was checked, the facts.
    /// Given a directory of node bundles (a job's incident directory, or bundles gathered by
    /// hand), the job report: which node, GPU or link, each node's verdict, the peers compared
    Report {
        bundle: PathBuf,
        /// Also rewrite report.md/.txt, trace.json and report.html in the bundle (a job
        /// directory: job-report.md, job-report.json, job-report.html and trace.json in it)
        #[arg(long)]
        write: bool,
        /// The job report as JSON on stdout
        #[arg(long)]
        json: bool,
        /// A job directory: first write summary.json into each node bundle that has none
        /// of this analysis (bundles of agents before summaries), then report
        #[arg(long)]
        summaries: bool,
    },
    /// Merge node bundles of one job into one timeline, trace and report, on one clock
    Merge {
        #[arg(required = true)]
        bundles: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
    },
    /// GPU, system, network, software and scheduler evidence now, without eBPF (snapshot.json)
    Snapshot {
        /// The job's root pid (its environment, libraries, cgroup, processes)
        #[arg(long)]
        pid: Option<u32>,
        /// Write here (mode 0600) instead of stdout
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Silent-data-corruption check: the same deterministic FP32/FP16/BF16 computation on every
    /// GPU, repeated and compared bit for bit, plus a memory test (needs the NVIDIA driver)
    Gpucheck {
        /// CUDA ordinals to test, comma-separated (default: all)
        #[arg(long, value_delimiter = ',')]
        gpus: Option<Vec<u32>>,
        /// Repetitions per precision
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(2..=1000))]
        reps: u32,
        /// Map iterations per thread per repetition (length of each run)
        #[arg(long, default_value_t = 2_000_000, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
        iters: u32,
        /// Share of free GPU memory the memory test covers (0.0-0.9)
        #[arg(long, default_value_t = 0.25)]
        mem_fraction: f64,
        /// Write gpucheck.json here (mode 0600) instead of printing it
        #[arg(long)]
        out: Option<PathBuf>,
        /// Add gpucheck.json to this incident bundle and render its report again
        #[arg(long, conflicts_with = "out")]
        bundle: Option<PathBuf>,
        /// TEST ONLY: flip one bit in this GPU's FP32 result of repetition 1 (shows a
        /// disagreement is detected and named)
        #[arg(long, hide = true)]
        corrupt_test: Option<u32>,
    },
    /// The node agent: finds training jobs by itself (GPU users, Slurm jobs, pods, command
    /// patterns), records each one, writes bundles to a spool; control socket and /metrics
    Agent(AgentCli),
    /// Talk to a running agent: status, jobs, incidents, history [--gpu ID] [--since 30d],
    /// dump [--job ID], report --last, slurm-prolog, slurm-epilog
    Ctl {
        cmd: String,
        /// dump: the job (key from `ctl jobs`, Slurm job id, or root pid); default: every job
        #[arg(long)]
        job: Option<String>,
        /// history: only incidents that implicated this GPU (PCI address or UUID)
        #[arg(long)]
        gpu: Option<String>,
        /// history: how far back (30d, 12h, 90m, seconds); default 30d
        #[arg(long)]
        since: Option<String>,
        /// report: the newest incident (the only choice for now)
        #[arg(long)]
        last: bool,
        #[arg(long, default_value = "/run/nantrace/agent.sock")]
        socket: PathBuf,
        /// Print the agent's JSON answer as it is
        #[arg(long)]
        json: bool,
    },
    /// What this machine supports: privileges, tracefs, BTF, each probe, NVML
    Doctor {
        #[arg(long)]
        json: bool,
    },
    #[command(hide = true, name = "demo-train")]
    DemoTrain {
        #[arg(long, default_value = "numeric")]
        scenario: String,
        #[arg(long, default_value_t = 40)]
        step_ms: u64,
    },
    #[command(hide = true, name = "demo-worker")]
    DemoWorker,
    /// Benchmark helpers for `cargo xtask bench` (workload, memory, drain, dump, bpf-stats)
    #[command(hide = true, name = "bench-internal")]
    BenchInternal(Bench),
    #[command(hide = true, name = "demo-hog")]
    DemoHog { procs: String },
    #[command(hide = true, name = "demo-io-writer")]
    DemoIoWriter { dev: String, procs: String },
}

/// `nantrace agent`'s options (the rest is in agent.toml).
#[derive(clap::Args)]
struct AgentCli {
    /// Config file (TOML; every key optional: docs/agent.md)
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where bundles go (default /var/lib/nantrace/incidents)
    #[arg(long)]
    spool: Option<PathBuf>,
    /// Control socket (default /run/nantrace/agent.sock)
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Prometheus address (default 127.0.0.1:9464; "" = off)
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Also watch processes whose command line matches this regex (repeatable)
    #[arg(long = "match")]
    match_commands: Vec<String>,
    /// Device path prefix that makes a process a GPU job (repeatable; default /dev/nvidia)
    #[arg(long = "gpu-device")]
    gpu_devices: Vec<String>,
    /// Slurm jobs to watch: gpu (default) or all
    #[arg(long)]
    slurm_jobs: Option<String>,
    /// Seconds recorded after a trigger
    #[arg(long, value_parser = secs(0.0, 3600.0))]
    post: Option<f64>,
    /// No eBPF (log and exit evidence only)
    #[arg(long)]
    no_probes: bool,
    /// TESTS ONLY: discover jobs in this /proc-shaped directory
    #[arg(long, hide = true)]
    proc_root: Option<PathBuf>,
    /// TESTS ONLY: the node's PCI devices (metric labels) from this directory, not /sys/bus/pci/devices
    #[arg(long, hide = true)]
    pci_devices: Option<PathBuf>,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn session(job: Job, opts: SessionOpts) -> anyhow::Result<i32> {
    Ok(session_outcome(job, opts)?.exit_code)
}

fn session_outcome(job: Job, opts: SessionOpts) -> anyhow::Result<nantrace::session::Outcome> {
    let out = runtime()?.block_on(nantrace::session::run(job, opts))?;
    if !out.dumped {
        say!("nantrace: no incident, no bundle written");
    }
    Ok(out)
}

/// `merge --out`: a new directory (created 0700), or an existing one that is ours alone;
/// never an input bundle or a directory inside one (5.24); never chmodded (4.14).
fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Run { rec, who, cmd } => run(&rec, &who, cmd)?,
        Cmd::Agent(a) => {
            runtime()?.block_on(nantrace::agent::run(nantrace::agent::Args {
                config: a.config,
                spool_dir: a.spool,
                socket: a.socket,
                metrics_addr: a.metrics_addr,
                match_commands: a.match_commands,
                gpu_devices: a.gpu_devices,
                slurm_jobs: a.slurm_jobs,
                post_s: a.post,
                no_probes: a.no_probes,
                proc_root: a.proc_root,
                pci_devices: a.pci_devices,
            }))?;
            0
        }
        Cmd::Ctl {
            cmd,
            job,
            gpu,
            since,
            last: _,
            socket,
            json,
        } => nantrace::cmd::machine::ctl(
            &cmd,
            [("job", job), ("gpu", gpu), ("since", since)],
            &socket,
            json,
        )?,
        Cmd::Attach { pid, logs, rec } => session(Job::Attach { pid, logs }, rec.opts())?,
        Cmd::Demo { scenario, rec }
            if nantrace::demo::multinode::recording(&scenario).is_some() =>
        {
            if let Some(r) = nantrace::demo::multinode::recording(&scenario) {
                r.cli(&rec.opts().out)?;
            }
            0
        }
        Cmd::Demo { scenario, rec } => demo(scenario, &rec)?,
        Cmd::Watch {
            pids,
            duration,
            json,
            slow_io_ms,
        } => {
            runtime()?.block_on(nantrace::watch::run(nantrace::watch::WatchArgs {
                pids,
                duration,
                json,
                slow_io_ms,
            }))?;
            0
        }
        Cmd::Report {
            bundle,
            write,
            json,
            summaries,
        } if json || summaries || nantrace::jobreport::is_job_dir(&bundle) => {
            if summaries {
                nantrace::cmd::report::write_summaries(&bundle)?;
            }
            nantrace::cmd::report::job_dir(&bundle, json, write)?;
            0
        }
        Cmd::Report { bundle, write, .. } => {
            nantrace::cmd::report::bundle(&bundle, write)?;
            0
        }
        Cmd::Merge { bundles, out } => {
            nantrace::cmd::merge::run(&bundles, &out)?;
            0
        }
        Cmd::Snapshot { pid, out } => nantrace::cmd::machine::snapshot(pid, out.as_deref())?,
        Cmd::Gpucheck {
            gpus,
            reps,
            iters,
            mem_fraction,
            out,
            bundle,
            corrupt_test,
        } => nantrace::cmd::machine::gpucheck(
            &nantrace::gpucheck::Opts {
                gpus,
                reps,
                iters,
                mem_fraction,
                corrupt: corrupt_test,
            },
            out.as_deref(),
            bundle.as_deref(),
        )?,
        Cmd::Doctor { json } => nantrace::cmd::machine::doctor(json)?,
        Cmd::DemoTrain { scenario, step_ms } => nantrace::demo::train(&scenario, step_ms),
        Cmd::DemoWorker => nantrace::demo::worker(),
        Cmd::BenchInternal(b) => {
            sayout!("{}", bench_internal(&b)?);
            0
        }
        Cmd::DemoHog { procs } => nantrace::demo::hog(&procs),
        Cmd::DemoIoWriter { dev, procs } => nantrace::demo::io_writer(&dev, &procs),
    };
    std::process::exit(code);
}

/// `nantrace run`: the job started under the recorder, as the user it should run as.
fn run(rec: &RecArgs, who: &UserArgs, cmd: Vec<String>) -> anyhow::Result<i32> {
    let choice = match (&who.user, who.as_root) {
        (Some(u), _) => nantrace::privdrop::Choice::User(u.clone()),
        (None, true) => nantrace::privdrop::Choice::AsRoot,
        (None, false) => nantrace::privdrop::Choice::Auto,
    };
    let mut opts = rec.opts();
    opts.run_as = nantrace::privdrop::resolve(&choice, |k| std::env::var(k).ok())?;
    opts.unbuffered = !who.no_unbuffered;
    let out = session_outcome(Job::Spawn(cmd), opts)?;
    if who.gpucheck {
        nantrace::gpucheck::after_nan(&out.bundles);
    }
    Ok(out.exit_code)
}

/// `nantrace demo`: the built-in training job under the recorder, its fault injected.
fn demo(scenario: String, rec: &RecArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(
        nantrace::demo::SCENARIOS.contains(&scenario.as_str()),
        "unknown scenario {scenario:?}; known: {:?}",
        nantrace::demo::SCENARIOS
    );
    let me = std::env::current_exe().context("locating the nantrace binary")?;
    let mut opts = rec.opts();
    opts.injected = (scenario != "numeric").then(|| {
        format!("demo scenario {scenario}: fault injected through real kernel mechanisms")
    });
    // The demo's staged kernel log lines are its own writes into /dev/kmsg: read as the
    // kernel's, as a test cluster's are, and the bundle says the fault was injected.
    opts.trust_user_written_kmsg = opts.injected.is_some();
    say!("nantrace demo: running the built-in training job (scenario {scenario}); it diverges to NaN in a few seconds");
    let job = Job::Spawn(vec![
        me.display().to_string(),
        "demo-train".into(),
        "--scenario".into(),
        scenario,
    ]);
    let code = session(job, opts)?;
    say!("nantrace demo: the demo job exited with {code} (it stops itself when its loss is NaN)");
    Ok(0)
}

/// `bench-internal`'s arguments (the benchmark's own workloads).
#[derive(clap::Args)]
struct Bench {
    what: String,
    #[arg(long, default_value_t = 1000)]
    n: u64,
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    #[arg(long)]
    go: Option<PathBuf>,
    #[arg(long, default_value_t = 10)]
    kmsg_every: u32,
    /// synth, synth-gen: offered events per second, seconds, records per syscall, threads
    #[arg(long, default_value_t = 500_000)]
    rate: u64,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    #[arg(long, default_value_t = 32)]
    burst: u32,
    #[arg(long, default_value_t = 2)]
    threads: u32,
}

/// One of the benchmark's own workloads (`cargo xtask bench` runs them).
fn bench_internal(a: &Bench) -> anyhow::Result<serde_json::Value> {
    use nantrace::benchkit as b;
    let what = a.what.as_str();
    let go = a.go.as_deref();
    Ok(match what {
        "workload" => b::workload(a.n as u32, a.kmsg_every, &a.dir, go),
        "forkstorm" => b::forkstorm(a.n, go),
        "memory" => b::memory(a.n),
        "drain" => b::drain(a.n),
        "dump" => b::dump(a.n, &a.dir),
        "bpf-stats" => b::bpf_stats(),
        "floor" => b::floor(go)?,
        "microcost" => b::microcost(a.n)?,
        "membership" => b::membership(a.n, &a.dir)?,
        "leader-exit" | "thread-exec" | "thread-exit-last" => b::test_job(what, &a.dir),
        "nvml-cost" | "cuda-steps" => b::gpu(what, a.seconds, a.n),
        "synth" => runtime()?.block_on(b::synth(a.rate, a.seconds, a.burst, a.threads))?,
        "synth-gen" => b::synth_gen(a.rate, a.seconds, a.burst, a.threads, go),
        other => anyhow::bail!("unknown bench-internal {other}"),
    })
}
