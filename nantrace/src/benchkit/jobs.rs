//! The kernel tests' jobs with a particular thread life: processes whose main thread ends
//! first, or whose last thread is not the leader, or a thread that execs.

/// The kernel tests' jobs with a particular thread life (`bench-internal leader-exit`,
/// `thread-exec`, `thread-exit-last`); they end the process.
pub fn test_job(what: &str, dir: &std::path::Path) -> ! {
    match what {
        "leader-exit" => leader_exit(),
        "thread-exec" => thread_exec(dir),
        _ => thread_exit_last(),
    }
}

/// `bench-internal leader-exit` (a test's job): the main thread ends first (the `exit`
/// syscall, not `exit_group`, as pthread_exit in the main thread does), then another thread
/// of the process runs /bin/true and ends the process with code 5.
fn leader_exit() -> ! {
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_millis(300));
        let _ = std::process::Command::new("/bin/true").status();
        std::process::exit(5);
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    // SAFETY: ends the calling thread only, holding no lock; the other thread ends the process.
    unsafe { libc::syscall(libc::SYS_exit, 0) };
    unreachable!("the exit syscall returned")
}

/// `bench-internal thread-exit-last` (a test's job): the main thread ends with the `exit`
/// syscall (code 0), then the other thread ends with the `exit` syscall and code 7, without
/// exit_group (wait(2) reports 7 since 6.0, the leader's 0 before).
fn thread_exit_last() -> ! {
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_millis(300));
        // SAFETY: ends this thread only; it is the process's last.
        unsafe { libc::syscall(libc::SYS_exit, 7) };
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    // SAFETY: ends the calling thread only, holding no lock.
    unsafe { libc::syscall(libc::SYS_exit, 0) };
    unreachable!("the exit syscall returned")
}

/// `bench-internal thread-exec` (a test's job): a thread other than the main one writes its
/// tid to `dir/tid`, waits 300 ms and execs `sleep 0.5`: the process keeps its pid, and the
/// thread's old tid ends without an exit of its own.
fn thread_exec(dir: &std::path::Path) -> ! {
    use std::os::unix::process::CommandExt as _;
    let dir = dir.to_path_buf();
    let t = std::thread::spawn(move || {
        // SAFETY: no arguments, no failure mode.
        let tid = unsafe { libc::gettid() };
        let _ = std::fs::write(dir.join("tid"), tid.to_string());
        std::thread::sleep(std::time::Duration::from_millis(300));
        let e = std::process::Command::new("sleep").arg("0.5").exec();
        eprintln!("thread-exec: exec sleep: {e}");
        std::process::exit(3);
    });
    let _ = t.join();
    std::process::exit(4)
}
