//! The scenarios of the VM cluster: a fault on one node (or none, or an agent stopped), the
//! job run through Slurm, and the job report on its incident checked against what each must
//! give.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use super::{wait_for, Cluster, NODES};

/// One scenario: the job's NaN step (0: none), a fault and when (rank 0's step), which
/// agent is stopped, and what the job report must say.
pub(super) struct Scenario {
    name: &'static str,
    nan_at: u32,
    steps: u32,
    /// (node, step at which, script)
    fault: Option<(usize, u32, &'static str)>,
    /// The line the fault makes the node's kernel print: its record in the node's /dev/kmsg
    /// must be the kernel's (facility 0), or the scenario proves nothing.
    kernel_line: Option<&'static str>,
    clear: Option<(usize, &'static str)>,
    stop_agent: Option<usize>,
    /// The verdict starts with this; the named node; the missing nodes.
    verdict: &'static str,
    node: Option<&'static str>,
    missing: &'static [&'static str],
    contains: &'static str,
}

/// The Xid is printed by n2's kernel (the test module scripts/vm/fault-module/, loaded by
/// cluster-guest.sh): /dev/kmsg records it with facility 0, as the driver's own line, and the
/// drain rests on it. A line written into /dev/kmsg from user space would be LOG_USER and
/// drain nothing; no switch in the guests' agents trusts one.
const XID: &str = "echo 'xid 0000:3b:00 79 2214' > /sys/kernel/debug/nantrace_fault/inject";
/// What [`XID`] makes the kernel print (NVIDIA's format, FIELD-NOTES.md).
const XID_LINE: &str =
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python3, GPU has fallen off the bus.";
/// Half of what n2 sends to rank 0 is lost: its kernel retransmits, the job goes on slowly.
const DROP: &str = "nft add table inet ntc && nft add chain inet ntc out '{ type filter hook output priority 0; }' && nft add rule inet ntc out tcp dport 29500 numgen random mod 2 0 drop";

/// In this order: a node's window keeps what happened on it (the Xid of the last scenario
/// would be evidence in every later incident of n2, as on a real node), and the peers are
/// compared over the two minutes before each incident.
pub(super) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "numeric",
        nan_at: 15,
        steps: 60,
        fault: None,
        kernel_line: None,
        clear: None,
        stop_agent: None,
        verdict: "NOT THE MACHINE",
        node: None,
        missing: &[],
        contains: "3 nodes",
    },
    Scenario {
        name: "agent-down-on-n3",
        nan_at: 12,
        steps: 60,
        fault: None,
        kernel_line: None,
        clear: None,
        stop_agent: Some(2),
        verdict: "",
        node: None,
        missing: &["n3"],
        contains: "INCOMPLETE: no bundle from n3",
    },
    // Packet loss on n2: both ends of the link retransmit (n1 more than n2: its replies go
    // unacknowledged); the job report names n2 from the job's own sockets (n1's link to n3
    // stays clean), not the busier end.
    Scenario {
        name: "packet-loss-on-n2",
        nan_at: 45,
        steps: 60,
        fault: Some((1, 8, DROP)),
        kernel_line: None,
        clear: Some((1, "nft delete table inet ntc")),
        stop_agent: None,
        verdict: "",
        node: Some("n2"),
        missing: &[],
        contains: "network",
    },
    Scenario {
        name: "xid-on-n2",
        nan_at: 25,
        steps: 60,
        fault: Some((1, 12, XID)),
        kernel_line: Some(XID_LINE),
        clear: None,
        stop_agent: None,
        verdict: "PROBABLY THE MACHINE (GPU): n2, GPU 0000:3b:00.0",
        node: Some("n2"),
        missing: &[],
        contains: "Xid 79",
    },
];

pub(super) struct Outcome {
    pub(super) name: &'static str,
    pub(super) ok: bool,
    pub(super) verdict: String,
    pub(super) to_bundles_s: f64,
    pub(super) problem: String,
}

