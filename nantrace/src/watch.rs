//! `nantrace watch`: the live event stream, one JSON object per line.
use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::clock::{rfc3339, ClockMap};
use crate::event::{comm_str, Event};
use crate::probes::{Options, ProbeStatus, Probes};

#[derive(Clone, Debug)]
pub struct WatchArgs {
    pub pids: Vec<u32>,
    pub duration: Option<f64>,
    pub json: bool,
    pub slow_io_ms: f64,
}

/// What was seen and what was lost: printed at the end of `watch`, stored in every bundle.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Accounting {
    pub events: BTreeMap<String, u64>,
    pub kernel_drops: BTreeMap<String, u64>,
    /// What the block probes could not keep (`Probes::block_losses`).
    pub block_losses: BTreeMap<String, u64>,
    /// What the job membership map could not follow (`Probes::membership_losses`).
    pub membership_losses: BTreeMap<String, u64>,
    pub decode_errors: u64,
    pub probes_attached: Vec<String>,
    pub probes_not_attached: BTreeMap<String, String>,
    /// The attached probes that run as `tp_btf` programs (the rest read tracefs records).
    pub probes_btf: Vec<String>,
    /// Where the kernel log lines came from (`printk:console` or `/dev/kmsg`) and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_log: Option<crate::klog::KlogSource>,
}

impl Accounting {
    pub fn with_probes(status: &[ProbeStatus]) -> Self {
        let mut a = Accounting::default();
        for s in status {
            if s.attached {
                a.probes_attached.push(s.tracepoint.clone());
                if s.path == crate::probes::ProbePath::Btf {
                    a.probes_btf.push(s.tracepoint.clone());
                }
            } else {
                a.probes_not_attached
                    .insert(s.tracepoint.clone(), s.reason.clone().unwrap_or_default());
            }
        }
        a
    }
}

/// Load the probes, seed the job's pids, and report what did not attach on stderr.
pub fn start_probes(pids: &[u32], slow_io_ms: f64) -> anyhow::Result<Probes> {
    start_probes_with(pids, slow_io_ms, pids.is_empty())
}

/// As [`start_probes`]; `whole_machine`: abnormal exits and fatal signals of every process.
pub fn start_probes_with(
    pids: &[u32],
    slow_io_ms: f64,
    whole_machine: bool,
) -> anyhow::Result<Probes> {
    let opts = Options {
        slow_io_ns: (slow_io_ms * 1e6) as u64,
        whole_machine,
        ..Options::default()
    };
    let mut probes = Probes::load(&opts).context("starting the kernel probes")?;
    for s in &probes.status {
        if !s.attached {
            crate::say!(
                "nantrace: probe {} not attached: {}",
                s.tracepoint,
                s.reason.as_deref().unwrap_or("?")
            );
        }
    }
    for pid in pids {
        if !crate::correlate::alive(*pid) {
            crate::say!(
                "nantrace: pid {pid} does not exist (already exited?); watching for it anyway"
            );
        }
    }
    for p in crate::correlate::descendants(pids) {
        for t in crate::correlate::threads(p).into_iter().chain([p]) {
            probes.add_job_pid(t)?;
        }
    }
    Ok(probes)
}

pub fn human_line(e: &Event, clock: &ClockMap) -> String {
    let j = e.to_json(clock);
    let mut rest = String::new();
    if let serde_json::Value::Object(m) = &j {
        for (k, v) in m {
            if matches!(
                k.as_str(),
                "time" | "mono_ns" | "source" | "pid" | "tid" | "comm" | "job"
            ) {
                continue;
            }
            rest.push_str(&format!(" {k}={v}"));
        }
    }
    format!(
        "{} {:<14} {}{:>7} {:<16}{}",
        rfc3339(clock.to_wall(e.mono_ns)),
        e.source(),
        if e.job() { "*" } else { " " },
        e.pid,
        comm_str(&e.comm),
        rest
    )
}

pub async fn run(args: WatchArgs) -> anyhow::Result<()> {
    let mut probes = start_probes(&args.pids, args.slow_io_ms)?;
    let mut acct = Accounting::with_probes(&probes.status);
    acct.kernel_log = probes.klog.clone();
    let (tx, mut rx) = mpsc::channel(256);
    let stats = probes.start_readers(tx)?;
    let mut clock = ClockMap::sample();
    // One SIGINT stream for the whole loop: a `ctrl_c()` made anew at each turn misses a SIGINT
    // that arrives while a batch is being written (the signal is recorded, nobody listens).
    // Made before "watching" is said: a SIGINT sent as soon as that line is read (the tests'
    // stop) found no handler and killed the watch before its accounting line.
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    crate::say!(
        "nantrace: watching {} ({} of {} probes attached){}",
        if args.pids.is_empty() {
            "the whole machine".to_string()
        } else {
            format!("pids {:?} and descendants", args.pids)
        },
        probes.attached(),
        probes.status.len(),
        args.duration
            .map_or(String::new(), |d| format!(" for {d} s"))
    );
    let deadline = args
        .duration
        .map(|d| tokio::time::Instant::now() + Duration::from_secs_f64(d));
    let mut resample = tokio::time::interval(Duration::from_secs(10));
    let stdout = std::io::stdout();
    loop {
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            batch = rx.recv() => {
                let Some(batch) = batch else { break };
                let mut out = stdout.lock();
                for e in batch {
                    *acct.events.entry(e.source().to_string()).or_default() += 1;
                    let line = if args.json { e.to_json(&clock).to_string() } else { human_line(&e, &clock) };
                    if writeln!(out, "{line}").is_err() {
                        return Ok(()); // stdout closed (e.g. piped into head)
                    }
                }
                let _ = out.flush();
            }
            _ = resample.tick() => clock = ClockMap::sample(),
            _ = sleep => break,
            _ = sigint.recv() => break,
        }
    }
    acct.kernel_drops = probes
        .drops()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    if acct
        .kernel_log
        .as_ref()
        .is_some_and(crate::klog::KlogSource::is_kmsg)
    {
        acct.kernel_drops.insert(
            "kmsg_overwritten".into(),
            stats.kmsg_missed.load(Ordering::Relaxed),
        );
    }
    acct.block_losses = probes
        .block_losses()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    acct.membership_losses = probes
        .membership_losses()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    acct.decode_errors = stats.decode_errors.load(Ordering::Relaxed);
    let mut doc = serde_json::json!({ "accounting": acct });
    doc["accounting"]["io_latency_histograms_log2_us"] = serde_json::json!(probes.io_histograms());
    if args.json {
        crate::sayout!("{doc}");
    } else {
        crate::say!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}
