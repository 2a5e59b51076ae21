//! `cargo xtask vm-cluster`: the multi-node tests on a cluster of three QEMU/TCG VMs, each with
//! its own kernel (Debian bookworm's 6.1), /proc, /dev/kmsg and probes: Debian's slurm-wlm
//! and munge (slurmctld on n1, slurmd on each), the nantrace agent on each with its job
//! directory on a 9p directory the three share, the nodes on a private bridge inside a
//! network namespace. The guests run the host's own binaries (its root over 9p read-only, as
//! the kernel matrix does: scripts/vm/). A 3-rank job over TCP (scripts/vm/cluster-job.py,
//! one rank per node through srun; rank 0 prints the loss); the scenarios and what each
//! must give are in [`SCENARIOS`]; `nantrace report` on the job's incident directory is run
//! here, on the host, as a person would. A kernel fault (the Xid) is printed by the node's
//! kernel through a test module built here against Debian's headers of the guests' kernel
//! ([`fault_module`], scripts/vm/fault-module/), never written into /dev/kmsg from user space.
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::{root, run};

mod scenario;

use scenario::{run_scenario, Outcome, SCENARIOS};

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

/// The cluster's kernel (Debian bookworm's, cached, with [`MODULES`]); its directory.
fn fetch_kernel() -> Result<PathBuf> {
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
    Ok(cache.join("kernels/cluster-6.1-bookworm"))
}

/// The cluster's test-fault module (scripts/vm/fault-module/, built by
/// scripts/vm/fault-module.sh against Debian's headers of the kernel in `kdir`, cached under
/// the kernel package's version): its path. The scenarios' kernel faults are printed by the
/// guests' kernels through it (facility 0 in /dev/kmsg, as a driver's own lines); a write
/// into /dev/kmsg from user space drains nothing, and no switch trusts one here. Fails when
/// it cannot build: the Xid scenario would prove nothing without it.
fn fault_module(kdir: &Path) -> Result<PathBuf> {
    let cache = kdir
        .parent()
        .and_then(Path::parent)
        .context("the kernel's cache directory")?;
    let label = kdir
        .file_name()
        .context("the kernel's label")?
        .to_string_lossy()
        .into_owned();
    let mut build = Command::new("bash");
    build
        .arg(root().join("scripts/vm/fault-module.sh"))
        .arg(cache)
        .args([label.as_str(), "bookworm"]);
    eprintln!("xtask: running {build:?}");
    let t0 = Instant::now();
    let o = build
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("spawning scripts/vm/fault-module.sh")?;
    if !o.status.success() {
        bail!(
            "building the cluster's fault module (scripts/vm/fault-module/) failed ({}): the Xid \
             scenario needs the kernel to print its fault",
            o.status
        );
    }
    let ko = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    if !ko.is_file() {
        bail!("scripts/vm/fault-module.sh: no module at {}", ko.display());
    }
    eprintln!(
        "xtask: vm-cluster: fault module {} ({:.1} s)",
        ko.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ko)
}

/// The directory the nodes share: Slurm's and munge's configuration and key, the hosts, the
/// job's script; the job directories, the job's output, each node's commands.
fn prepare_shared(shared: &Path) -> Result<()> {
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
    ))
}

/// Each node's directory under `base` (its guest script and vm.env), and its VM booted in
/// `netns`; the VMs already booted are killed when one does not boot.
fn boot_nodes(
    nt: &Path,
    kdir: &Path,
    ko: &Path,
    base: &Path,
    shared: &Path,
    netns: &str,
) -> Result<Vec<Child>> {
    let mut vms = Vec::new();
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
        // Loaded by the guest (insmod /mnt/nantrace_fault.ko) before its agent starts.
        std::fs::copy(ko, out.join("nantrace_fault.ko"))?;
        std::fs::write(
            out.join("vm.env"),
            format!(
                "NODE={n}\nIP=10.77.0.{}\nNT={}\nREPO={}\n",
                11 + i,
                nt.display(),
                root().display()
            ),
        )?;
        match boot(kdir, &out, netns, i, shared) {
            Ok(vm) => vms.push(vm),
            Err(e) => {
                for vm in &vms {
                    // SAFETY: as in stop_nodes.
                    unsafe { libc_kill(-(vm.id() as i32), 9) };
                }
                return Err(e);
            }
        }
    }
    Ok(vms)
}

