//! The hostile test suite: one test per case of the adversarial report
//! (`shared/redteam/REPORT.md`, 2026-11-30) that the security work fixed, grouped by area.
//! Each test names its case numbers. Root is needed (uid switches, mounts, other users' files);
//! run single-threaded: `cargo test -p nantrace --test hostile -- --test-threads=1`.
//! Marker strings are unique (`HOSTILE-...`) so that other tests watching logs are not confused.
mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bundles, make_bundle, nantrace, privileged, sh, sh_ok, text, Scratch, BIN};

/// A scratch directory, removed on drop (0755 so that uid 65534 can enter it).
fn chown_nobody(p: &Path) {
    sh_ok(&format!("chown -h 65534:65534 '{}'", p.display()));
}

// ---------------------------------------------------------------------------------------------
// Privilege of the job (4.12)
// ---------------------------------------------------------------------------------------------

#[test]
fn r4_12_sudo_caller_runs_the_job_not_root() {
    if !privileged("r4_12_sudo_caller_runs_the_job_not_root") {
        return;
    }
    let d = Scratch::new("sudo");
    let out = d.join("o");
    let o = nantrace(&["run", "--no-probes", "--out", out.to_str().unwrap(), "--", "id", "-u"], &[("SUDO_UID", "65534"), ("SUDO_GID", "65534"), ("SUDO_USER", "nobody")]);
    let (so, se) = text(&o);
    assert_eq!(so.trim(), "65534", "{se}");
    // Groups, HOME/USER, and no way to read root's files.
    let o = nantrace(&["run", "--no-probes", "--out", out.to_str().unwrap(), "--", "sh", "-c", "id -g; id -G; echo $USER $LOGNAME; head -1 /etc/shadow && echo HOSTILE-READ-SHADOW"], &[("SUDO_UID", "65534"), ("SUDO_GID", "65534"), ("HOME", "/root"), ("USER", "root")]);
    let (so, _) = text(&o);
    let lines: Vec<&str> = so.lines().collect();
    assert_eq!(lines[0], "65534");
    assert!(!lines[1].split(' ').any(|g| g == "0"), "no root group: {so}");
    assert_eq!(lines[2], "nobody nobody");
    assert!(!so.contains("HOSTILE-READ-SHADOW") && !so.contains("root:"), "{so}");
    assert_ne!(o.status.code(), Some(0), "the job's failure (head) is nantrace's exit status");
}

#[test]
fn r4_12_user_flag_and_explicit_as_root() {
    if !privileged("r4_12_user_flag_and_explicit_as_root") {
        return;
    }
    let d = Scratch::new("user");
    let out = d.join("o");
    let o = nantrace(&["run", "--no-probes", "--user", "65534", "--out", out.to_str().unwrap(), "--", "id", "-u"], &[]);
    assert_eq!(text(&o).0.trim(), "65534", "{:?}", text(&o));
    let o = nantrace(&["run", "--no-probes", "--user", "nobody", "--out", out.to_str().unwrap(), "--", "sh", "-c", "id -u; echo $HOME"], &[]);
    assert_eq!(text(&o).0, "65534\n/nonexistent\n", "{:?}", text(&o));
    let o = nantrace(&["run", "--no-probes", "--as-root", "--out", out.to_str().unwrap(), "--", "id", "-u"], &[]);
    let (so, se) = text(&o);
    assert_eq!(so.trim(), "0");
    assert!(se.contains("WARNING: --as-root"), "{se}");
    // Through sudo (a `nantrace run *` sudoers rule allows any flag): no way back to root,
    // nor to another user.
    for flags in [&["--as-root"][..], &["--user", "root"], &["--user", "0"], &["--user", "daemon"]] {
        let mut args = vec!["run", "--no-probes", "--out", out.to_str().unwrap()];
        args.extend_from_slice(flags);
        args.extend(["--", "sh", "-c", "echo HOSTILE-ran-as-$(id -u)"]);
        let o = nantrace(&args, &[("SUDO_UID", "65534"), ("SUDO_GID", "65534")]);
        assert_eq!(o.status.code(), Some(1), "{flags:?}: {:?}", text(&o));
        assert!(!text(&o).0.contains("HOSTILE-ran-as"), "{flags:?}: the job did not run");
    }
    let o = nantrace(&["run", "--no-probes", "--user", "no-such-user-hostile", "--", "true"], &[]);
    assert_ne!(o.status.code(), Some(0));
}

