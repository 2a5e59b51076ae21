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
    assert!(a.ctl(&["status"])["probes_error"].as_str().unwrap().contains("--no-probes"));
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
    std::fs::write(cfgd.join("a.toml"), "match_commands = ['nt-lim-job']\nmax_jobs_per_user = 2\nscan_interval_ms = 200\n").unwrap();
    let a = Agent::start("limit", 19482, &["--config", cfgd.join("a.toml").to_str().unwrap()]);
    let jobs: Vec<_> = (0..3).map(|i| job(&a.dir, &format!("nt-lim-job{i}"), "sleep 60")).collect();
    a.wait_line("over the limit", Duration::from_secs(10), |l| l.contains("is not watched") && l.contains("max_jobs_per_user 2"));
    let v = a.ctl(&["status"]);
    assert_eq!((v["jobs"].as_u64(), v["jobs_not_watched"].as_u64()), (Some(2), Some(1)), "{v}");
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
    eprintln!("NaN seen {:.1} s after the job was listed", t0.elapsed().as_secs_f64());
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
    assert!(!mark.exists(), "the agent opened the FIFO (its writer was woken)");
    let b = a.wait_bundles(1, Duration::from_secs(20));
    assert_eq!(b.len(), 1, "the regular file that replaced the FIFO was not read");
    kill_job(&mut j);
    let _ = sh(&format!("pkill -f '{}'", log.display()));
    a.stop();
}

#[test]
fn a_spool_under_a_users_directory_is_refused_and_a_second_agent_leaves_the_socket_alone() {
    if !privileged("a_spool_under_a_users_directory_is_refused_and_a_second_agent_leaves_the_socket_alone") {
        return;
    }
    let user_dir = std::env::temp_dir().join(format!("nt-agent-userdir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&user_dir);
    std::fs::create_dir_all(&user_dir).unwrap();
    common::sh_ok(&format!("chown 65534:65534 {}", user_dir.display()));
    let o = Command::new(BIN).args(["agent", "--no-probes", "--metrics-addr", "", "--spool"]).arg(user_dir.join("spool")).args(["--socket"]).arg(user_dir.join("s.sock")).output().unwrap();
    assert!(!o.status.success(), "an agent started with its spool under a user's directory");
    assert!(String::from_utf8_lossy(&o.stderr).contains(user_dir.to_str().unwrap()), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!user_dir.join("spool").exists(), "the spool was created in the user's directory before the check");
    // A user's link on the way (in a sticky directory): refused, and nothing made through it.
    let sticky = std::env::temp_dir().join(format!("nt-agent-sticky-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&sticky);
    std::fs::create_dir_all(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    common::sh_ok(&format!("ln -s {} {}/lnk && chown -h 65534:65534 {}/lnk", user_dir.display(), sticky.display(), sticky.display()));
    let o = Command::new(BIN).args(["agent", "--no-probes", "--metrics-addr", "", "--spool"]).arg(sticky.join("lnk/sub/spool")).args(["--socket"]).arg(sticky.join("s.sock")).output().unwrap();
    assert!(!o.status.success(), "an agent started with its spool through a user's link");
    assert!(!user_dir.join("sub").exists(), "root created a directory through the user's link");
    let _ = std::fs::remove_dir_all(&sticky);
    let _ = std::fs::remove_dir_all(&user_dir);

    let a = Agent::start("second", 19485, &[]);
    let o = Command::new(BIN).args(["agent", "--no-probes", "--metrics-addr", "127.0.0.1:19486", "--spool"]).arg(&a.spool).arg("--socket").arg(&a.socket).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("another agent is running"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(a.ctl(&["status"])["probes_attached"].as_u64().is_some(), "the first agent's socket was taken");
    // A scrape gets through while a crowd of idle connections is open (re-review D4: the
    // newest connection pushes out the oldest that sent no request).
    let idle: Vec<_> = (0..200).filter_map(|_| std::net::TcpStream::connect(&a.metrics).ok()).collect();
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
    assert!(v.starts_with("**POSSIBLY THE MACHINE (GPU), in the job's own words only: "), "{md}");
    assert!(v.contains("the kernel log, watched"), "the verdict says the kernel log was watched and silent: {v}");
    let t = common::agent::timeline(&b[0]);
    let kernel: Vec<_> = t["events"].as_array().unwrap().iter().filter(|e| matches!(e["source"].as_str(), Some("xid" | "aer" | "kmsg")) && e["text"].as_str().is_some_and(|x| x.contains("NVRM") || x.contains("mce:"))).collect();
    assert!(kernel.is_empty(), "the job's words became kernel events: {kernel:?}");
    let m = a.metrics_text();
    assert!(!m.contains("nantrace_xid_total{"), "a kernel Xid was counted from the job's words: {m}");
    assert!(m.lines().any(|l| l.starts_with("nantrace_incidents_total{") && l.contains("family=\"GPU (job's words only)\"")), "{m}");
    assert!(!m.lines().any(|l| l.starts_with("nantrace_incidents_total{") && l.contains("family=\"GPU\"")), "{m}");
    kill_job(&mut j);
    a.stop();
}
