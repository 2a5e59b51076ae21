//! Privileged: the kernel side's job membership map (`JOB_MAP`, one byte per pid), read
//! through the same shared mapping userspace seeds it with, while real processes fork, start
//! threads, exec from a thread and exit.
mod common;

use std::time::Duration;

use common::*;

/// The kernel side's membership map (`JOB_MAP`, one byte per pid): a job process's children
/// and threads are marked by the fork program, unmarked by the exit program (a stale mark
/// would make the next process to reuse the pid a "job" process), and a process outside the
/// job is never marked. Read through the same shared mapping userspace seeds it with.
#[test]
fn job_membership_follows_forks_threads_and_exits() {
    if !privileged("job_membership_follows_forks_threads_and_exits") {
        return;
    }
    let mut probes = probes_in_process();
    let dir = out_dir("member");
    let (go, kid) = (dir.join("go"), dir.join("kid"));
    // The root forks a threaded process (nantrace's own load generator, 3 threads for 2 s)
    // and records its pid.
    let mut root = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while [ ! -e {go} ]; do sleep 0.02; done; {BIN} bench-internal synth-gen --rate 300 --seconds 2 --burst 1 --threads 3 >/dev/null & echo $! > {kid}; wait; exit 0",
            go = go.display(),
            kid = kid.display(),
        ))
        .spawn()
        .unwrap();
    let root_pid = root.id();
    let me = std::process::id();
    assert!(!probes.is_job_pid(root_pid), "marked before it was added");
    probes.add_job_pid(root_pid).unwrap();
    assert!(probes.is_job_pid(root_pid));
    std::fs::write(&go, "").unwrap();
    let t0 = std::time::Instant::now();
    let child = pid_from(&kid, "the child's pid");
    assert!(
        probes.is_job_pid(child),
        "the fork program did not mark the job's child {child}"
    );
    // Its threads, once it has started them.
    let mut tids = Vec::new();
    while tids.len() < 4 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
        tids = std::fs::read_dir(format!("/proc/{child}/task"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                    .collect()
            })
            .unwrap_or_default();
    }
    assert!(tids.len() >= 4, "the generator has threads {tids:?}");
    for t in &tids {
        assert!(
            probes.is_job_pid(*t),
            "thread {t} of the job's process {child} is not marked"
        );
    }
    assert!(
        !probes.is_job_pid(me),
        "the test process (outside the job) is marked"
    );
    // The sweep removes only the marks of tasks gone: none while the job runs.
    assert_eq!(probes.sweep_exited(), 0, "the sweep removed a live task's mark");
    assert!(probes.is_job_pid(child) && tids.iter().all(|t| probes.is_job_pid(*t)));
    // Marks of neighbouring pids are independent bytes: setting and clearing an unmarked pid
    // in the same 8-byte element leaves the kernel's mark of the child beside it alone.
    let other = (child & !7..(child & !7) + 8)
        .find(|p| !probes.is_job_pid(*p))
        .expect("an unmarked pid beside the child");
    probes.add_job_pid(other).unwrap();
    assert!(probes.is_job_pid(other));
    probes.remove_job_pid(other).unwrap();
    assert!(
        probes.is_job_pid(child),
        "clearing pid {other} cleared its neighbour {child}"
    );
    assert!(root.wait().unwrap().success());
    // The exit program runs before the parent is woken, so the marks are gone by now: each
    // thread's sched_process_exit comes before its release, and the leader is reaped only
    // once every thread is released. Unless the kernel skipped the exit program's run as
    // nested (7.3 under TCG, 1 of 60 runs: the three threads end together and one run of
    // the program was preempted by another on its CPU; the 2-s watch showed the mark of a
    // gone thread never cleared): then `recursion_misses` counts it and the sweep (the
    // agent's sweep thread, every 5 s) removes the marks of tasks gone. A mark left with no
    // skipped run is the exit program's own bug, and fails.
    let left: Vec<u32> = [child, root_pid]
        .iter()
        .chain(&tids)
        .copied()
        .filter(|p| probes.is_job_pid(*p))
        .collect();
    if !left.is_empty() {
        let losses = probes.membership_losses();
        let skipped = losses["exit_runs_skipped_nested"];
        assert!(
            skipped > 0,
            "marks of exited tasks {left:?} (child {child}, root {root_pid}, threads {tids:?}) left behind, and the kernel skipped no run of the exit program: {losses:?}"
        );
        let removed = probes.sweep_exited();
        eprintln!(
            "KNOWN: the kernel skipped {skipped} run(s) of the exit program as nested; marks of exited tasks {left:?} were left, the sweep removed {removed}"
        );
        assert!(
            left.iter().all(|p| !probes.is_job_pid(*p)),
            "the sweep left marks of exited tasks {left:?}"
        );
    }
    assert_eq!(probes.job_pid_count(), 0, "marks left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A thread other than the main one execs: the process keeps its pid (the job's), and the
/// thread's old tid, which ends without an exit of its own, is unmarked by the exec program.
/// A stale mark would make the next process given that pid count as the job's.
#[test]
fn a_thread_that_execs_leaves_no_stale_mark() {
    if !privileged("a_thread_that_execs_leaves_no_stale_mark") {
        return;
    }
    let mut probes = probes_in_process();
    let dir = out_dir("texec");
    let mut root = Gated::new(
        "texec",
        &format!(
            "exec {BIN} bench-internal thread-exec --dir {}",
            dir.display()
        ),
    );
    let root_pid = root.id();
    probes.add_job_pid(root_pid).unwrap();
    root.go();
    let t0 = std::time::Instant::now();
    let tid = pid_from(&dir.join("tid"), "the thread's tid");
    assert_ne!(tid, root_pid);
    assert!(
        probes.is_job_pid(tid),
        "the job's thread {tid} is not marked before its exec"
    );
    while std::fs::read_to_string(format!("/proc/{root_pid}/comm"))
        .unwrap_or_default()
        .trim()
        != "sleep"
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the thread's exec of sleep never happened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // comm changes before the exec tracepoint fires: wait for the unmark a little.
    let t1 = std::time::Instant::now();
    while probes.is_job_pid(tid) && t1.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !probes.is_job_pid(tid),
        "the exec'ing thread's old tid {tid} is still marked"
    );
    assert!(
        probes.is_job_pid(root_pid),
        "the process {root_pid} left the job at its thread's exec"
    );
    assert!(root.wait().unwrap().success());
    assert_eq!(probes.job_pid_count(), 0, "marks left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The probes loaded in this process (`NANTRACE_PROBE_PATH` honoured), to read `JOB_MAP`.
fn probes_in_process() -> nantrace::probes::Probes {
    nantrace::probes::Probes::load(&nantrace::probes::Options::default())
        .expect("loading the probes")
}

/// The sweep (`Probes::sweep_exited`, run by the sweep thread every 5 s) removes the mark of
/// a task that no longer exists, the mark a skipped exit program leaves (kernel 7.3), and
/// counts it; a live task's mark stays.
#[test]
fn the_mark_of_a_task_gone_is_swept_and_counted() {
    if !privileged("the_mark_of_a_task_gone_is_swept_and_counted") {
        return;
    }
    let probes = probes_in_process();
    let gone = (300_000u32..4_000_000)
        .step_by(7919)
        .find(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
        .expect("a pid no task has");
    let me = std::process::id();
    let before = probes.membership_losses()["stale_marks_removed"];
    let mut probes = probes;
    probes.add_job_pid(gone).unwrap();
    probes.add_job_pid(me).unwrap();
    assert_eq!(probes.sweep_exited(), 1);
    assert!(!probes.is_job_pid(gone), "the mark of pid {gone} (no task) stayed");
    assert!(probes.is_job_pid(me), "a live task's mark was swept");
    assert_eq!(
        probes.membership_losses()["stale_marks_removed"],
        before + 1
    );
    probes.remove_job_pid(me).unwrap();
}
