//! The agent against the adversarial review of its first version (one test per defect that
//! a job or a local user could cause). Root, single-threaded.
mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::agent::{kill_job, start_job, Agent};
use common::{bundles, privileged, sh, BIN};

fn job(dir: &std::path::Path, name: &str, body: &str) -> std::process::Child {
    start_job(dir, name, body).0
}

#[test]
fn without_probes_the_agent_keeps_running_on_log_evidence() {
    if !privileged("without_probes_the_agent_keeps_running_on_log_evidence") {
        return;
    }
    let a = Agent::start("noprobes", 19481, &["--no-probes", "--match", "nt-np-job"]);
    std::thread::sleep(Duration::from_secs(1));
    assert!(a.ctl(&["status"])["probes_error"]
        .as_str()
        .unwrap()
        .contains("--no-probes"));
    let mut j = job(&a.dir, "nt-np-job", "for i in 1 2 3; do echo \"step $i loss 1.$i\"; sleep 0.3; done; echo 'step 4 loss nan'; sleep 20");
    a.wait_job(j.id(), Duration::from_secs(10));
    let b = a.wait_bundles(1, Duration::from_secs(20));
    assert_eq!(b.len(), 1, "the NaN was not seen without probes");
    kill_job(&mut j);
    a.stop();
}

#[test]
fn one_users_many_jobs_do_not_hide_anothers_and_the_excess_is_said() {
    if !privileged("one_users_many_jobs_do_not_hide_anothers_and_the_excess_is_said") {
        return;
    }
    let cfgd = std::env::temp_dir().join(format!("nt-agent-limitcfg-{}", std::process::id()));
    std::fs::create_dir_all(&cfgd).unwrap();
    std::fs::write(
        cfgd.join("a.toml"),
        "match_commands = ['nt-lim-job']\nmax_jobs_per_user = 2\nscan_interval_ms = 200\n",
    )
    .unwrap();
    let a = Agent::start(
        "limit",
        19482,
        &["--config", cfgd.join("a.toml").to_str().unwrap()],
    );
    let jobs: Vec<_> = (0..3)
        .map(|i| job(&a.dir, &format!("nt-lim-job{i}"), "sleep 60"))
        .collect();
    a.wait_line("over the limit", Duration::from_secs(10), |l| {
        l.contains("is not watched") && l.contains("max_jobs_per_user 2")
    });
    let v = a.ctl(&["status"]);
    assert_eq!(
        (v["jobs"].as_u64(), v["jobs_not_watched"].as_u64()),
        (Some(2), Some(1)),
        "{v}"
    );
    assert!(a.metrics_text().contains("nantrace_jobs_not_watched 1"));
    for mut j in jobs {
        kill_job(&mut j);
    }
    let _ = std::fs::remove_dir_all(&cfgd);
    a.stop();
}

#[test]
fn a_sparse_file_in_the_logs_place_is_read_from_near_its_end() {
    if !privileged("a_sparse_file_in_the_logs_place_is_read_from_near_its_end") {
        return;
    }
    let a = Agent::start("sparse", 19483, &["--match", "nt-sparse-job"]);
    // The job's stdout is one file; it then puts a 1 TiB sparse file in the log's place
    // (another inode) and prints the NaN there.
    let log = a.dir.join("train.log");
    let mut j = {
        let script = a.dir.join("nt-sparse-job.sh");
        std::fs::write(&script, format!("#!/bin/bash\nexec >{l}\nfor i in 1 2 3; do echo \"step $i loss 1.$i\"; sleep 0.5; done\ntruncate -s 1T {l}.new && mv {l}.new {l}\necho 'step 4 loss nan' >>{l}\nsleep 30\n", l = log.display())).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        Command::new(&script).stdin(Stdio::null()).spawn().unwrap()
    };
    a.wait_job(j.id(), Duration::from_secs(10));
    let t0 = Instant::now();
    let b = a.wait_bundles(1, Duration::from_secs(30));
    assert_eq!(b.len(), 1, "the NaN after the sparse file was not seen");
    eprintln!(
        "NaN seen {:.1} s after the job was listed",
        t0.elapsed().as_secs_f64()
    );
    kill_job(&mut j);
    a.stop();
}