/// Once the three agents are up and Slurm has three idle nodes (`t0`: the boots' start), each
/// scenario in turn.
fn scenarios(c: &mut Cluster, nt: &Path, t0: Instant) -> Result<Vec<Outcome>> {
    let shared = c.shared.clone();
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
    // The fault module on every node, or no scenario: an Xid that never reached the kernel
    // proves nothing.
    for i in 0..NODES.len() {
        c.ok(i, "grep -q '^nantrace_fault ' /proc/modules && test -e /sys/kernel/debug/nantrace_fault/inject || { echo \"the fault module is not loaded: $(cat /mnt/insmod.log 2>/dev/null)\"; exit 1; }")?;
    }
    let mut outs = Vec::new();
    for s in SCENARIOS {
        let t = Instant::now();
        let o = run_scenario(c, nt, s)?;
        eprintln!(
            "xtask: vm-cluster: {}: {} in {:.0} s (job end to the node bundles {:.1} s): {}{}",
            o.name,
            if o.ok { "ok" } else { "FAILED" },
            t.elapsed().as_secs_f64(),
            o.to_bundles_s,
            o.verdict,
            if o.problem.is_empty() {
                String::new()
            } else {
                format!(" -- {}", o.problem)
            }
        );
        outs.push(o);
    }
    Ok(outs)
}

/// Ask each node to stop, give the VMs a minute, then kill what is left.
fn stop_nodes(vms: Vec<Child>, shared: &Path) {
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
}

/// The cluster in `netns`: its taps, the three VMs, the scenarios, the VMs stopped.
fn in_netns(
    nt: &Path,
    kdir: &Path,
    ko: &Path,
    base: &Path,
    shared: &Path,
    netns: &str,
) -> Result<Vec<Outcome>> {
    for i in 1..=3 {
        sh(&format!("ip -n {netns} tuntap add tap{i} mode tap && ip -n {netns} link set tap{i} master br0 && ip -n {netns} link set tap{i} up"))?;
    }
    let t0 = Instant::now();
    let vms = boot_nodes(nt, kdir, ko, base, shared, netns)?;
    let mut c = Cluster {
        shared: shared.to_path_buf(),
        seq: [0; 3],
    };
    let r = scenarios(&mut c, nt, t0);
    stop_nodes(vms, shared);
    r
}

pub fn vm_cluster(nt: &Path) -> Result<()> {
    crate::setup::apt_install(crate::vm::VM_PACKAGES)?;
    crate::setup::apt_install(&["iproute2", "nftables", "python3"])?;
    run(Command::new("bash")
        .arg(root().join("scripts/slurm-local.sh"))
        .arg("install"))?;
    // The fault module's build: the kernel's headers (Debian's) and its compiler.
    crate::setup::apt_install(&["gcc-12", "make", "libelf1", "libssl3"])?;
    let kdir = fetch_kernel()?;
    let ko = fault_module(&kdir)?;
    let base = root()
        .join("target/vm-cluster")
        .join(format!("{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let shared = base.join("shared");
    prepare_shared(&shared)?;
    let netns = format!("ntc{}", std::process::id());
    sh(&format!("ip netns add {netns} && ip -n {netns} link add br0 type bridge && ip -n {netns} addr add 10.77.0.1/24 dev br0 && ip -n {netns} link set br0 up && ip -n {netns} link set lo up"))?;
    let result = in_netns(nt, &kdir, &ko, &base, &shared, &netns);
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
