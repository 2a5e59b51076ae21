//! The job's stdout and stderr: one pipe for both when nantrace's own lead to one file.
/// Do nantrace's stdout and stderr lead to the same file (`2>&1`, one terminal)?
pub(super) fn same_destination() -> bool {
    // SAFETY: fstat on our own descriptors with valid out-parameters.
    unsafe {
        let (mut a, mut b): (libc::stat, libc::stat) = (std::mem::zeroed(), std::mem::zeroed());
        libc::fstat(1, &mut a) == 0 && libc::fstat(2, &mut b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino
    }
}

/// Give the job one pipe for stdout and stderr; returns its read end (non-blocking, async).
pub(super) fn one_pipe_for_both(cmd: &mut tokio::process::Command) -> Option<tokio::net::unix::pipe::Receiver> {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: fresh descriptors from pipe2, owned once each.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let w2 = w.try_clone().ok()?;
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&r), libc::F_SETFL, libc::O_NONBLOCK) };
    let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(r).ok()?;
    cmd.stdout(std::process::Stdio::from(w)).stderr(std::process::Stdio::from(w2));
    Some(rx)
}

