//! The job's stdio and log paths: one pipe for stdout and stderr when nantrace's own lead to
//! one file, the terminal's own signals, `--log` checks.
use anyhow::Context as _;
use std::os::unix::fs::FileTypeExt as _;

/// Do nantrace's stdout and stderr lead to the same file (`2>&1`, one terminal)?
pub(super) fn same_destination() -> bool {
    // SAFETY: fstat on our own descriptors with valid out-parameters.
    unsafe {
        let (mut a, mut b): (libc::stat, libc::stat) = (std::mem::zeroed(), std::mem::zeroed());
        libc::fstat(1, &mut a) == 0
            && libc::fstat(2, &mut b) == 0
            && a.st_dev == b.st_dev
            && a.st_ino == b.st_ino
    }
}

/// Give the job one pipe for stdout and stderr; returns its read end (non-blocking, async).
pub(super) fn one_pipe_for_both(
    cmd: &mut tokio::process::Command,
) -> Option<tokio::net::unix::pipe::Receiver> {
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
    unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&r),
            libc::F_SETFL,
            libc::O_NONBLOCK,
        )
    };
    let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(r).ok()?;
    cmd.stdout(std::process::Stdio::from(w))
        .stderr(std::process::Stdio::from(w2));
    Some(rx)
}

/// True when a terminal's own SIGINT/SIGHUP reached the job already: nantrace is in the
/// terminal's foreground process group, which the job shares.
pub(super) fn job_got_it_from_the_terminal() -> bool {
    for fd in [0, 2] {
        // SAFETY: isatty/tcgetpgrp/getpgrp only read kernel state for a descriptor we hold.
        unsafe {
            if libc::isatty(fd) == 1 {
                let fg = libc::tcgetpgrp(fd);
                return fg > 0 && fg == libc::getpgrp();
            }
        }
    }
    false
}

/// `--log` that can never be read is an error; one that does not exist yet is waited for
/// (redteam 1.11, 1.12, 1.14).
pub(super) fn check_log(l: &std::path::Path) -> anyhow::Result<()> {
    match std::fs::metadata(l) {
        Ok(m) if m.is_dir() => {
            anyhow::bail!("--log {} is a directory, not a log file", l.display())
        }
        Ok(m) if m.file_type().is_fifo() || m.is_file() => {
            // O_NONBLOCK: opening a FIFO without a writer must not block the check.
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(l)
                .with_context(|| format!("--log {} cannot be read", l.display()))?;
            Ok(())
        }
        Ok(_) => anyhow::bail!("--log {} is not a regular file or a pipe", l.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::say!(
                "nantrace: --log {} does not exist yet: waiting for it",
                l.display()
            );
            Ok(())
        }
        Err(e) => Err(e).with_context(|| format!("--log {}", l.display())),
    }
}