#[test]
fn a_fifo_in_the_logs_place_is_never_opened() {
    if !privileged("a_fifo_in_the_logs_place_is_never_opened") {
        return;
    }
    let a = Agent::start("fifo", 19484, &["--match", "nt-fifo-job"]);
    let log = a.dir.join("fifo.log");
    let mark = a.dir.join("writer-opened");
    let script = a.dir.join("nt-fifo-job.sh");
    // The job's stdout is a regular file first (the agent follows it), then the path becomes
    // a FIFO whose writer blocks until a real reader comes: the agent must not be that reader.
    // Then the FIFO goes and a regular file takes its place (often at the same inode number):
    // it is read (re-review D3).
    std::fs::write(&script, format!("#!/bin/bash\nexec >{l}\necho 'step 1 loss 1.0'\nsleep 2\nrm {l}; mkfifo {l}\n(exec 3>{l}; touch {m}; echo x >&3) &\nw=$!\nsleep 4\nkill $w; rm -f {l}; echo 'step 9 loss: nan' >{l}\nsleep 30\n", l = log.display(), m = mark.display())).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut j = Command::new(&script).stdin(Stdio::null()).spawn().unwrap();
    a.wait_job(j.id(), Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        !mark.exists(),
        "the agent opened the FIFO (its writer was woken)"
    );
    let b = a.wait_bundles(1, Duration::from_secs(20));
    assert_eq!(
        b.len(),
        1,
        "the regular file that replaced the FIFO was not read"
    );
    kill_job(&mut j);
    let _ = sh(&format!("pkill -f '{}'", log.display()));
    a.stop();
}

