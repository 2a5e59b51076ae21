//! Draining through the real Slurm, and what may drain: the agent with a one-node Slurm
//! cluster (Debian's slurm-wlm + munge, scripts/slurm-local.sh) and a GPU job of another user.
//! As root, single-threaded.
mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::slurm::{run, Slurm};
use common::{kmsg, privileged};

/// A one-node Slurm, an agent that may drain its node (its config in `cfg`), and a Slurm job
/// of `ntjob` that holds a (stand-in) GPU and prints steps for 5 minutes.
struct Rig {
    a: Option<Agent>,
    slurm: Option<Slurm>,
    host: String,
    id: String,
    key: String,
    cfg: PathBuf,
    base: PathBuf,
    devdir: PathBuf,
}

impl Rig {
    fn up(tag: &str, port: u16, cfg_text: &str) -> Self {
        let _ = Command::new("useradd")
            .args(["-M", "-s", "/bin/bash", "ntjob"])
            .status();
        let base = std::env::temp_dir().join(format!("nt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (devdir, dev) = common::agent::fake_gpu(tag);
        let cfg = base.join("agent.toml");
        std::fs::write(&cfg, cfg_text).unwrap();
        let slurm = Slurm::up(Path::new("/bin/true"), Path::new("/bin/true"));
        let host = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout)
            .unwrap()
            .trim()
            .to_string();
        let a = Agent::start_env(
            tag,
            port,
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--gpu-device",
                devdir.join("nvidia").to_str().unwrap(),
            ],
            &[("SLURM_CONF", &slurm.conf)],
        );
        a.wait_line("drain on", Duration::from_secs(5), |l| {
            l.contains("drain = \"slurm\"") && l.contains(&format!("Slurm node {host}"))
        });
        let work = a.dir.join("work");
        std::fs::create_dir_all(&work).unwrap();
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).unwrap();
        let id = slurm.sbatch(
            "ntjob",
            &work,
            &format!(
                "exec 3<>{}; for i in $(seq 1 3000); do echo \"step $i loss 0.7\"; sleep 0.1; done",
                dev.display()
            ),
        );
        let rig = Rig {
            a: Some(a),
            slurm: Some(slurm),
            host,
            key: format!("slurm-{id}"),
            id,
            cfg,
            base,
            devdir,
        };
        rig.wait_watched();
        rig
    }

    fn a(&self) -> &Agent {
        self.a.as_ref().expect("the agent")
    }

    fn slurm(&self) -> &Slurm {
        self.slurm.as_ref().expect("the cluster")
    }

    /// The node's state in Slurm (`IDLE`, `MIXED+DRAIN`, ...).
    fn state(&self) -> String {
        self.slurm()
            .scontrol(&["show", "node", &self.host, "-o"])
            .split_whitespace()
            .find_map(|w| w.strip_prefix("State="))
            .unwrap_or("?")
            .to_string()
    }

    fn wait_watched(&self) {
        let t0 = Instant::now();
        while !self.a().ctl(&["jobs"]).to_string().contains(&self.key) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "Slurm job {} not watched: {}",
                self.id,
                self.a().ctl(&["jobs"])
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_secs(1));
    }

    /// The agent stopped, its config rewritten, started again on the same spool.
    fn restart_with(&mut self, cfg_text: &str) {
        std::fs::write(&self.cfg, cfg_text).unwrap();
        let a = self.a.take().expect("the agent");
        self.a = Some(a.restart());
        self.wait_watched();
    }

    /// The report of the newest of at least `n` bundles, once its drain section is there (the
    /// drain's outcome is appended once it was decided, and scontrol answered).
    fn newest_report(&self, n: usize) -> String {
        let b = self.a().wait_bundles(n, Duration::from_secs(40));
        assert!(b.len() >= n, "bundle {n} never came: {b:?}");
        let mut b: Vec<_> = b.into_iter().collect();
        b.sort_by_key(|p| {
            std::fs::metadata(p.join("report.md"))
                .and_then(|m| m.modified())
                .ok()
        });
        let p = b.last().unwrap().clone();
        let t0 = Instant::now();
        loop {
            let md = std::fs::read_to_string(p.join("report.md")).unwrap_or_default();
            if md.contains("\n## Drain\n") {
                return md;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no drain section in {}: {md}",
                p.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn bundles(&self) -> usize {
        self.a().wait_bundles(0, Duration::ZERO).len()
    }

    /// The metrics once `want` is in them, asserted.
    fn metrics_with(&self, want: &[&str]) -> String {
        let m = self.a().wait_metrics(Duration::from_secs(10), |m| {
            want.iter().all(|w| m.contains(w))
        });
        for w in want {
            assert!(m.contains(w), "{w} not in the metrics: {m}");
        }
        m
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(s) = &self.slurm {
            let _ = Command::new("scancel")
                .arg(&self.id)
                .env("SLURM_CONF", &s.conf)
                .status();
        }
        if let Some(a) = self.a.take() {
            a.stop();
        }
        drop(self.slurm.take());
        let _ = std::fs::remove_dir_all(&self.base);
        let _ = std::fs::remove_dir_all(&self.devdir);
    }
}

const SLURM_DRAIN: &str = "drain = \"slurm\"\nslurm_jobs = \"all\"\n";

/// Draining through the real Slurm (`drain = "slurm"`, issue 25): an Xid 13 (possibly the
/// job's own code) leaves the node alone; an Xid 79 written into /dev/kmsg from user space
/// (how this test injects it, and how a relay such as journald's `ForwardToKMsg` would bring a
/// user's text) does not drain by default: the dump checks who wrote it, the verdict is
/// POSSIBLY and says so, and the drain says it does not act on a POSSIBLY (redteam4 D-14); with `trust_user_written_kmsg = true` (restarted), an Xid 79 while a GPU
/// job runs leaves it DRAIN with nantrace's reason (`sinfo -R`), said in the bundle's report
/// and in the incident's record (what the webhook gets); a person's resume stands; the next
/// incident within the hour is held back by the cap (1 per hour), and the report says so with
/// the command.
#[test]
fn an_xid_79_drains_the_node_in_slurm_with_a_reason_once_within_the_cap() {
    if !privileged("an_xid_79_drains_the_node_in_slurm_with_a_reason_once_within_the_cap") {
        return;
    }
    let mut r = Rig::up(
        "drain",
        19487,
        &format!("{SLURM_DRAIN}drain_max_per_hour = 1\n"),
    );
    // Xid 13 (NVIDIA: possibly the application), then a dump on demand: no drain.
    kmsg("NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 0): Out Of Range Address");
    std::thread::sleep(Duration::from_millis(500));
    r.a().ctl(&["dump", "--job", &r.id]);
    let md = r.newest_report(1);
    assert!(
        md.contains("not_needed: no drain: the verdict is POSSIBLY THE MACHINE"),
        "{md}"
    );
    assert!(
        !r.state().contains("DRAIN"),
        "drained on an Xid 13: {}",
        r.state()
    );
    // Xid 79 written into /dev/kmsg from user space: it fires no dump by default (a
    // node-wide trigger rests on the kernel's records); a dump on demand shows it: the
    // verdict reads it, the drain does not act on it, and says why.
    kmsg("NVRM: Xid (PCI:0000:3b:00): 79, pid=4241, name=python3, GPU has fallen off the bus.");
    r.a().wait_line(
        "the node-wide trigger refused",
        Duration::from_secs(15),
        |l| l.contains("node-wide trigger not acted on"),
    );
    r.a().ctl(&["dump", "--job", &r.id]);
    let md = r.newest_report(2);
    // The dump checked who wrote it (`accounting.kernel_writers`): the verdict is POSSIBLY,
    // says so, and the drain does not act on a POSSIBLY.
    assert!(
        md.contains("**POSSIBLY THE MACHINE (GPU), on a kernel log line not the kernel's only: ")
            && md.contains("from user space (facility 1), not by the kernel")
            && md.contains("not_needed: no drain: the verdict is POSSIBLY THE MACHINE (GPU)"),
        "{md}"
    );
    assert!(
        !r.state().contains("DRAIN"),
        "drained on a user-written line: {}",
        r.state()
    );
    r.metrics_with(&["nantrace_drains_total{result=\"not_needed\"} 2"]);
    // This suite injects faults that way: let root's lines drain, as a test cluster would.
    r.restart_with(&format!(
        "{SLURM_DRAIN}drain_max_per_hour = 1\ntrust_user_written_kmsg = true\n"
    ));
    // The cap counts per clock hour: keep the two Xid 79s in one hour.
    let into_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 3600;
    if into_hour > 3480 {
        std::thread::sleep(Duration::from_secs(3601 - into_hour));
    }
    let have = r.bundles();
    // Xid 79: drained, with nantrace's reason.
    kmsg("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.");
    let md = r.newest_report(have + 1);
    assert!(
        md.contains(&format!("drained: drained {} in Slurm", r.host)),
        "{md}"
    );
    let st = r.state();
    assert!(st.contains("DRAIN"), "the node is {st}");
    let reasons = run(Command::new("sinfo")
        .args(["-R", "-h", "-o", "%n|%E"])
        .env("SLURM_CONF", &r.slurm().conf));
    eprintln!("sinfo -R: {reasons}");
    let line = reasons
        .lines()
        .find(|l| l.starts_with(&format!("{}|", r.host)))
        .unwrap_or_else(|| panic!("{} not in sinfo -R: {reasons}", r.host));
    assert!(
        line.contains("nantrace: GPU Xid 79 (GPU has fallen off the bus) on 0000:3b:00.0 "),
        "{line}"
    );
    let inc = r.a().ctl(&["incidents"]);
    let rec = inc["incidents"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|r| r["trigger"] == "xid")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        rec["drain"]["action"], "drained",
        "the incident's record (the webhook's body): {rec}"
    );
    // A person resumes the node: it stays resumed; the next incident this hour is held back.
    r.slurm()
        .scontrol(&["update", &format!("NodeName={}", r.host), "State=RESUME"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !r.state().contains("DRAIN"),
        "re-drained after a resume: {}",
        r.state()
    );
    kmsg("NVRM: Xid (PCI:0000:5e:00): 79, pid=4242, name=python3, GPU has fallen off the bus.");
    let md = r.newest_report(have + 2);
    assert!(
        md.contains("held_by_cap: drain held back: 1 drain(s) this hour already on this node")
            && md.contains("scontrol update NodeName="),
        "{md}"
    );
    assert!(
        !r.state().contains("DRAIN"),
        "drained past the cap: {}",
        r.state()
    );
    // Counted since the restart.
    r.metrics_with(&[
        "nantrace_drains_total{result=\"held_by_cap\"} 1",
        "nantrace_drains_total{result=\"drained\"} 1",
    ]);
}
/// A forged record's name and how to know it in the kernel log.
type Forged<'a> = &'a dyn Fn(&str) -> bool;

/// The records `/dev/kmsg` holds after sequence number `after`: (seq, facility, text with the
/// kernel's escapes undone).
fn kernel_records_after(after: u64) -> Vec<(u64, u32, String)> {
    let mut out = Vec::new();
    nantrace::klog::each_record(|rec| {
        if let Some(r) = nantrace::klog::parse_record(rec) {
            if r.seq > after {
                out.push((r.seq, r.facility, nantrace::klog::unescape(r.text)));
            }
        }
    })
    .expect("read /dev/kmsg");
    out
}

/// Issue 31's floor (redteam4 D-1, D-2, D-14; redteam3 D-1): forged kernel records of every
/// kind, each made by an unprivileged user (nobody) while another user's GPU job runs under
/// the real Slurm and the agent may drain (`drain = "slurm"`). Each forged record is first
/// found in the kernel log as the kernel's own (facility 0, read as root in /dev/kmsg), else
/// the test fails: it would prove nothing. The kinds: network devices renamed in the user's
/// own user+network namespace (`mce_notify_irq: renamed from fatal`, `mlx5_0: renamed from
/// failed`), a tmpfs mount option holding a newline and an Xid 79 line, a program whose file
/// name holds a newline and an Xid 79 line that segfaults, a process named `EDAC 0: UE` that
/// makes the kernel print its name first (a misaligned vsyscall, or its segfault where
/// vsyscalls are off). Then the job is dumped: not PROBABLY THE MACHINE, no drain, the node
/// not DRAIN, no Xid or GPU counted. Last, an Xid 79 written into /dev/kmsg from user space (as
/// journald's `ForwardToKMsg` relays a user's text; root writes it here): the verdict reads
/// it, but the node is not drained and the GPU is not counted in the history, each with why.
#[test]
fn forged_kernel_records_of_every_kind_never_drain_nor_count_against_a_gpu() {
    if !privileged("forged_kernel_records_of_every_kind_never_drain_nor_count_against_a_gpu") {
        return;
    }
    let r = Rig::up(
        "forge",
        19491,
        &format!("{SLURM_DRAIN}drain_max_per_hour = 5\n"),
    );
    let base = r.base.clone();
    // The forgers' tools, readable by nobody.
    let tools = base.join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    std::fs::set_permissions(&tools, std::fs::Permissions::from_mode(0o755)).unwrap();
    let xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.";
    // A mount option ends at a comma.
    let mnt_xid = "NVRM: Xid (PCI:0000:3b:00): 79 GPU has fallen off the bus.";
    let segv_src = tools.join("segv.c");
    std::fs::write(&segv_src, "int main(void) { return *(volatile int *)0; }\n").unwrap();
    let segv = tools.join(format!("x\n{xid}\n"));
    let vs_src = tools.join("vs.c");
    std::fs::write(
        &vs_src,
        "#include <sys/prctl.h>\nint main(int c, char **v) { (void)c; prctl(PR_SET_NAME, v[1]); return ((long (*)(void))0xffffffffff600001UL)(); }\n",
    )
    .unwrap();
    let vs = tools.join("vs");
    common::gcc(&segv_src, &segv, &[]);
    common::gcc(&vs_src, &vs, &[]);
    let mnt = tools.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    common::chown_nobody(&mnt);
    // Segfault reports are printed only with debug.exception-trace on (the default).
    let trace = std::fs::read_to_string("/proc/sys/debug/exception-trace").unwrap_or_default();
    let _ = std::fs::write("/proc/sys/debug/exception-trace", "1");
    let start = kernel_records_after(0).last().map_or(0, |r| r.0);
    let nobody = || {
        let mut c = Command::new("setpriv");
        c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"]);
        c
    };
    let n = std::process::id() % 10_000;
    let o = nobody()
        .args(["unshare", "-Urn", "sh", "-c"])
        .arg(format!(
            "ip link add fatal type veth peer name ntfp{n} && ip link set fatal name mce_notify_irq && \
             ip link add failed type veth peer name ntfq{n} && ip link set failed name mlx5_0"
        ))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "renames in a user namespace (unprivileged user namespaces on?): {o:?}"
    );
    let o = nobody()
        .args(["unshare", "-Urm", "sh", "-c"])
        .arg("mount -t tmpfs -o \"$(printf 'x\\n%s' \"$1\")\" none \"$2\" 2>/dev/null; true")
        .args(["sh", mnt_xid])
        .arg(&mnt)
        .env("LIBMOUNT_FORCE_MOUNT2", "always")
        .output()
        .unwrap();
    assert!(o.status.success(), "tmpfs in a user namespace: {o:?}");
    assert!(
        !nobody().arg(&segv).status().unwrap().success(),
        "the file-name forger did not fault"
    );
    assert!(
        !nobody()
            .arg(&vs)
            .arg("EDAC 0: UE")
            .status()
            .unwrap()
            .success(),
        "the vsyscall forger did not fault"
    );
    // Each forged record, as the kernel wrote it.
    let wanted: [(&str, Forged); 5] = [
        ("a device renamed mce_notify_irq", &|t| {
            t.starts_with("mce_notify_irq: renamed from fatal")
        }),
        ("a device renamed mlx5_0", &|t| {
            t.starts_with("mlx5_0: renamed from failed")
        }),
        ("the mount option", &|t| {
            t.starts_with("tmpfs: Unknown parameter 'x\n") && t.contains(mnt_xid)
        }),
        ("the file name in a segfault", &|t| {
            t.contains("segfault") && t.contains("GPU has fallen off the bus")
        }),
        ("the process name first", &|t| t.starts_with("EDAC 0: UE[")),
    ];
    let t0 = Instant::now();
    let missing = loop {
        let recs = kernel_records_after(start);
        let missing: Vec<&str> = wanted
            .iter()
            .filter(|(_, f)| !recs.iter().any(|(_, fac, t)| *fac == 0 && f(t)))
            .map(|(w, _)| *w)
            .collect();
        if missing.is_empty() || t0.elapsed() > Duration::from_secs(10) {
            break missing;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = std::fs::write("/proc/sys/debug/exception-trace", trace.trim());
    assert!(
        missing.is_empty(),
        "forged records that never reached the kernel log (the test proves nothing without them): {missing:?}; records: {:?}",
        kernel_records_after(start)
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        r.a().wait_bundles(0, Duration::ZERO).is_empty(),
        "a forged record triggered a dump: {:?}",
        r.a().wait_bundles(0, Duration::ZERO)
    );
    r.a().ctl(&["dump", "--job", &r.id]);
    let md = r.newest_report(1);
    assert!(
        !md.contains("**PROBABLY THE MACHINE") && !md.contains("**POSSIBLY THE MACHINE"),
        "a forgery became machine evidence: {md}"
    );
    assert!(md.contains("not_needed: no drain:"), "{md}");
    assert!(!md.contains("History of this node's GPUs"), "{md}");
    let m = r.a().metrics_text();
    assert!(!m.contains("nantrace_xid_total{"), "{m}");
    assert!(!m.contains("nantrace_gpu_incidents_7d{"), "{m}");
    assert!(
        !r.state().contains("DRAIN"),
        "drained on a forgery: {}",
        r.state()
    );
    let h = r.a().ctl(&["history"]).to_string();
    assert!(!h.contains("0000:3b:00"), "a GPU in the history: {h}");

    // A relay's line: it fires no dump (a node-wide trigger needs the kernel's record); a
    // dump on demand shows the verdict reading it; nothing acts on it.
    kmsg("NVRM: Xid (PCI:0000:3b:00): 79, pid=4240, name=relay, GPU has fallen off the bus.");
    r.a().wait_line(
        "the node-wide trigger refused",
        Duration::from_secs(15),
        |l| l.contains("node-wide trigger not acted on") && l.contains("relay"),
    );
    r.a().ctl(&["dump", "--job", &r.id]);
    let md = r.newest_report(2);
    // The dump checked who wrote the line: words anyone could write, at most POSSIBLY, the
    // writer said (before: PROBABLY THE MACHINE, only the drain knew better).
    assert!(
        md.contains("POSSIBLY THE MACHINE (GPU), on a kernel log line not the kernel's only: ")
            && md.contains("from user space (facility 1), not by the kernel"),
        "{md}"
    );
    assert!(!md.contains("**PROBABLY THE MACHINE"), "{md}");
    assert!(!md.contains("History of this node's GPUs"), "no GPU implicated: {md}");
    assert!(
        md.contains("not_needed: no drain: the verdict is POSSIBLY THE MACHINE (GPU), on a kernel log line not the kernel's only"),
        "{md}"
    );
    let m = r.metrics_with(&["nantrace_drains_total{result=\"not_needed\"} 2"]);
    assert!(!m.contains("nantrace_drains_total{result=\"unverified\"}"), "{m}");
    assert!(
        !m.contains("nantrace_gpu_incidents_7d{gpu=\"0000:3b:00.0\"} 1"),
        "{m}"
    );
    assert!(
        !m.contains("nantrace_drains_total{result=\"drained\"}"),
        "{m}"
    );
    assert!(
        !r.state().contains("DRAIN"),
        "drained on a relayed line: {}",
        r.state()
    );
    let h = r.a().ctl(&["history"]).to_string();
    assert!(!h.contains("0000:3b:00"), "a GPU in the history: {h}");
}