fn report(nt: &Path, dir: &Path) -> Result<Value> {
    let o = Command::new(nt)
        .args(["report", "--json"])
        .arg(dir)
        .output()?;
    if !o.status.success() {
        bail!(
            "nantrace report {}: {}",
            dir.display(),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(serde_json::from_slice(&o.stdout)?)
}

/// The Slurm job of scenario `s` (3 nodes, one rank each), submitted on n1; its id.
fn submit(c: &mut Cluster, s: &Scenario) -> Result<String> {
    let step_file = format!("/mnt/shared/out/step.{}", s.name);
    let env = format!("MASTER_ADDR=10.77.0.11 STEPS={} NAN_AT={} STEP_PAUSE=0.3 STEP_TIMEOUT=8 STEP_FILE={step_file}", s.steps, s.nan_at);
    let out = c.ok(0, &format!("export SLURM_CONF=/mnt/shared/slurm.conf; sbatch --parsable -N3 --ntasks-per-node=1 -J {} -o /mnt/shared/out/%j.batch --wrap 'srun env {env} /usr/bin/python3 /mnt/shared/cluster-job.py'", s.name))?;
    let id = out.trim().lines().last().unwrap_or("").trim().to_string();
    eprintln!("xtask: vm-cluster: {}: Slurm job {id}", s.name);
    Ok(id)
}

/// The step rank 0 of scenario `name` is at (0 before its first).
fn step(shared: &Path, name: &str) -> u32 {
    std::fs::read_to_string(shared.join(format!("out/step.{name}")))
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        .unwrap_or(0)
}

/// The fault's script on its node once rank 0 is at its step.
fn inject(c: &mut Cluster, s: &Scenario, (node, at, script): (usize, u32, &str)) -> Result<()> {
    let shared = c.shared.clone();
    wait_for(
        &format!("{}: rank 0 at step {at}", s.name),
        Duration::from_secs(180),
        || (step(&shared, s.name) >= at).then_some(()),
    )?;
    c.ok(node, script)?;
    eprintln!(
        "xtask: vm-cluster: {}: fault on {} at step {}",
        s.name,
        NODES[node],
        step(&shared, s.name)
    );
    Ok(())
}

/// The prefix (`prio,seq,time,flags`) of the last record in `node`'s /dev/kmsg whose message
/// is `line`; an error unless the kernel wrote it (facility 0: `prio >> 3`, klog::Writer).
fn kernel_record(c: &mut Cluster, node: usize, line: &str) -> Result<String> {
    if line.contains('\'') {
        bail!("a kernel line with a quote: {line}");
    }
    let out = c.ok(
        node,
        &format!(
            r#"python3 - '{line}' <<'PY'
import os, sys
fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
while True:
    try:
        rec = os.read(fd, 8192).decode("utf-8", "replace")
    except BlockingIOError:
        break
    except BrokenPipeError:
        continue
    head, _, msg = rec.partition(";")
    if msg.split("\n", 1)[0] == sys.argv[1]:
        print(head)
PY"#
        ),
    )?;
    let Some(head) = out.lines().last().map(str::trim) else {
        bail!(
            "{}: no record \"{line}\" in /dev/kmsg: the fault did not reach the kernel",
            NODES[node]
        );
    };
    let prio: u32 = head
        .split(',')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{}: a /dev/kmsg record's prefix {head:?}", NODES[node]))?;
    if prio >> 3 != 0 {
        bail!(
            "{}: the record \"{line}\" ({head}) has facility {}: written from user space, not \
             by the kernel",
            NODES[node],
            prio >> 3
        );
    }
    Ok(head.to_string())
}

/// The incident directory under `jobs` that holds `want` node bundles.
fn wait_bundles(s: &Scenario, id: &str, jobs: &Path, want: usize) -> Result<PathBuf> {
    wait_for(
        &format!(
            "{}: {want} node bundles under one incident of job {id}",
            s.name
        ),
        Duration::from_secs(90),
        || {
            let rd = std::fs::read_dir(jobs).ok()?;
            rd.flatten().map(|e| e.path()).find(|inc| {
                NODES
                    .iter()
                    .filter(|n| inc.join(n).join("report.md").exists())
                    .count()
                    >= want
            })
        },
    )
}

pub(super) fn run_scenario(c: &mut Cluster, nt: &Path, s: &Scenario) -> Result<Outcome> {
    let shared = c.shared.clone();
    if let Some(n) = s.stop_agent {
        c.ok(n, "kill $(cat /run/ntc/nt/agent.pid); sleep 1")?;
    }
    let id = submit(c, s)?;
    if let Some(fault) = s.fault {
        inject(c, s, fault)?;
        if let Some(line) = s.kernel_line {
            let head = kernel_record(c, fault.0, line)?;
            eprintln!(
                "xtask: vm-cluster: {}: {}'s kernel wrote it: /dev/kmsg record {head} (facility 0)",
                s.name, NODES[fault.0]
            );
        }
    }
    // The job ends (its NaN, or the timeout the fault causes): then every node's bundle.
    let batch = shared.join(format!("out/{id}.batch"));
    // srun forwards every rank's output to the batch script's (rank 0 runs on the batch node,
    // n1): that file is the job's log, as in most Slurm jobs.
    let rank0 = batch.clone();
    let ended = wait_for(
        &format!("{}: the job's end", s.name),
        Duration::from_secs(240),
        || {
            let log = std::fs::read_to_string(&rank0).unwrap_or_default();
            (log.contains("loss nan") || log.contains("TIMEOUT") || log.contains("done"))
                .then(Instant::now)
        },
    )?;
    if let Some((node, script)) = s.clear {
        let _ = c.exec(node, script, Duration::from_secs(30));
    }
    let want = 3 - s.stop_agent.map_or(0, |_| 1);
    let jobs = shared.join("jobs").join(&id);
    let found = wait_bundles(s, &id, &jobs, want);
    let mut o = Outcome {
        name: s.name,
        ok: false,
        verdict: String::new(),
        to_bundles_s: ended.elapsed().as_secs_f64(),
        problem: String::new(),
    };
    let inc = match found {
        Ok(p) => p,
        Err(e) => {
            o.problem = format!(
                "{e:#}; job directory: {:?}",
                std::fs::read_dir(&jobs).map(|r| r
                    .flatten()
                    .map(|e| e.path().display().to_string())
                    .collect::<Vec<_>>())
            );
            if let Some(n) = s.stop_agent {
                restart_agent(c, n, nt)?;
            }
            return Ok(o);
        }
    };
    o.to_bundles_s = ended.elapsed().as_secs_f64();
    // The bundles of the other nodes may still be on their way: a moment for the slowest.
    std::thread::sleep(Duration::from_secs(2));
    let r = report(nt, &inc)?;
    o.verdict = r["verdict"].as_str().unwrap_or("").to_string();
    let problems = judge(s, &r, &id, &inc, &jobs);
    o.ok = problems.is_empty();
    o.problem = problems.join("; ");
    if let Some(n) = s.stop_agent {
        restart_agent(c, n, nt)?;
    }
    Ok(o)
}

/// Where the job report `r` of incident `inc` differs from what scenario `s` must give.
fn judge(s: &Scenario, r: &Value, id: &str, inc: &Path, jobs: &Path) -> Vec<String> {
    let verdict = r["verdict"].as_str().unwrap_or("");
    let mut problems = Vec::new();
    if !verdict.starts_with(s.verdict) {
        problems.push(format!("verdict does not start with {:?}", s.verdict));
    }
    if !verdict.contains(s.contains) {
        problems.push(format!("verdict does not say {:?}", s.contains));
    }
    if r["node"].as_str() != s.node {
        problems.push(format!("named node {} instead of {:?}", r["node"], s.node));
    }
    let missing: Vec<&str> = r["missing"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if missing != s.missing {
        problems.push(format!("missing {missing:?} instead of {:?}", s.missing));
    }
    if r["jobs"]
        .as_array()
        .is_none_or(|j| j.len() != 1 || j[0] != id)
    {
        problems.push(format!("job ids {}", r["jobs"]));
    }
    // One incident, whatever the timing: its marker there, and no second incident of the job
    // holding a node's bundle (the split of 12-02: n3's incident beside n2's).
    if !inc.join("INCIDENT.json").is_file() {
        problems.push(format!("{} has no INCIDENT.json", inc.display()));
    }
    let others: Vec<String> = std::fs::read_dir(jobs)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            *p != inc
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                && NODES.iter().any(|n| p.join(n).join("report.md").exists())
        })
        .map(|p| p.display().to_string())
        .collect();
    if !others.is_empty() {
        problems.push(format!(
            "the incident split: node bundles also under {others:?}"
        ));
    }
    problems
}

/// Start the agent of `node` again and wait until its probes are attached.
fn restart_agent(c: &mut Cluster, node: usize, nt: &Path) -> Result<()> {
    c.ok(node, &format!("n0=$(grep -c 'probes attached' /mnt/agent.log); nohup {} agent --config /run/ntc/nt/agent.toml >> /mnt/agent.log 2>&1 & echo $! > /run/ntc/nt/agent.pid; for i in $(seq 1 600); do [ \"$(grep -c 'probes attached' /mnt/agent.log)\" -gt \"$n0\" ] && exit 0; sleep 0.2; done; echo 'the agent did not start'; exit 1", nt.display()))
        .map(|_| ())
}
