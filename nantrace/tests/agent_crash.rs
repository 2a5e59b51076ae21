//! The agent against the third adversarial test's crash, full-disk and control cases
//! (`../shared/redteam3/DEFECTS.md` D-8, D-10, D-11, D-12, D-13). Root, single-threaded.
mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::agent::{kill_job, start_job, Agent};
use common::{bundles, privileged, sh, sh_ok, BIN};

/// Entries of `dir` whose name starts with `prefix`.
fn named(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Poll (every millisecond) for a dump's temporary directory in `dir`.
fn wait_tmp(dir: &Path, timeout: Duration) -> Option<PathBuf> {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if let Some(p) = named(dir, ".nantrace-")
            .into_iter()
            .find(|p| p.to_string_lossy().contains(".tmp-"))
        {
            return Some(p);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// `nantrace report` on a bundle directory: (success, stdout + stderr).
fn report(b: &Path) -> (bool, String) {
    let o = Command::new(BIN).arg("report").arg(b).output().unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// D-8: the agent killed with SIGKILL while it writes a bundle (as the OOM killer ends it
/// under the unit's MemoryMax) leaves a hidden temporary directory. The next agent keeps it
/// as `...-incomplete`, says so, counts it in the spool (bundles, bytes, the incomplete
/// gauge) so it is evicted like any other, and `report` reads it as far as it goes. The same
/// for `nantrace run` in its `--out`.
#[test]
fn a_dump_cut_short_by_sigkill_is_kept_as_an_incomplete_bundle_and_counted() {
    if !privileged("a_dump_cut_short_by_sigkill_is_kept_as_an_incomplete_bundle_and_counted") {
        return;
    }
    let a = Agent::start("crash", 19491, &["--match", "nt-k9-job"]);
    // Many lines before the NaN: the dump takes long enough to be caught in the middle.
    let (mut j, _) = start_job(&a.dir, "nt-k9-job", "sleep 1; seq -f 'step %g | loss 0.51 | lr 3e-4 | tokens 4096' 1 300000; echo 'step 300001 | loss nan'; sleep 60");
    a.wait_job(j.id(), Duration::from_secs(10));
    let tmp = wait_tmp(&a.spool, Duration::from_secs(60))
        .expect("the agent never started writing a bundle");
    // Killed in the middle of its timeline.json (the longest file, written last).
    let t0 = Instant::now();
    while std::fs::metadata(tmp.join("timeline.json")).map_or(0, |m| m.len()) < 200_000 {
        assert!(
            tmp.exists(),
            "the dump finished before it could be killed in the middle"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "timeline.json never grew"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: signalling the test's own child.
    unsafe { libc::kill(a.child.id() as i32, libc::SIGKILL) };
    // The job goes too: the next agent would find it again and dump its NaN anew.
    kill_job(&mut j);
    let a = a.crash_and_restart();
    assert!(
        bundles(&a.spool).is_empty()
            || bundles(&a.spool)
                .iter()
                .all(|b| b.to_string_lossy().contains("-incomplete")),
        "the dump finished before the kill: {:?}",
        bundles(&a.spool)
    );
    let said = a.wait_line("the incomplete bundle said", Duration::from_secs(5), |l| {
        l.contains("as an incomplete bundle")
    });
    assert!(said.contains("died before it finished"), "{said}");
    assert!(
        !tmp.exists()
            && named(&a.spool, ".nantrace-")
                .iter()
                .all(|p| !p.to_string_lossy().contains(".tmp-")),
        "a dead writer's directory is still hidden: {:?}",
        named(&a.spool, ".nantrace-")
    );
    let kept = bundles(&a.spool);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(
        kept[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .ends_with("-incomplete"),
        "{kept:?}"
    );
    let note = std::fs::read_to_string(kept[0].join("INCOMPLETE.txt")).unwrap();
    assert!(note.contains("stopped before it finished"), "{note}");
    let status = a.ctl(&["status"]);
    let usage = &status["spool"]["usage"];
    assert_eq!(usage["incomplete"], 1, "{status}");
    assert_eq!(
        usage["bundles"], 1,
        "the incomplete bundle is a bundle of the spool (counted, evicted): {status}"
    );
    let m = a.wait_metrics(Duration::from_secs(5), |m| {
        m.contains("nantrace_spool_incomplete_bundles 1")
    });
    assert!(m.contains("nantrace_spool_incomplete_bundles 1"), "{m}");
    assert!(
        !m.contains("nantrace_spool_bytes 0\n"),
        "its bytes are counted: {m}"
    );
    // Read as far as it goes: the head and the events before the cut, and said.
    let (ok, out) = report(&kept[0]);
    assert!(
        ok && out.contains("INCOMPLETE BUNDLE")
            && out.contains("its writer stopped before it finished"),
        "report on an incomplete bundle: {out}"
    );
    let md = out
        .lines()
        .find(|l| l.contains("timeline.json ends"))
        .unwrap_or_default()
        .to_string();
    assert!(md.contains("event(s)"), "{out}");
    eprintln!("report of the incomplete bundle:\n{out}");
    // Without its timeline (killed earlier): a clear error that says what the bundle is.
    std::fs::remove_file(kept[0].join("timeline.json")).unwrap();
    let (ok, out) = report(&kept[0]);
    assert!(
        !ok && out.contains("this bundle is incomplete and has no timeline"),
        "{out}"
    );
    a.stop();

    // `nantrace run`, killed while it writes its bundle: the next run in that --out keeps it.
    let out = std::env::temp_dir().join(format!("nt-crash-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut run = Command::new(BIN)
        .args([
            "run",
            "--no-probes",
            "--post",
            "0.2",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "seq -f 'step %g loss 0.5' 1 300000; echo 'step 300001 loss nan'; sleep 30",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let tmp = wait_tmp(&out, Duration::from_secs(60)).expect("run never started writing a bundle");
    let _ = run.kill();
    let _ = run.wait();
    sh("pkill -KILL -f 'step 300001 loss nan'");
    let o = Command::new(BIN)
        .args([
            "run",
            "--no-probes",
            "--post",
            "0",
            "--out",
            out.to_str().unwrap(),
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("as an incomplete bundle"), "{err}");
    assert!(!tmp.exists(), "run left the dead writer's directory hidden");
    assert!(
        named(&out, "nantrace-")
            .iter()
            .any(|p| p.to_string_lossy().ends_with("-incomplete")),
        "{:?}",
        named(&out, "")
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// A filled-in bundle of another incident, `bytes` big, `age_s` old, for the spool.
fn old_bundle(spool: &Path, name: &str, bytes: usize, age_s: u64) {
    let b = spool.join(name);
    std::fs::create_dir(&b).unwrap();
    std::fs::write(
        b.join("timeline.json"),
        format!("{{\n  \"job\": {{ \"uid\": 0 }},\n{}", " ".repeat(bytes)),
    )
    .unwrap();
    std::fs::File::open(&b)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(age_s))
        .unwrap();
}

/// D-12: a spool on a full disk. With nothing to evict the incident is a counted failure and
/// no empty directory passes for a bundle; with older bundles there, they make room (the
/// oldest first) and the bundle is written whole.
#[test]
fn a_full_disk_makes_room_from_older_bundles_and_never_leaves_an_empty_bundle() {
    if !privileged("a_full_disk_makes_room_from_older_bundles_and_never_leaves_an_empty_bundle") {
        return;
    }
    let a = Agent::start_prepared("full", 19492, &["--match", "nt-full-job"], &[], |d| {
        std::fs::create_dir(d.join("spool")).unwrap();
        sh_ok(&format!(
            "mount -t tmpfs -o size=4m,mode=0700 nt-full {}",
            d.join("spool").display()
        ));
    });
    let spool = a.spool.clone();
    let umount = |spool: &Path| {
        let _ = sh(&format!("umount -l {}", spool.display()));
    };
    // Full to the last block, and nothing of nantrace's to remove.
    sh(&format!(
        "dd if=/dev/zero of={}/filler bs=64k 2>/dev/null",
        spool.display()
    ));
    let (mut j1, _) = start_job(
        &a.dir,
        "nt-full-job",
        "sleep 1; seq -f 'step %g | loss 0.5' 1 300; echo 'step 301 | loss nan'; sleep 60",
    );
    a.wait_job(j1.id(), Duration::from_secs(10));
    let l = a.wait_line("the failed bundle said", Duration::from_secs(40), |l| {
        l.contains("could not write the bundle")
    });
    assert!(
        l.contains("No space left") || l.contains("no file of the bundle"),
        "{l}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        bundles(&spool).is_empty(),
        "an empty or failed directory passes for a bundle: {:?}",
        bundles(&spool)
    );
    assert!(
        named(&spool, ".nantrace-").is_empty(),
        "a failed dump left its directory: {:?}",
        named(&spool, ".nantrace-")
    );
    let m = a.wait_metrics(Duration::from_secs(5), |m| {
        m.contains("nantrace_incident_failures_total 1")
    });
    assert!(m.contains("nantrace_incident_failures_total 1"), "{m}");
    kill_job(&mut j1);

    // Older bundles fill the disk instead: they make room for the new one.
    std::fs::remove_file(spool.join("filler")).unwrap();
    for (i, age) in [(1, 3000), (2, 2000), (3, 1000)] {
        old_bundle(&spool, &format!("nantrace-old-{i}"), 1_200_000, age);
    }
    sh(&format!(
        "dd if=/dev/zero of={}/filler bs=64k 2>/dev/null",
        spool.display()
    ));
    let (mut j2, _) = start_job(
        &a.dir,
        "nt-full-job2",
        "sleep 1; seq -f 'step %g | loss 0.5' 1 300; echo 'step 301 | loss nan'; sleep 60",
    );
    let _ = &mut j2;
    // The agent matches nt-full-job as a pattern: nt-full-job2 is found by it too.
    a.wait_job(j2.id(), Duration::from_secs(10));
    let l = a.wait_line("room made", Duration::from_secs(40), |l| {
        l.contains("the disk was full: removed")
    });
    eprintln!("{l}");
    let b = a.wait_bundles(3, Duration::from_secs(20));
    let new: Vec<_> = b
        .iter()
        .filter(|p| !p.to_string_lossy().contains("nantrace-old-"))
        .collect();
    assert_eq!(new.len(), 1, "{b:?}");
    assert!(
        !new[0].to_string_lossy().ends_with("-incomplete"),
        "written again whole after the room was made: {new:?}"
    );
    assert!(new[0].join("timeline.json").is_file() && new[0].join("report.md").is_file());
    assert!(
        !spool.join("nantrace-old-1").exists(),
        "the oldest bundle goes first: {b:?}"
    );
    assert!(spool.join("nantrace-old-3").exists(), "{b:?}");
    let m = a.wait_metrics(Duration::from_secs(5), |m| {
        m.contains("nantrace_spool_removed_total 1") || m.contains("nantrace_spool_removed_total 2")
    });
    assert!(
        m.contains("nantrace_spool_removed_total 1")
            || m.contains("nantrace_spool_removed_total 2"),
        "{m}"
    );
    kill_job(&mut j2);
    let dir = a.dir.clone();
    drop(a);
    umount(&spool);
    let _ = std::fs::remove_dir_all(dir);
}

/// D-10 and D-11: `ctl dump --job ""` (an epilog's unset variable) dumps nothing; `ctl`
/// never talks to a socket served by another user, and the agent never puts its socket
/// where a user could swap the directory.
#[test]
fn the_control_socket_and_its_client_trust_no_user() {
    if !privileged("the_control_socket_and_its_client_trust_no_user") {
        return;
    }
    let a = Agent::start("ctltrust", 19493, &["--match", "nt-ctl-job"]);
    let (mut j, _) = start_job(
        &a.dir,
        "nt-ctl-job",
        "for i in $(seq 1 100); do echo \"step $i loss 0.5\"; sleep 0.2; done",
    );
    a.wait_job(j.id(), Duration::from_secs(10));
    let o = Command::new(BIN)
        .args([
            "ctl",
            "dump",
            "--job",
            "",
            "--socket",
            a.socket.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!o.status.success(), "ctl dump --job '' was accepted");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("job is empty"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        bundles(&a.spool).is_empty(),
        "an empty job dumped: {:?}",
        bundles(&a.spool)
    );
    kill_job(&mut j);
    a.stop();

    // A socket under a directory a user owns: the agent refuses it.
    let base = std::env::temp_dir().join(format!("nt-ctltrust-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(base.join("home")).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
    sh_ok(&format!("chown 65534:65534 {}/home", base.display()));
    let o = Command::new(BIN)
        .args(["agent", "--no-probes", "--metrics-addr", "", "--spool"])
        .arg(base.join("spool"))
        .arg("--socket")
        .arg(base.join("home/nt/agent.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("belongs to uid 65534"),
        "an agent put its socket in a user's directory: {err}"
    );
    assert!(
        !base.join("home/nt").exists(),
        "root created a directory in the user's"
    );

    // A server run by that user (here: the agent binary itself, as nobody): root's `ctl`
    // sends it nothing and prints nothing of its answer.
    std::fs::create_dir_all(base.join("home/spool")).unwrap();
    std::fs::create_dir_all(base.join("home/run")).unwrap();
    sh_ok(&format!(
        "chown 65534:65534 {0}/home/spool {0}/home/run && chmod 700 {0}/home/spool {0}/home/run",
        base.display()
    ));
    use std::os::unix::process::CommandExt as _;
    let sock = base.join("home/run/agent.sock");
    // The binary where that user can run it.
    let bin = base.join("nantrace");
    std::fs::copy(BIN, &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut fake = Command::new(&bin)
        .args(["agent", "--no-probes", "--metrics-addr", "", "--spool"])
        .arg(base.join("home/spool"))
        .arg("--socket")
        .arg(&sock)
        .uid(65534)
        .gid(65534)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !sock.exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let up = sock.exists();
    let o = Command::new(BIN)
        .args([
            "ctl",
            "report",
            "--last",
            "--socket",
            sock.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let _ = fake.kill();
    let fake_err = fake
        .wait_with_output()
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .unwrap_or_default();
    assert!(up, "the user's server did not start: {fake_err}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("served by uid 65534, not by root"),
        "ctl talked to a user's server: {err}"
    );
    let _ = std::fs::remove_dir_all(&base);
}

/// D-13: a job whose main thread has exited (pthread_exit: /proc/PID/cmdline reads empty)
/// while its other thread trains on is found, its output followed through that thread, and
/// its NaN dumped.
#[test]
fn a_job_whose_main_thread_exited_is_watched_and_its_nan_dumped() {
    if !privileged("a_job_whose_main_thread_exited_is_watched_and_its_nan_dumped") {
        return;
    }
    let a = Agent::start("zleader", 19494, &["--match", "nt-zleader"]);
    let src = a.dir.join("zleader.c");
    std::fs::write(&src, "#include <pthread.h>\n#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\nstatic void *w(void *a) { sleep(2); for (int i = 0; i < 4; i++) { printf(\"step %d loss 0.5\\n\", i); fflush(stdout); sleep(1); } printf(\"step 4 loss nan\\n\"); fflush(stdout); sleep(20); exit(3); }\nint main(void) { pthread_t t; pthread_create(&t, 0, w, 0); pthread_exit(0); }\n").unwrap();
    let exe = a.dir.join("nt-zleader");
    common::gcc(&src, &exe, &["-pthread"]);
    let (mut j, _) = start_job(&a.dir, "nt-zl-job", &format!("exec {}", exe.display()));
    std::thread::sleep(Duration::from_millis(500));
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", j.id())).unwrap_or_default();
    assert!(
        cmdline.is_empty(),
        "the main thread has not exited: the test does not test the case"
    );
    let (entry, _) = a.wait_job(j.id(), Duration::from_secs(10));
    assert!(
        entry["command"]
            .as_str()
            .unwrap_or("")
            .contains("nt-zleader"),
        "{entry}"
    );
    let b = a.wait_bundles(1, Duration::from_secs(30));
    assert_eq!(
        b.len(),
        1,
        "no bundle for the NaN of a job whose main thread exited"
    );
    let t = common::agent::timeline(&b[0]);
    assert_eq!(t["trigger"]["kind"], "nan", "{}", t["trigger"]);
    assert!(
        t["first_nan"]["line"]
            .as_str()
            .unwrap_or("")
            .contains("step 4 loss nan"),
        "{}",
        t["first_nan"]
    );
    kill_job(&mut j);
    a.stop();
}