#[test]
fn a_spool_under_a_users_directory_is_refused_and_a_second_agent_leaves_the_socket_alone() {
    if !privileged(
        "a_spool_under_a_users_directory_is_refused_and_a_second_agent_leaves_the_socket_alone",
    ) {
        return;
    }
    let user_dir = std::env::temp_dir().join(format!("nt-agent-userdir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&user_dir);
    std::fs::create_dir_all(&user_dir).unwrap();
    common::sh_ok(&format!("chown 65534:65534 {}", user_dir.display()));
    let o = Command::new(BIN)
        .args(["agent", "--no-probes", "--metrics-addr", "", "--spool"])
        .arg(user_dir.join("spool"))
        .args(["--socket"])
        .arg(user_dir.join("s.sock"))
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "an agent started with its spool under a user's directory"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(user_dir.to_str().unwrap()),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !user_dir.join("spool").exists(),
        "the spool was created in the user's directory before the check"
    );
    // A user's link on the way (in a sticky directory): refused, and nothing made through it.
    let sticky = std::env::temp_dir().join(format!("nt-agent-sticky-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&sticky);
    std::fs::create_dir_all(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    common::sh_ok(&format!(
        "ln -s {} {}/lnk && chown -h 65534:65534 {}/lnk",
        user_dir.display(),
        sticky.display(),
        sticky.display()
    ));
    let o = Command::new(BIN)
        .args(["agent", "--no-probes", "--metrics-addr", "", "--spool"])
        .arg(sticky.join("lnk/sub/spool"))
        .args(["--socket"])
        .arg(sticky.join("s.sock"))
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "an agent started with its spool through a user's link"
    );
    assert!(
        !user_dir.join("sub").exists(),
        "root created a directory through the user's link"
    );
    let _ = std::fs::remove_dir_all(&sticky);
    let _ = std::fs::remove_dir_all(&user_dir);

    let a = Agent::start("second", 19485, &[]);
    let o = Command::new(BIN)
        .args([
            "agent",
            "--no-probes",
            "--metrics-addr",
            "127.0.0.1:19486",
            "--spool",
        ])
        .arg(&a.spool)
        .arg("--socket")
        .arg(&a.socket)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("another agent is running"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        a.ctl(&["status"])["probes_attached"].as_u64().is_some(),
        "the first agent's socket was taken"
    );
    // A scrape gets through while a crowd of idle connections is open (re-review D4: the
    // newest connection pushes out the oldest that sent no request).
    let idle: Vec<_> = (0..200)
        .filter_map(|_| std::net::TcpStream::connect(&a.metrics).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert!(a.metrics_text().contains("nantrace_probes_attached"));
    drop(idle);
    assert!(bundles(&a.spool).is_empty());
    a.stop();
}

/// D-4 of the third adversarial test (`jobs/fakekern.sh`): a job whose own output imitates the
/// kernel's lines (an Xid 79 with a dmesg stamp, a syslog `kernel:` prefix, a raw /dev/kmsg
/// record, an MCE) while the kernel log, watched, says nothing. The bundle's verdict is at
/// most POSSIBLY and says whose words they are; the machine-readable family in the metrics
/// says it too; nothing of it counts as a kernel Xid.
#[test]
fn a_jobs_imitation_of_kernel_lines_is_at_most_possibly_and_says_whose_words() {
    if !privileged("a_jobs_imitation_of_kernel_lines_is_at_most_possibly_and_says_whose_words") {
        return;
    }
    let a = Agent::start("fakekern", 19486, &["--match", "nt-fk-job"]);
    let body = r#"sleep 1.5
echo 'step 1 | loss 2.31'
echo '[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.'
echo 'kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error'
echo '<2>[ 99.1] mce: [Hardware Error]: Machine check events logged'
echo '6,1234,5678,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.'
echo 'RuntimeError: CUDA error: uncorrectable ECC error encountered' >&2
echo 'step 2 | loss nan'
sleep 20"#;
    let mut j = job(&a.dir, "nt-fk-job", body);
    a.wait_job(j.id(), Duration::from_secs(10));
    let b = a.wait_bundles(1, Duration::from_secs(30));
    let md = std::fs::read_to_string(b[0].join("report.md")).unwrap();
    let v = md.lines().find(|l| l.starts_with("**")).unwrap_or("");
    assert!(
        v.starts_with("**POSSIBLY THE MACHINE (GPU), in the job's own words only: "),
        "{md}"
    );
    assert!(
        v.contains("the kernel log, watched"),
        "the verdict says the kernel log was watched and silent: {v}"
    );
    let t = common::agent::timeline(&b[0]);
    let kernel: Vec<_> = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            matches!(e["source"].as_str(), Some("xid" | "aer" | "kmsg"))
                && e["text"]
                    .as_str()
                    .is_some_and(|x| x.contains("NVRM") || x.contains("mce:"))
        })
        .collect();
    assert!(
        kernel.is_empty(),
        "the job's words became kernel events: {kernel:?}"
    );
    let m = a.wait_metrics(Duration::from_secs(10), |m| {
        m.contains("nantrace_incidents_total{")
    });
    assert!(
        !m.contains("nantrace_xid_total{"),
        "a kernel Xid was counted from the job's words: {m}"
    );
    assert!(
        m.lines().any(|l| l.starts_with("nantrace_incidents_total{")
            && l.contains("family=\"GPU (job's words only)\"")),
        "{m}"
    );
    assert!(
        !m.lines()
            .any(|l| l.starts_with("nantrace_incidents_total{") && l.contains("family=\"GPU\"")),
        "{m}"
    );
    kill_job(&mut j);
    a.stop();
}

/// D-5 of the third adversarial test (`jobs/mntns.sh`): a job in its own mount namespace (as
/// a rootless container is) writes its log to a path that, on the host, is another file: a
/// decoy with NaN lines. The agent reads the job's own file, through `/proc/PID/root`, and
/// the NaN it reports is the job's, never the decoy's.
#[test]
fn a_job_in_its_own_mount_namespace_is_read_in_its_own_view() {
    if !privileged("a_job_in_its_own_mount_namespace_is_read_in_its_own_view") {
        return;
    }
    // Matched only once it runs inside the namespace, its output already there.
    let a = Agent::start("mntns", 19489, &["--match", "nt-inner-train"]);
    let d = a.dir.join("nt-mnt-d");
    std::fs::create_dir_all(&d).unwrap();
    let decoy = d.join("out.log");
    std::fs::write(&decoy, "host-side decoy: step 1 loss nan\n").unwrap();
    let inner = a.dir.join("nt-inner-train.sh");
    std::fs::write(&inner, "for i in $(seq 1 40); do echo \"step $i loss 0.7\"; sleep 0.1; done; echo 'step 41 loss nan'; sleep 20\n").unwrap();
    let body = format!(
        "exec unshare -m sh -c \"mount -t tmpfs t {d} && exec sh {inner} > {d}/out.log 2>&1\"",
        d = d.display(),
        inner = inner.display()
    );
    let mut j = job(&a.dir, "nt-mnt-job", &body);
    a.wait_job(j.id(), Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(1));
    {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&decoy)
            .unwrap();
        writeln!(f, "host-side decoy: step 2 loss nan").unwrap();
    }
    let jobs = a.ctl(&["jobs"]);
    let logs = jobs["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["root"] == j.id())
        .map(|x| x["logs"].to_string())
        .unwrap_or_default();
    assert!(
        logs.contains("/root/") && logs.contains("nt-mnt-d/out.log"),
        "the job's own view of its log: {jobs}"
    );
    let b = a.wait_bundles(1, Duration::from_secs(20));
    assert_eq!(b.len(), 1, "{b:?}");
    let t = common::agent::timeline(&b[0]);
    let line = t["first_nan"]["line"].as_str().unwrap_or("");
    assert!(
        line.contains("step 41 loss nan"),
        "the NaN is the job's own line, not the decoy's: {}",
        t["first_nan"]
    );
    let app = std::fs::read_to_string(b[0].join("app.log")).unwrap_or_default();
    assert!(
        !app.contains("host-side decoy"),
        "the decoy was read: {app}"
    );
    kill_job(&mut j);
    a.stop();
}

/// D-2 of the third adversarial test (`jobs/podspoof_*.sh`): on a systemd node a user's
/// `user@UID.service` cgroup subtree is delegated to them, and they can name a directory
/// there `kubepods-pod<victim's uid>.slice` and move into it. That is never the pod: a pod is
/// only a `pod<uid>` directory under the kubelet's own roots. Seen through a /proc-shaped
/// directory (no kubelet here) whose cgroup files are those paths, with real processes: the
/// victim's job is the pod, the attacker's process is a job of its own (by its command line),
/// with none of the pod's identity.
#[test]
fn a_pod_uid_in_a_users_delegated_cgroup_is_not_the_pod() {
    if !privileged("a_pod_uid_in_a_users_delegated_cgroup_is_not_the_pod") {
        return;
    }
    use std::os::unix::process::CommandExt as _;
    let root = std::env::temp_dir().join(format!("nt-podspoof-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).unwrap();
    let uid = "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718";
    let u = uid.replace('-', "_");
    let mut victim = Command::new("sleep").arg("60").spawn().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut attacker = Command::new("sleep")
        .arg("61")
        .uid(65534)
        .gid(65534)
        .spawn()
        .unwrap();
    for (pid, cgroup, environ) in [
        (victim.id(), format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n"), "POD_NAMESPACE=ml\0POD_NAME=trainer-0\0"),
        (attacker.id(), format!("0::/user.slice/user-65534.slice/user@65534.service/kubepods-pod{u}.slice/cri-containerd-fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210.scope\n"), "POD_NAMESPACE=kube-system\0POD_NAME=etcd-control-plane\0"),
    ] {
        let p = proc_dir.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        for f in ["stat", "cmdline", "status", "fd"] {
            std::os::unix::fs::symlink(format!("/proc/{pid}/{f}"), p.join(f)).unwrap();
        }
        std::fs::write(p.join("cgroup"), cgroup).unwrap();
        std::fs::write(p.join("environ"), environ).unwrap();
    }
    let a = Agent::start(
        "podspoof",
        19490,
        &[
            "--match",
            "^sleep 6[01]$",
            "--proc-root",
            proc_dir.to_str().unwrap(),
        ],
    );
    let (v, _) = a.wait_job(victim.id(), Duration::from_secs(10));
    let (x, _) = a.wait_job(attacker.id(), Duration::from_secs(10));
    assert_eq!(v["key"], format!("pod-{uid}"), "{v}");
    assert_eq!(
        (
            v["identity"]["namespace"].as_str(),
            v["identity"]["pod"].as_str()
        ),
        (Some("ml"), Some("trainer-0")),
        "{v}"
    );
    assert_eq!(
        x["key"],
        format!("pid-{}", attacker.id()),
        "the attacker is not the pod: {x}"
    );
    assert_ne!(x["identity"]["kind"], "kubernetes", "{x}");
    assert!(!x.to_string().contains("etcd-control-plane"), "{x}");
    for c in [&mut victim, &mut attacker] {
        let _ = c.kill();
        let _ = c.wait();
    }
    a.stop();
    let _ = std::fs::remove_dir_all(&root);
}
