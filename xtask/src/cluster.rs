//! `cargo xtask vm-cluster`: the multi-node tests on a cluster of three QEMU/TCG VMs, each with
//! its own kernel (Debian bookworm's 6.1), /proc, /dev/kmsg and probes: Debian's slurm-wlm
//! and munge (slurmctld on n1, slurmd on each), the nantrace agent on each with its job
//! directory on a 9p directory the three share, the nodes on a private bridge inside a
//! network namespace. The guests run the host's own binaries (its root over 9p read-only, as
//! the kernel matrix does: scripts/vm/). A 3-rank job over TCP (scripts/vm/cluster-job.py,
//! one rank per node through srun; rank 0 prints the loss); the scenarios and what each
//! must give are in [`SCENARIOS`]; `nantrace report` on the job's incident directory is run
//! here, on the host, as a person would.
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{root, run};

const NODES: [&str; 3] = ["n1", "n2", "n3"];
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "virtio_net",
    "crc32c_generic",
    "nf_tables",
    "nft_numgen",
];

/// What the host asks a node to run (through the shared directory), and waits for.
struct Cluster {
    shared: PathBuf,
    seq: [u32; 3],
}

impl Cluster {
    fn exec(&mut self, node: usize, script: &str, timeout: Duration) -> Result<(i32, String)> {
        self.seq[node] += 1;
        let n = self.seq[node];
        let d = self.shared.join("cmd").join(NODES[node]);
        std::fs::write(d.join(format!(".{n}.sh")), script)?;
        std::fs::rename(d.join(format!(".{n}.sh")), d.join(format!("{n}.sh")))?;
        let t0 = Instant::now();
        loop {
            if let Ok(rc) = std::fs::read_to_string(d.join(format!("{n}.rc"))) {
                let out = std::fs::read_to_string(d.join(format!("{n}.out"))).unwrap_or_default();
                return Ok((rc.trim().parse().unwrap_or(-1), out));
            }
            if t0.elapsed() > timeout {
                bail!(
                    "{}: `{}` did not finish within {timeout:?}",
                    NODES[node],
                    script.lines().next().unwrap_or("")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn ok(&mut self, node: usize, script: &str) -> Result<String> {
        let (rc, out) = self.exec(node, script, Duration::from_secs(120))?;
        if rc != 0 {
            bail!("{}: `{script}` exited {rc}: {out}", NODES[node]);
        }
        Ok(out)
    }
}

/// One scenario: the job's NaN step (0: none), a fault and when (rank 0's step), which
/// agent is stopped, and what the job report must say.
struct Scenario {
    name: &'static str,
    nan_at: u32,
    steps: u32,
    /// (node, step at which, script)
    fault: Option<(usize, u32, &'static str)>,
    clear: Option<(usize, &'static str)>,
    stop_agent: Option<usize>,
    /// The verdict starts with this; the named node; the missing nodes.
    verdict: &'static str,
    node: Option<&'static str>,
    missing: &'static [&'static str],
    contains: &'static str,
}

const XID: &str = "echo '<3>NVRM: Xid (PCI:0000:3b:00): 79, pid=2214, name=python3, GPU has fallen off the bus.' > /dev/kmsg";
/// Half of what n2 sends to rank 0 is lost: its kernel retransmits, the job goes on slowly.
const DROP: &str = "nft add table inet ntc && nft add chain inet ntc out '{ type filter hook output priority 0; }' && nft add rule inet ntc out tcp dport 29500 numgen random mod 2 0 drop";

/// In this order: a node's window keeps what happened on it (the Xid of the last scenario
/// would be evidence in every later incident of n2, as on a real node), and the peers are
/// compared over the two minutes before each incident.
const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "numeric",
        nan_at: 15,
        steps: 60,
        fault: None,
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
        clear: None,
        stop_agent: None,
        verdict: "PROBABLY THE MACHINE (GPU): n2, GPU 0000:3b:00.0",
        node: Some("n2"),
        missing: &[],
        contains: "Xid 79",
    },
];

pub struct Outcome {
    pub name: &'static str,
    pub ok: bool,
    pub verdict: String,
    pub to_bundles_s: f64,
    pub problem: String,
}

fn sh(cmd: &str) -> Result<()> {
    run(Command::new("bash").args(["-c", cmd]))
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if t0.elapsed() > timeout {
            bail!("{what}: not within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn slurm_conf() -> String {
    let mut c = String::from(
        "ClusterName=ntc\nSlurmctldHost=n1(10.77.0.11)\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n\
AuthInfo=socket=/run/ntc/munge/munge.socket\nStateSaveLocation=/run/ntc/slurm/state\nSlurmdSpoolDir=/run/ntc/slurm/spool\n\
SlurmctldPidFile=/run/ntc/slurm/pid/slurmctld.pid\nSlurmdPidFile=/run/ntc/slurm/pid/slurmd.pid\nSlurmctldLogFile=/mnt/slurmctld.log\n\
SlurmdLogFile=/mnt/slurmd.log\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/linear\nSchedulerType=sched/backfill\n\
MpiDefault=none\nSwitchType=switch/none\nJobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
JobCompType=jobcomp/none\nReturnToService=2\nSlurmdTimeout=120\nSlurmctldTimeout=120\nInactiveLimit=0\nKillWait=2\nMinJobAge=300\n\
MessageTimeout=30\nMailProg=/bin/true\n",
    );
    for (i, n) in NODES.iter().enumerate() {
        c.push_str(&format!(
            "NodeName={n} NodeAddr=10.77.0.{} CPUs=1 RealMemory=400 State=UNKNOWN\n",
            11 + i
        ));
    }
    c.push_str("PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP\n");
    c
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

fn run_scenario(c: &mut Cluster, nt: &Path, s: &Scenario) -> Result<Outcome> {
    let shared = c.shared.clone();
    if let Some(n) = s.stop_agent {
        c.ok(n, "kill $(cat /run/ntc/nt/agent.pid); sleep 1")?;
    }
    let step_file = format!("/mnt/shared/out/step.{}", s.name);
    let env = format!("MASTER_ADDR=10.77.0.11 STEPS={} NAN_AT={} STEP_PAUSE=0.3 STEP_TIMEOUT=8 STEP_FILE={step_file}", s.steps, s.nan_at);
    let out = c.ok(0, &format!("export SLURM_CONF=/mnt/shared/slurm.conf; sbatch --parsable -N3 --ntasks-per-node=1 -J {} -o /mnt/shared/out/%j.batch --wrap 'srun env {env} /usr/bin/python3 /mnt/shared/cluster-job.py'", s.name))?;
    let id = out.trim().lines().last().unwrap_or("").trim().to_string();
    eprintln!("xtask: vm-cluster: {}: Slurm job {id}", s.name);
    let step = |shared: &Path| {
        std::fs::read_to_string(shared.join(format!("out/step.{}", s.name)))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            .unwrap_or(0)
    };
    if let Some((node, at, script)) = s.fault {
        wait_for(
            &format!("{}: rank 0 at step {at}", s.name),
            Duration::from_secs(180),
            || (step(&shared) >= at).then_some(()),
        )?;
        c.ok(node, script)?;
        eprintln!(
            "xtask: vm-cluster: {}: fault on {} at step {}",
            s.name,
            NODES[node],
            step(&shared)
        );
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
    let found = wait_for(
        &format!(
            "{}: {want} node bundles under one incident of job {id}",
            s.name
        ),
        Duration::from_secs(90),
        || {
            let rd = std::fs::read_dir(&jobs).ok()?;
            rd.flatten().map(|e| e.path()).find(|inc| {
                NODES
                    .iter()
                    .filter(|n| inc.join(n).join("report.md").exists())
                    .count()
                    >= want
            })
        },
    );
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
    let mut problems = Vec::new();
    if !o.verdict.starts_with(s.verdict) {
        problems.push(format!("verdict does not start with {:?}", s.verdict));
    }
    if !o.verdict.contains(s.contains) {
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
        .is_none_or(|j| j.len() != 1 || j[0] != id.as_str())
    {
        problems.push(format!("job ids {}", r["jobs"]));
    }
    // One incident, whatever the timing: its marker there, and no second incident of the job
    // holding a node's bundle (the split of 12-02: n3's incident beside n2's).
    if !inc.join("INCIDENT.json").is_file() {
        problems.push(format!("{} has no INCIDENT.json", inc.display()));
    }
    let others: Vec<String> = std::fs::read_dir(&jobs)
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
    o.ok = problems.is_empty();
    o.problem = problems.join("; ");
    if let Some(n) = s.stop_agent {
        restart_agent(c, n, nt)?;
    }
    Ok(o)
}

/// Start the agent of `node` again and wait until its probes are attached.
fn restart_agent(c: &mut Cluster, node: usize, nt: &Path) -> Result<()> {
    c.ok(node, &format!("n0=$(grep -c 'probes attached' /mnt/agent.log); nohup {} agent --config /run/ntc/nt/agent.toml >> /mnt/agent.log 2>&1 & echo $! > /run/ntc/nt/agent.pid; for i in $(seq 1 600); do [ \"$(grep -c 'probes attached' /mnt/agent.log)\" -gt \"$n0\" ] && exit 0; sleep 0.2; done; echo 'the agent did not start'; exit 1", nt.display()))
        .map(|_| ())
}

fn boot(kdir: &Path, out: &Path, netns: &str, i: usize, shared: &Path) -> Result<Child> {
    Command::new("ip")
        .args(["netns", "exec", netns, "bash"])
        .arg(root().join("scripts/vm/boot.sh"))
        .arg(kdir)
        .arg(out)
        .arg("1500")
        .env(
            "NANTRACE_VM_NIC",
            format!("tap{},52:54:00:77:00:{:02x}", i + 1, i + 11),
        )
        .env("NANTRACE_VM_SHARED", shared)
        .env("NANTRACE_VM_SMP", "1")
        .env("NANTRACE_VM_MEM", "1024")
        // Its own process group: stopping it stops timeout and qemu too, not only the shell.
        .process_group(0)
        .spawn()
        .context("starting qemu")
}

pub fn vm_cluster(nt: &Path) -> Result<()> {
    crate::setup::apt_install(&[
        "qemu-system-x86",
        "busybox-static",
        "cpio",
        "xz-utils",
        "zstd",
        "kmod",
        "debian-archive-keyring",
        "iproute2",
        "nftables",
        "python3",
    ])?;
    run(Command::new("bash")
        .arg(root().join("scripts/slurm-local.sh"))
        .arg("install"))?;
    let cache = PathBuf::from(
        std::env::var("NANTRACE_VM_CACHE").unwrap_or_else(|_| "/var/cache/nantrace-vm".into()),
    );
    let mut fetch = Command::new("bash");
    fetch
        .arg(root().join("scripts/vm/fetch-kernel.sh"))
        .arg(&cache)
        .args(["cluster-6.1-bookworm", "bookworm", "linux-image-amd64"])
        .args(MODULES);
    run(&mut fetch).context("fetching the cluster's kernel")?;
    let kdir = cache.join("kernels/cluster-6.1-bookworm");
    let base = root()
        .join("target/vm-cluster")
        .join(format!("{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let shared = base.join("shared");
    for d in ["jobs", "out", "cmd/n1", "cmd/n2", "cmd/n3"] {
        std::fs::create_dir_all(shared.join(d))?;
    }
    sh(&format!(
        "chmod 755 {0} {0}/jobs && chmod 777 {0}/out",
        shared.display()
    ))?;
    std::fs::write(shared.join("slurm.conf"), slurm_conf())?;
    // slurmd 22.05 starts its cgroup plugin whatever the proctrack; without systemd it must
    // be told not to ask systemd for a scope.
    std::fs::write(
        shared.join("cgroup.conf"),
        "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n",
    )?;
    std::fs::write(
        shared.join("hosts"),
        "10.77.0.11 n1\n10.77.0.12 n2\n10.77.0.13 n3\n",
    )?;
    std::fs::copy(
        root().join("scripts/vm/cluster-job.py"),
        shared.join("cluster-job.py"),
    )?;
    sh(&format!(
        "head -c 1024 /dev/urandom > {0}/munge.key && chmod 400 {0}/munge.key",
        shared.display()
    ))?;
    let netns = format!("ntc{}", std::process::id());
    sh(&format!("ip netns add {netns} && ip -n {netns} link add br0 type bridge && ip -n {netns} addr add 10.77.0.1/24 dev br0 && ip -n {netns} link set br0 up && ip -n {netns} link set lo up"))?;
    let result = (|| -> Result<Vec<Outcome>> {
        for i in 1..=3 {
            sh(&format!("ip -n {netns} tuntap add tap{i} mode tap && ip -n {netns} link set tap{i} master br0 && ip -n {netns} link set tap{i} up"))?;
        }
        let mut vms = Vec::new();
        let t0 = Instant::now();
        for (i, n) in NODES.iter().enumerate() {
            let out = base.join(n);
            std::fs::create_dir_all(&out)?;
            // The guest's /mnt, a parent of its job_dir: the agent refuses a job_dir with a
            // directory on the way others can write, whatever the umask.
            sh(&format!("chmod 755 {0} {0}/.. {0}/../..", out.display()))?;
            std::fs::copy(
                root().join("scripts/vm/cluster-guest.sh"),
                out.join("guest.sh"),
            )?;
            std::fs::write(
                out.join("vm.env"),
                format!(
                    "NODE={n}\nIP=10.77.0.{}\nNT={}\nREPO={}\n",
                    11 + i,
                    nt.display(),
                    root().display()
                ),
            )?;
            match boot(&kdir, &out, &netns, i, &shared) {
                Ok(vm) => vms.push(vm),
                Err(e) => {
                    for vm in &vms {
                        // SAFETY: as below.
                        unsafe { libc_kill(-(vm.id() as i32), 9) };
                    }
                    return Err(e);
                }
            }
        }
        let mut c = Cluster {
            shared: shared.clone(),
            seq: [0; 3],
        };
        let r = (|| -> Result<Vec<Outcome>> {
            wait_for("the three nodes' agents", Duration::from_secs(300), || {
                NODES
                    .iter()
                    .all(|n| shared.join(format!("ready.{n}")).exists())
                    .then_some(())
            })?;
            let idle = wait_for("3 idle Slurm nodes", Duration::from_secs(180), || {
                let (_, out) = c
                    .exec(
                        0,
                        "SLURM_CONF=/mnt/shared/slurm.conf sinfo -h -N -o '%N %T'",
                        Duration::from_secs(60),
                    )
                    .ok()?;
                (out.lines().filter(|l| l.ends_with(" idle")).count() == 3).then_some(out)
            })?;
            eprintln!(
                "xtask: vm-cluster: up in {:.0} s: {}",
                t0.elapsed().as_secs_f64(),
                idle.replace('\n', ", ")
            );
            let mut outs = Vec::new();
            for s in SCENARIOS {
                let t = Instant::now();
                let o = run_scenario(&mut c, nt, s)?;
                eprintln!("xtask: vm-cluster: {}: {} in {:.0} s (job end to the node bundles {:.1} s): {}{}", o.name, if o.ok { "ok" } else { "FAILED" }, t.elapsed().as_secs_f64(), o.to_bundles_s, o.verdict, if o.problem.is_empty() { String::new() } else { format!(" -- {}", o.problem) });
                outs.push(o);
            }
            Ok(outs)
        })();
        for n in NODES {
            let _ = std::fs::write(shared.join("cmd").join(n).join("stop"), "");
        }
        let t1 = Instant::now();
        for mut vm in vms {
            while vm.try_wait().ok().flatten().is_none() && t1.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(200));
            }
            if vm.try_wait().ok().flatten().is_none() {
                // SAFETY: signalling the process group this harness started.
                unsafe { libc_kill(-(vm.id() as i32), 9) };
            }
            let _ = vm.wait();
        }
        r
    })();
    let _ = Command::new("ip").args(["netns", "del", &netns]).status();
    let outs = result.with_context(|| format!("the VM cluster (logs: {})", base.display()))?;
    let bad: Vec<String> = outs
        .iter()
        .filter(|o| !o.ok)
        .map(|o| format!("{}: {}", o.name, o.problem))
        .collect();
    eprintln!("xtask: vm-cluster: logs in {}", base.display());
    if !bad.is_empty() {
        bail!("vm-cluster: {}", bad.join("; "));
    }
    Ok(())
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