#[test]
fn r4_12_the_documented_sudoers_rule_is_gone() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for f in ["docs/multi-node.md", "docs/examples/slurm-nantrace.sbatch", "docs/examples/nantrace-daemonset.yaml"] {
        let s = std::fs::read_to_string(root.join(f)).unwrap();
        for l in s.lines().filter(|l| l.contains("NOPASSWD")) {
            assert!(s.contains("security.md"), "{f}: a sudoers rule without the security model: {l}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Files written as root (4.7, 4.9, 4.10, 4.11, 4.13, 4.14, 5.24, 6.13, 1.19, 1.20, 1.22)
// ---------------------------------------------------------------------------------------------

#[test]
fn r4_9_merge_out_with_planted_symlink_leaves_the_victim_alone() {
    if !privileged("r4_9_merge_out_with_planted_symlink_leaves_the_victim_alone") {
        return;
    }
    let d = Scratch::new("m3");
    let b = make_bundle(&d, "b");
    let victim = d.join("victim");
    std::fs::write(&victim, "HOSTILE-victim-3\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    // The attacker's directory, with the symlinks planted.
    let m3 = d.join("m3");
    std::fs::create_dir(&m3).unwrap();
    for f in ["timeline.json", "report.md"] {
        std::os::unix::fs::symlink(&victim, m3.join(f)).unwrap();
        chown_nobody(&m3.join(f));
    }
    chown_nobody(&m3);
    let o = nantrace(&["merge", b.to_str().unwrap(), "--out", m3.to_str().unwrap()], &[]);
    assert_ne!(o.status.code(), Some(0), "merge into a directory owned by someone else is refused");
    assert!(text(&o).1.contains("belongs to uid 65534"), "{:?}", text(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "HOSTILE-victim-3\n");
    assert_eq!(std::fs::metadata(&victim).unwrap().mode() & 0o777, 0o600);
    // Our own directory with a symlink in it: the symlink is replaced, never followed.
    let mine = d.join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&victim, mine.join("timeline.json")).unwrap();
    let o = nantrace(&["merge", b.to_str().unwrap(), "--out", mine.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "HOSTILE-victim-3\n");
    let m = std::fs::symlink_metadata(mine.join("timeline.json")).unwrap();
    assert!(m.is_file() && m.mode() & 0o777 == 0o600);
}

#[test]
fn r4_14_merge_never_chmods_a_shared_directory_and_r5_24_never_overwrites_an_input() {
    if !privileged("r4_14_merge_never_chmods_a_shared_directory") {
        return;
    }
    let d = Scratch::new("m14");
    let a = make_bundle(&d, "a");
    let shared = d.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let o = nantrace(&["merge", a.to_str().unwrap(), "--out", shared.to_str().unwrap()], &[]);
    assert_ne!(o.status.code(), Some(0));
    assert_eq!(std::fs::metadata(&shared).unwrap().mode() & 0o7777, 0o1777, "mode unchanged");
    // 5.24: the output is an input.
    let before = std::fs::read(a.join("timeline.json")).unwrap();
    for out in [a.clone(), a.join("sub")] {
        let o = nantrace(&["merge", a.to_str().unwrap(), a.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]);
        assert_ne!(o.status.code(), Some(0), "{out:?}");
        assert!(text(&o).1.contains("input bundle"), "{:?}", text(&o));
    }
    assert_eq!(std::fs::read(a.join("timeline.json")).unwrap(), before);
    // A fresh directory is created 0700 and works.
    let fresh = d.join("fresh");
    let o = nantrace(&["merge", a.to_str().unwrap(), "--out", fresh.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
}

#[test]
fn r4_10_snapshot_out_refuses_a_precreated_file_and_a_symlink() {
    if !privileged("r4_10_snapshot_out_refuses_a_precreated_file_and_a_symlink") {
        return;
    }
    let d = Scratch::new("snap");
    let ww = d.join("ww");
    std::fs::create_dir(&ww).unwrap();
    std::fs::set_permissions(&ww, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let snap = ww.join("snap.json");
    std::fs::write(&snap, "").unwrap();
    std::fs::set_permissions(&snap, std::fs::Permissions::from_mode(0o666)).unwrap();
    chown_nobody(&snap);
    let o = nantrace(&["snapshot", "--out", snap.to_str().unwrap()], &[]);
    assert_ne!(o.status.code(), Some(0), "{:?}", text(&o));
    assert_eq!(std::fs::read(&snap).unwrap().len(), 0, "nothing written into the attacker's file");
    let victim = d.join("victim2");
    std::fs::write(&victim, "HOSTILE-victim-2").unwrap();
    let link = ww.join("snap2.json");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    chown_nobody(&link);
    let o = nantrace(&["snapshot", "--out", link.to_str().unwrap()], &[]);
    assert_ne!(o.status.code(), Some(0));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "HOSTILE-victim-2");
    // A new file is created 0600.
    let o = nantrace(&["snapshot", "--out", ww.join("new.json").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert_eq!(std::fs::metadata(ww.join("new.json")).unwrap().mode() & 0o777, 0o600);
}

#[test]
fn r4_11_report_write_refuses_an_attacker_owned_bundle() {
    if !privileged("r4_11_report_write_refuses_an_attacker_owned_bundle") {
        return;
    }
    let d = Scratch::new("rw");
    let b = make_bundle(&d, "b");
    let victim = d.join("victim4");
    std::fs::write(&victim, "HOSTILE-victim-4").unwrap();
    let copy = d.join("copy");
    sh_ok(&format!("cp -a '{}' '{}'", b.display(), copy.display()));
    std::fs::remove_file(copy.join("report.html")).unwrap();
    std::os::unix::fs::symlink(&victim, copy.join("report.html")).unwrap();
    sh_ok(&format!("chown -hR 65534:65534 '{}'", copy.display()));
    let o = nantrace(&["report", "--write", copy.to_str().unwrap()], &[]);
    assert_ne!(o.status.code(), Some(0));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "HOSTILE-victim-4");
    // Our own bundle, with a symlink planted (say by an earlier compromise): replaced, not followed.
    std::fs::remove_file(b.join("report.html")).unwrap();
    std::os::unix::fs::symlink(&victim, b.join("report.html")).unwrap();
    let o = nantrace(&["report", "--write", b.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "HOSTILE-victim-4");
    assert!(std::fs::symlink_metadata(b.join("report.html")).unwrap().is_file());
}

#[test]
fn r4_13_hostile_hostname_stays_inside_out() {
    if !privileged("r4_13_hostile_hostname_stays_inside_out") {
        return;
    }
    let d = Scratch::new("host");
    let out = d.join("a/b/out");
    std::fs::create_dir_all(out.join("nantrace-..")).unwrap();
    std::fs::create_dir_all(out.join(".nantrace-..")).unwrap();
    let o = sh(&format!("unshare --uts sh -c \"printf '../../escaped' > /proc/sys/kernel/hostname && '{BIN}' run --no-probes --post 1 --out '{}' -- sh -c 'echo HOSTILE-host loss nan; exit 2'\"", out.display()));
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    let b = bundles(&out);
    assert_eq!(b.len(), 1, "{b:?} {}", String::from_utf8_lossy(&o.stderr));
    let name = b[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("nantrace-____escaped-"), "{name}");
    assert!(!d.join("a/escaped").exists() && !d.join("a/b/escaped").exists());
}

#[test]
fn r4_7_dangling_symlinks_named_like_the_next_bundles_do_not_strand_it() {
    if !privileged("r4_7_dangling_symlinks_named_like_the_next_bundles_do_not_strand_it") {
        return;
    }
    let d = Scratch::new("dangle");
    let ww = d.join("ww");
    std::fs::create_dir(&ww).unwrap();
    std::fs::set_permissions(&ww, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    for s in now..now + 60 {
        let stamp = String::from_utf8(sh(&format!("date -u -d @{s} +%Y%m%dT%H%M%SZ")).stdout).unwrap();
        let link = ww.join(format!("nantrace-{host}-{}", stamp.trim()));
        std::os::unix::fs::symlink("/nonexistent-hostile", &link).unwrap();
        chown_nobody(&link);
    }
    let o = nantrace(&["run", "--no-probes", "--post", "1", "--out", ww.to_str().unwrap(), "--", "sh", "-c", "echo HOSTILE-dangle loss nan; exit 4"], &[]);
    let (_, se) = text(&o);
    assert_eq!(o.status.code(), Some(4), "{se}");
    assert!(se.contains("incident bundle written"), "{se}");
    let b = bundles(&ww);
    assert_eq!(b.len(), 1, "{se}");
    assert!(b[0].file_name().unwrap().to_string_lossy().ends_with("-2"));
    assert!(std::fs::read_dir(&ww).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().contains(".tmp-")), "no stranded temporary directory");
}

#[test]
fn r6_13_concurrent_instances_each_get_their_bundle() {
    if !privileged("r6_13_concurrent_instances_each_get_their_bundle") {
        return;
    }
    let d = Scratch::new("conc");
    let out = d.join("out");
    let trig = d.join("TRIGGER");
    let kids: Vec<_> = (0..4)
        .map(|_| {
            Command::new(BIN)
                .args(["run", "--no-probes", "--post", "0.3", "--out", out.to_str().unwrap(), "--trigger-file", trig.to_str().unwrap(), "--", "sleep", "3"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1200));
    std::fs::write(&trig, "").unwrap();
    for k in kids {
        let o = k.wait_with_output().unwrap();
        let se = String::from_utf8_lossy(&o.stderr);
        assert!(se.contains("incident bundle written") && !se.contains("ERROR"), "{se}");
    }
    assert_eq!(bundles(&out).len(), 4);
    assert!(std::fs::read_dir(&out).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().contains(".tmp-")));
}

#[test]
fn r1_19_r1_20_out_is_checked_before_the_job_starts() {
    if !privileged("r1_19_r1_20_out_is_checked_before_the_job_starts") {
        return;
    }
    let d = Scratch::new("outchk");
    let afile = d.join("afile");
    std::fs::write(&afile, "x").unwrap();
    let marker = d.join("job-ran");
    let job = format!("touch '{}'; echo HOSTILE-out loss nan; exit 2", marker.display());
    let o = nantrace(&["run", "--no-probes", "--out", afile.to_str().unwrap(), "--", "sh", "-c", &job], &[]);
    assert_ne!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("not a directory"), "{:?}", text(&o));
    assert!(!marker.exists(), "the job did not start");
    // A read-only filesystem, and a directory below it.
    let ro = d.join("ro");
    std::fs::create_dir(&ro).unwrap();
    sh_ok(&format!("mount -t tmpfs -o ro,size=64k tmpfs '{}'", ro.display()));
    for out in [ro.clone(), ro.join("sub/dir")] {
        let o = nantrace(&["run", "--no-probes", "--out", out.to_str().unwrap(), "--", "sh", "-c", &job], &[]);
        assert_ne!(o.status.code(), Some(2));
        assert!(text(&o).1.contains("Read-only file system"), "{:?}", text(&o));
    }
    sh_ok(&format!("umount '{}'", ro.display()));
    assert!(!marker.exists(), "the job did not start");
}

#[test]
fn r1_22_a_bundle_of_empty_files_is_not_called_written() {
    if !privileged("r1_22_a_bundle_of_empty_files_is_not_called_written") {
        return;
    }
    let d = Scratch::new("full");
    let full = d.join("full");
    std::fs::create_dir(&full).unwrap();
    sh_ok(&format!("mount -t tmpfs -o size=64k tmpfs '{}'", full.display()));
    let o = nantrace(&["run", "--no-probes", "--post", "1", "--out", full.to_str().unwrap(), "--", "sh", "-c", &format!("dd if=/dev/zero of='{}/fill' bs=4k count=100 2>/dev/null; echo HOSTILE-full loss nan; exit 5", full.display())], &[]);
    let (_, se) = text(&o);
    sh(&format!("umount '{}'", full.display()));
    assert_eq!(o.status.code(), Some(5), "{se}");
    assert!(!se.contains("incident bundle written"), "{se}");
    assert!(se.contains("no file of the bundle could be written"), "{se}");
}

// ---------------------------------------------------------------------------------------------
// Signals and a closed stderr (2.11, 6.1, 6.3, 6.5, 6.6)
// ---------------------------------------------------------------------------------------------

#[test]
fn r2_11_closed_stderr_does_not_panic_and_the_bundle_and_exit_code_survive() {
    if !privileged("r2_11_closed_stderr_does_not_panic") {
        return;
    }
    let d = Scratch::new("epipe");
    for head in [232, 20] {
        let out = d.join(&format!("o{head}"));
        let rc = d.join(&format!("rc{head}"));
        let o = sh(&format!(
            "( '{BIN}' run --no-probes --out '{}' --post 1 -- sh -c 'sleep 1; echo HOSTILE-epipe step 1 loss nan; sleep 1; exit 3'; echo $? > '{}' ) 2>&1 >/dev/null | head -c {head} >/dev/null",
            out.display(),
            rc.display()
        ));
        assert!(o.status.success());
        // The subshell may outlive head: wait for its rc file.
        let t0 = Instant::now();
        while !rc.exists() && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(std::fs::read_to_string(&rc).unwrap().trim(), "3", "head -c {head}: nantrace exits with the job's status, not 101");
        assert_eq!(bundles(&out).len(), 1, "head -c {head}: the bundle is written");
    }
}

fn longjob(d: &Scratch) -> PathBuf {
    let p = d.join("longjob.sh");
    std::fs::write(
        &p,
        "#!/bin/sh\ntrap 'echo HOSTILE-got-TERM >&2; exit 143' TERM\ntrap 'echo HOSTILE-got-INT >&2; exit 130' INT\ntrap 'echo HOSTILE-got-HUP >&2; exit 129' HUP\ni=0; while [ $i -lt 200 ]; do echo \"step $i | loss 0.5\"; i=$((i+1)); sleep 0.1; done\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// Start `run` on the long job, send `sig` to nantrace after 1.5 s; (rc, stderr, bundles).
/// SIGINT, SIGHUP, SIGTERM at their defaults in nantrace and its job, whatever the test
/// runner inherited: a runner started with `nohup` or as a background command of a script
/// ignores SIGHUP or SIGINT, its children inherit that, and a shell cannot trap a signal it
/// was started ignoring (that is how `nohup nantrace run` is meant to behave, not what these
/// tests test).
fn default_signals(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: signal() is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            for s in [libc::SIGINT, libc::SIGHUP, libc::SIGTERM] {
                libc::signal(s, libc::SIG_DFL);
            }
            Ok(())
        })
    }
}

fn signal_run(d: &Scratch, tag: &str, sig: i32, extra: &[&str]) -> (Option<i32>, String, Vec<PathBuf>) {
    let out = d.join(tag);
    let job = longjob(d);
    let mut args = vec!["run", "--no-probes", "--post", "1", "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend(["--", job.to_str().unwrap()]);
    let child = default_signals(Command::new(BIN).args(&args)).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, sig) };
    let o = child.wait_with_output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned(), bundles(&out))
}

#[test]
fn r6_1_r6_3_sigint_and_sighup_reach_the_job_and_nantrace_exits_with_its_status() {
    if !privileged("r6_1_r6_3_sigint_and_sighup") {
        return;
    }
    let d = Scratch::new("sig");
    for (sig, name, code) in [(libc::SIGINT, "INT", 130), (libc::SIGHUP, "HUP", 129), (libc::SIGTERM, "TERM", 143)] {
        let (rc, se, b) = signal_run(&d, name, sig, &[]);
        assert!(se.contains(&format!("HOSTILE-got-{name}")), "{name}: the job got the signal: {se}");
        assert_eq!(rc, Some(code), "{name}: nantrace exits with the job's status: {se}");
        assert_eq!(b.len(), 1, "{name}: exactly one bundle: {se}");
        let t = std::fs::read_to_string(b[0].join("timeline.json")).unwrap();
        assert!(t.contains(&format!("\"exit_code\": {code}")), "{name}: the job's exit is recorded");
    }
}

#[test]
fn r6_5_r6_6_a_signal_during_the_dump_gives_no_second_bundle() {
    if !privileged("r6_5_r6_6_a_signal_during_the_dump") {
        return;
    }
    let d = Scratch::new("dumpsig");
    let out = d.join("o");
    // Enough events that the dump of a debug build takes a while; the NaN comes last.
    // `exec sleep`: the job's last process gets the forwarded SIGINT itself (a shell waiting
    // for a foreground child defers a SIGINT until the child exits, and then may exit 0: the
    // outcome depended on where the signal landed, under load).
    let job = "i=0; while [ $i -lt 20 ]; do seq 1 20000 | sed 's/^/HOSTILE-fill line /'; i=$((i+1)); done; echo HOSTILE-dump loss nan; exec sleep 20";
    let mut child = default_signals(&mut Command::new(BIN))
        .args(["run", "--no-probes", "--post", "0", "--out", out.to_str().unwrap(), "--", "sh", "-c", job])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead as _;
        let mut all = String::new();
        for l in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if l.contains("trigger nan") {
                let _ = tx.send(());
            }
            all.push_str(&l);
            all.push('\n');
        }
        all
    });
    rx.recv_timeout(Duration::from_secs(120)).expect("the NaN fired");
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let st = child.wait().unwrap();
    let se = reader.join().unwrap();
    assert_eq!(bundles(&out).len(), 1, "{se}");
    assert_eq!(st.code(), Some(130), "the job dies of the forwarded SIGINT: {se}");
}

// ---------------------------------------------------------------------------------------------
// Secrets (4.2, 4.4, 4.5)
// ---------------------------------------------------------------------------------------------

/// 60 planted values across the job's environment, its argv and its log lines.
#[test]
fn r4_2_r4_4_r4_5_secret_corpus_never_leaves_the_process() {
    if !privileged("r4_2_r4_4_r4_5_secret_corpus") {
        return;
    }
    let d = Scratch::new("secrets");
    let out = d.join("o");
    // (where, the line or value that carries it, the secret itself)
    let env: Vec<(&str, String, String)> = vec![
        ("AWS_SECRET_ACCESS_KEY", "HstAwsSecretKey01wJalrXUtnFEMIK7MDENG".into(), "HstAwsSecretKey01".into()),
        ("AWS_ACCESS_KEY_ID", "AKIAHOSTILE0ENV00001".into(), "AKIAHOSTILE0ENV00001".into()),
        ("HF_TOKEN", "hf_HstEnvHfToken0123456789abcdef".into(), "HstEnvHfToken".into()),
        ("WANDB_API_KEY", "HstWandbKey0123456789".into(), "HstWandbKey0123456789".into()),
        ("OPENAI_API_KEY", "sk-HstOpenAiEnv0123456789abcdef".into(), "HstOpenAiEnv".into()),
        ("GITHUB_TOKEN", "ghp_HstGithubEnv0123456789abcdefABCD".into(), "HstGithubEnv".into()),
        ("DATABASE_URL", "postgres://u:HstDbUrlPw@db/x".into(), "HstDbUrlPw".into()),
        ("MY_PASSWORD", "HstMyPassword1".into(), "HstMyPassword1".into()),
        ("HF_DATASETS_URL", "redis://:HstRedisPw2@cache:6379/0".into(), "HstRedisPw2".into()),
        ("TORCH_HOME_AT", "HstUserPart3:HstPwPart3@h".into(), "HstPwPart3".into()),
        ("CUDA_LAUNCH_EXTRA", "--password HstLaunchPw4".into(), "HstLaunchPw4".into()),
        ("SLURM_JOB_COMMENT", "pw=HstCommentPw5".into(), "HstCommentPw5".into()),
        ("HF_HUB_AUTHTOK", "HstAuthTok6".into(), "HstAuthTok6".into()),
        ("NVIDIA_NGC_KEY", "HstNgcKey7".into(), "HstNgcKey7".into()),
        ("NCCL_COMM_URL", "https://u:HstNcclPw8@nccl.example/x".into(), "HstNcclPw8".into()),
        ("NCCL_DEBUG_OPAQUE", "Zq8xW2mLp4Tn7Rv1Ks9Bd3Hf6Jc0HstRand9".into(), "Zq8xW2mLp4Tn7Rv1Ks9Bd3Hf6Jc0HstRand9".into()),
        ("TORCH_EXTRA_ARGS", "--api-key HstExtraKey10".into(), "HstExtraKey10".into()),
        ("CUDA_NOTE", "Authorization: Bearer HstEnvBearer11xyz".into(), "HstEnvBearer11xyz".into()),
        ("PYTORCH_SLACK", "xoxb-HstSlack12-0123456789".into(), "HstSlack12".into()),
        ("NCCL_JWT", "eyJhbGciOiJIUzI1NiJ9.eyJIc3RKd3QxMyI6MX0.HstJwtSig13".into(), "HstJwtSig13".into()),
    ];
    let argv: Vec<(String, String)> = vec![
        ("--api-key sk-live-HstArgApiKey0123456789abcdef".into(), "HstArgApiKey".into()),
        ("--password HstArgPw21".into(), "HstArgPw21".into()),
        ("--db postgres://u:HstArgDbPw22@h/db".into(), "HstArgDbPw22".into()),
        ("--token=HstArgTok23".into(), "HstArgTok23".into()),
        ("--hf-token hf_short".into(), "hf_short".into()),
        ("--aws AKIAHOSTILE0ARG00025".into(), "AKIAHOSTILE0ARG00025".into()),
        ("--secret HstArgSecret26".into(), "HstArgSecret26".into()),
        ("db_password=HstArgKv27".into(), "HstArgKv27".into()),
        ("--cache redis://:HstArgRedis28@r:6379".into(), "HstArgRedis28".into()),
        ("--wandb-key HstArgWandb29".into(), "HstArgWandb29".into()),
        ("--gh ghp_HstArgGh30abcdefghijklmnopqrstuv".into(), "HstArgGh30".into()),
        ("--gho gho_HstArgGho31abcdefghijklmnopqrstu".into(), "HstArgGho31".into()),
        ("--pat github_pat_HstArgPat32_abcdefghijklmnop".into(), "HstArgPat32".into()),
        ("--slack xoxp-HstArgSlack33-012345".into(), "HstArgSlack33".into()),
        ("--jwt eyJhbGciOiJIUzI1NiJ9.eyJIc3RBcmczNCI6MX0.HstArgJwt34".into(), "HstArgJwt34".into()),
        ("--header=Authorization:HstArgAuth35".into(), "HstArgAuth35".into()),
        ("--passphrase HstArgPhrase36".into(), "HstArgPhrase36".into()),
        ("--mirror https://me:HstArgMirror37@mirror.example/x".into(), "HstArgMirror37".into()),
        ("api_key=HstArgKv38".into(), "HstArgKv38".into()),
        ("--private-key HstArgPriv39".into(), "HstArgPriv39".into()),
    ];
    let log: Vec<(String, String)> = vec![
        ("logging in with token hf_HstLogHf40abcdefghijklmnop".into(), "HstLogHf40".into()),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJIc3RMb2c0MSI6MX0.HstLogJwt41".into(), "HstLogJwt41".into()),
        ("connecting postgres://loguser:HstLogDb42@db.example/db".into(), "HstLogDb42".into()),
        ("password=HstLogPlain43".into(), "HstLogPlain43".into()),
        ("aws key AKIAHOSTILE0LOG00044 in use".into(), "AKIAHOSTILE0LOG00044".into()),
        ("aws secret HstLog45wJalrXUtnFEMIK7MDENGbPxRfiCYEXAM ok".into(), "HstLog45wJalrXUtnFEMIK7MDENGbPxRfiCYEXAM".into()),
        ("openai sk-HstLogOpenai46abcdefghijklmn".into(), "HstLogOpenai46".into()),
        ("gh ghp_HstLogGh47abcdefghijklmnopqrstuv".into(), "HstLogGh47".into()),
        ("gho gho_HstLogGho48abcdefghijklmnopqrst".into(), "HstLogGho48".into()),
        ("pat github_pat_HstLogPat49_abcdefghijklmnop".into(), "HstLogPat49".into()),
        ("slack xoxb-HstLogSlack50-0123456789".into(), "HstLogSlack50".into()),
        ("slack xoxa-HstLogSlack51-0123456789".into(), "HstLogSlack51".into()),
        ("curl -H 'Authorization: Bearer HstLogBearer52xyz'".into(), "HstLogBearer52xyz".into()),
        ("redis://:HstLogRedis53@cache:6379 connected".into(), "HstLogRedis53".into()),
        ("config {\"api_key\": \"HstLogJson54\"}".into(), "HstLogJson54".into()),
        ("retrying with secret=HstLogSecret55".into(), "HstLogSecret55".into()),
        ("wandb: token: HstLogWandb56".into(), "HstLogWandb56".into()),
        ("mirror user:HstLogMirror57@mirror.example".into(), "HstLogMirror57".into()),
        ("basic auth Basic SHN0TG9nQmFzaWM1OA==".into(), "SHN0TG9nQmFzaWM1OA".into()),
        ("--password HstLogFlag59 given".into(), "HstLogFlag59".into()),
    ];
    let script = d.join("job.sh");
    let mut body = String::from("#!/bin/sh\n");
    for (l, _) in &log {
        body.push_str(&format!("printf '%s\\n' '{}'\n", l.replace('\'', "'\\''")));
    }
    body.push_str("echo 'HOSTILE-secrets step 1 | loss: nan'\nsleep 1\nexit 1\n");
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--no-probes", "--post", "1", "--out", out.to_str().unwrap(), "--", script.to_str().unwrap()]);
    for (a, _) in &argv {
        cmd.args(a.split(' '));
    }
    for (k, v, _) in &env {
        cmd.env(k, v);
    }
    let o = cmd.stdin(Stdio::null()).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let b = bundles(&out);
    assert_eq!(b.len(), 1);
    // Also `snapshot --pid` of a process with the same environment and argv, to stdout
    // (`sleep` refuses extra operands: sh keeps them as its own argv).
    let mut s = Command::new("sh");
    s.arg("-c").arg("sleep 30").arg("sh");
    for (a, _) in &argv {
        s.args(a.split(' '));
    }
    for (k, v, _) in &env {
        s.env(k, v);
    }
    let mut sleeper = s.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let snap = nantrace(&["snapshot", "--pid", &sleeper.id().to_string()], &[]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let mut haystack: Vec<(String, Vec<u8>)> = vec![("stderr".into(), o.stderr.clone()), ("snapshot stdout".into(), snap.stdout.clone())];
    for f in std::fs::read_dir(&b[0]).unwrap().flatten() {
        haystack.push((f.file_name().to_string_lossy().into_owned(), std::fs::read(f.path()).unwrap()));
    }
    let secrets: Vec<&str> = env.iter().map(|e| e.2.as_str()).chain(argv.iter().map(|a| a.1.as_str())).chain(log.iter().map(|l| l.1.as_str())).collect();
    assert!(secrets.len() >= 50);
    let mut found = Vec::new();
    for s in &secrets {
        for (name, data) in &haystack {
            if String::from_utf8_lossy(data).contains(s) {
                found.push(format!("{s} in {name}"));
            }
        }
    }
    assert!(found.is_empty(), "{} leaks: {found:#?}", found.len());
    // Sanity: the log and the command line are there, only redacted.
    let app = std::fs::read_to_string(b[0].join("app.log")).unwrap();
    assert!(app.contains("HOSTILE-secrets step 1") && app.contains("<redacted>"));
}

// ---------------------------------------------------------------------------------------------
// Bad command-line input (1.10, 1.11, 1.12, 1.14, 1.25-1.37, 1.43) and outputs (3.3, 3.4, 5.19-5.22)
// ---------------------------------------------------------------------------------------------

#[test]
fn r1_25_to_1_43_numeric_flags_are_validated() {
    for args in [
        &["run", "--window", "-1", "--", "true"][..],
        &["run", "--window", "0", "--", "true"],
        &["run", "--window", "nan", "--", "true"],
        &["run", "--window", "inf", "--", "true"],
        &["run", "--post=-5", "--", "true"],
        &["run", "--post", "nan", "--", "true"],
        &["run", "--mem-cap-mb", "0", "--", "true"],
        &["run", "--mem-cap-mb", "17592186044416", "--", "true"],
        &["run", "--sample", "nan", "--", "true"],
        &["run", "--sample", "1e300", "--", "true"],
        &["run", "--sample", "0", "--", "true"],
        &["run", "--sample=-1", "--", "true"],
        &["run", "--slow-io-ms", "nan", "--", "true"],
        &["run", "--nan-pattern", "", "--", "true"],
        &["run", "--nan-pattern", "x*", "--", "true"],
        &["watch", "--duration=-1"],
        &["watch", "--duration", "nan"],
        &["watch", "--duration", "inf"],
        &["watch", "--duration", "1e300"],
    ] {
        let o = nantrace(args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: a clap error, not a panic or a silent run: {:?}", text(&o));
    }
}

#[test]
fn r1_11_r1_12_r1_14_unusable_log_paths() {
    if !privileged("r1_11_r1_12_r1_14_unusable_log_paths") {
        return;
    }
    let d = Scratch::new("log");
    let mut sleeper = Command::new("sleep").arg("20").spawn().unwrap();
    let pid = sleeper.id().to_string();
    let adir = d.join("adir");
    std::fs::create_dir(&adir).unwrap();
    let o = nantrace(&["attach", "--no-probes", "--pid", &pid, "--log", adir.to_str().unwrap(), "--out", d.join("o").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("is a directory"), "{:?}", text(&o));
    // Unreadable for uid 65534.
    let unreadable = d.join("unreadable.log");
    std::fs::write(&unreadable, "HOSTILE-log loss nan\n").unwrap();
    std::fs::set_permissions(&unreadable, std::fs::Permissions::from_mode(0o600)).unwrap();
    let outn = d.join("on");
    std::fs::create_dir(&outn).unwrap();
    chown_nobody(&outn);
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN, "attach", "--no-probes", "--pid", &pid, "--log", unreadable.to_str().unwrap(), "--out", outn.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(text(&o).1.contains("cannot be read"), "{:?}", text(&o));
    // Missing: said, then waited for.
    let missing = d.join("later.log");
    let c = Command::new(BIN).args(["attach", "--no-probes", "--post", "0", "--pid", &pid, "--log", missing.to_str().unwrap(), "--out", d.join("o").to_str().unwrap()]).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&missing, "HOSTILE-later loss nan\n").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    let se = String::from_utf8_lossy(&c.wait_with_output().unwrap().stderr).into_owned();
    assert!(se.contains("does not exist yet: waiting for it"), "{se}");
    assert!(se.contains("trigger nan"), "the NaN in the file that appeared later is seen: {se}");
}

#[test]
fn r1_10_attach_to_a_process_whose_leader_thread_exited() {
    if !privileged("r1_10_attach_to_a_process_whose_leader_thread_exited") {
        return;
    }
    let d = Scratch::new("zleader");
    let src = d.join("z.c");
    std::fs::write(&src, "#include <pthread.h>\n#include <unistd.h>\nstatic void *run(void *a) { (void)a; sleep(4); return 0; }\nint main(void) { pthread_t t; pthread_create(&t, 0, run, 0); pthread_exit(0); }\n").unwrap();
    let exe = d.join("z");
    if !sh(&format!("cc -pthread -o '{}' '{}'", exe.display(), src.display())).status.success() {
        eprintln!("SKIPPED r1_10: no C compiler");
        return;
    }
    let mut z = Command::new(&exe).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pid = z.id().to_string();
    let t0 = Instant::now();
    let o = nantrace(&["attach", "--no-probes", "--pid", &pid, "--out", d.join("o").to_str().unwrap()], &[]);
    let _ = z.kill();
    let _ = z.wait();
    let (_, se) = text(&o);
    assert_eq!(o.status.code(), Some(0), "a live process with a zombie leader is alive: {se}");
    assert!(!se.contains("does not exist"), "{se}");
    assert!(t0.elapsed() > Duration::from_secs(2), "followed until its last thread ended: {:?}", t0.elapsed());
}

#[test]
fn r3_3_r3_4_report_md_and_the_terminal_escape_untrusted_text() {
    if !privileged("r3_3_r3_4_report_md_and_the_terminal_escape_untrusted_text") {
        return;
    }
    let d = Scratch::new("inject");
    let out = d.join("o");
    let job = "printf '%s\\n' '<script>alert(1)</script> ![i](http://evil.example/x.png) [l](javascript:alert(1)) HOSTILE-inject loss nan'; printf 'x\\033[2J\\n'; exit 3";
    let o = nantrace(&["run", "--no-probes", "--post", "1", "--out", out.to_str().unwrap(), "--", "sh", "-c", job], &[]);
    let se = o.stderr.clone();
    assert!(!se.contains(&0x1b), "no raw ESC from nantrace on stderr (the job's own stderr is not used here)");
    let b = bundles(&out);
    assert_eq!(b.len(), 1);
    let md = std::fs::read_to_string(b[0].join("report.md")).unwrap();
    for bad in ["<script>", "![i](", "[l](javascript"] {
        assert!(!md.contains(bad), "{bad} in report.md:\n{md}");
    }
    assert!(md.contains("HOSTILE-inject"), "the text is still there, escaped");
    // A process name with newlines and ESC (needs the probes: the name comes from the kernel).
    let py = "import ctypes, os, time\nlibc = ctypes.CDLL(None)\npid = os.fork()\nif pid == 0:\n    libc.prctl(15, ctypes.c_char_p(b'\\n# PWNED\\n\\x1b[2J'), 0, 0, 0)\n    os._exit(3)\nos.waitpid(pid, 0)\ntime.sleep(0.2)\nprint('HOSTILE-comm step 1 | loss nan', flush=True)\n";
    let f = d.join("comm_nl.py");
    std::fs::write(&f, py).unwrap();
    let out2 = d.join("o2");
    let o = nantrace(&["run", "--post", "1", "--out", out2.to_str().unwrap(), "--", "python3", f.to_str().unwrap()], &[]);
    assert!(!o.stderr.contains(&0x1b), "no raw ESC on stderr: {}", String::from_utf8_lossy(&o.stderr));
    let r = nantrace(&["report", bundles(&out2)[0].to_str().unwrap()], &[]);
    assert!(!r.stdout.contains(&0x1b), "no raw ESC from `nantrace report`");
    let md = std::fs::read_to_string(bundles(&out2)[0].join("report.md")).unwrap();
    assert!(!md.lines().any(|l| l.starts_with("# PWNED")), "{md}");
}

fn edit_timeline(b: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = b.join("timeline.json");
    let mut t: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut t);
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, serde_json::to_vec(&t).unwrap()).unwrap();
}

#[test]
fn r5_19_to_5_22_absurd_times_and_junk_events_are_bounded() {
    if !privileged("r5_19_to_5_22_absurd_times_and_junk_events_are_bounded") {
        return;
    }
    let d = Scratch::new("absurd");
    let b = make_bundle(&d, "b");
    for (i, off) in [1e15, 1e300, -1e300].into_iter().enumerate() {
        let c = d.join(&format!("c{i}"));
        sh_ok(&format!("cp -a '{}' '{}'", b.display(), c.display()));
        edit_timeline(&c, |t| t["events"][0]["offset_s"] = serde_json::json!(off));
        let t0 = Instant::now();
        let o = nantrace(&["report", "--write", c.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{off}: {:?}", text(&o));
        assert!(t0.elapsed() < Duration::from_secs(20), "{off}: {:?}", t0.elapsed());
        assert!(std::fs::metadata(c.join("report.html")).unwrap().len() < 5 << 20);
    }
    // A node on a 1970 clock, and one with correction_s 1e300.
    for (tag, edit) in [("epoch", 0), ("corr", 1)] {
        let c = d.join(tag);
        sh_ok(&format!("cp -a '{}' '{}'", b.display(), c.display()));
        edit_timeline(&c, |t| {
            if edit == 0 {
                for e in t["events"].as_array_mut().unwrap() {
                    e["time"] = serde_json::json!("1970-01-01T00:00:05.000000000Z");
                }
                t["trigger"]["time"] = serde_json::json!("1970-01-01T00:00:05.000000000Z");
            } else {
                t["clock"]["correction_s"] = serde_json::json!(1e300);
            }
        });
        let m = d.join(&format!("m-{tag}"));
        let t0 = Instant::now();
        let o = nantrace(&["merge", b.to_str().unwrap(), c.to_str().unwrap(), "--out", m.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{tag}: {:?}", text(&o));
        assert!(t0.elapsed() < Duration::from_secs(20), "{tag}: {:?}", t0.elapsed());
        assert!(std::fs::metadata(m.join("report.html")).unwrap().len() < 5 << 20, "{tag}");
    }
    // 5.22: junk events.
    let j = d.join("junk");
    sh_ok(&format!("cp -a '{}' '{}'", b.display(), j.display()));
    edit_timeline(&j, |t| t["events"] = serde_json::json!([1, "x", null, [], {}]));
    let o = nantrace(&["merge", b.to_str().unwrap(), j.to_str().unwrap(), "--out", d.join("mj").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
}

// ---------------------------------------------------------------------------------------------
// Block-buffered Python (2.14) and non-root wording (6.14a)
// ---------------------------------------------------------------------------------------------

#[test]
fn r2_14_python_output_is_unbuffered_unless_told_otherwise() {
    if !privileged("r2_14_python_output_is_unbuffered") {
        return;
    }
    let d = Scratch::new("buf");
    let f = d.join("buffered.py");
    std::fs::write(&f, "import os, sys, time\nprint(os.environ.get('PYTHONUNBUFFERED', 'unset'))\nprint('HOSTILE-buffered step 1 loss nan')\ntime.sleep(3)\n").unwrap();
    let run = |extra: &[&str]| -> (Duration, String) {
        let t0 = Instant::now();
        let mut args = vec!["run", "--no-probes", "--post", "1", "--out", d.0.to_str().unwrap()];
        args.extend_from_slice(extra);
        args.extend(["--", "python3", f.to_str().unwrap()]);
        let mut c = Command::new(BIN).args(&args).env_remove("PYTHONUNBUFFERED").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let stderr = c.stderr.take().unwrap();
        use std::io::BufRead as _;
        let mut at = None;
        for l in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if l.contains("trigger nan") && at.is_none() {
                at = Some(t0.elapsed());
            }
        }
        let o = c.wait_with_output().unwrap();
        (at.expect("the NaN was seen"), String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let (at, so) = run(&[]);
    assert!(so.starts_with('1'), "PYTHONUNBUFFERED=1 is set: {so}");
    assert!(at < Duration::from_millis(2500), "the NaN arrives when printed, not at exit: {at:?}");
    let (at, so) = run(&["--no-unbuffered"]);
    assert!(so.starts_with("unset"), "{so}");
    assert!(at >= Duration::from_millis(2900), "with --no-unbuffered python block-buffers: {at:?}");
}

#[test]
fn r6_14a_non_root_is_told_tracefs_is_unreadable_not_unmounted() {
    if !privileged("r6_14a_non_root_tracefs_wording") {
        return;
    }
    if !Path::new("/sys/kernel/tracing/events").is_dir() {
        eprintln!("SKIPPED r6_14a: tracefs not mounted here");
        return;
    }
    let o = Command::new("setpriv").args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN, "doctor"]).output().unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if all.contains("tracefs       /sys/kernel/tracing") {
        eprintln!("SKIPPED r6_14a: tracefs is readable by uid 65534 here");
        return;
    }
    assert!(!all.contains("NOT MOUNTED"), "{all}");
    assert!(all.contains("is mounted at") && all.contains("root is needed"), "{all}");
}
