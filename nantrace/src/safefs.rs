//! Writing files as root in directories other people can write to, without following their
//! symlinks or writing into their files (redteam report 4.7, 4.9–4.11, 4.13, 4.14, 5.24, 6.13).
//!
//! The rules, in one place:
//! - a file is created with `O_NOFOLLOW|O_CREAT|O_EXCL`, mode 0600, relative to a directory
//!   file descriptor; or written under a fresh name and renamed over the old one (rename
//!   replaces a symlink, it never follows it);
//! - that directory is one nantrace created itself (mkdir 0700, then opened `O_NOFOLLOW` and
//!   its owner checked), or one that already belongs to us and that nobody else can write;
//! - nantrace never chmods a directory it did not create;
//! - names that come from the machine (hostnames) go through [`sanitize`] first;
//! - final names are claimed with `renameat2(RENAME_NOREPLACE)`: no exists()-then-rename race.
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

fn cstr(s: &[u8]) -> io::Result<CString> {
    CString::new(s)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains a NUL byte"))
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn euid() -> u32 {
    // SAFETY: geteuid has no failure mode.
    unsafe { libc::geteuid() }
}

/// A name that is safe as one path component: no `/`, no `..`, no control characters, no
/// leading dot, at most 64 bytes. Anything else becomes `_`; an empty result is `fallback`.
pub fn sanitize(name: &str, fallback: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    while s.contains("..") {
        s = s.replace("..", "_");
    }
    let s = s.trim_start_matches('.');
    let s: String = s.chars().take(64).collect();
    if s.is_empty() {
        fallback.to_string()
    } else {
        s
    }
}

fn random_suffix() -> String {
    let mut b = [0u8; 6];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // Not a secret, only a name: the time is good enough as a fallback.
        let t = crate::clock::monotonic_ns().to_le_bytes();
        b.copy_from_slice(&t[..6]);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An open directory that files are written relative to.
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Open an existing directory (following symlinks in `path`: the caller named it).
    pub fn open(path: &Path) -> io::Result<Dir> {
        let c = cstr(path.as_os_str().as_bytes())?;
        // SAFETY: c is a valid NUL-terminated path; the returned fd is owned below.
        let fd = cvt(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        Ok(Dir {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_path_buf(),
        })
    }

    fn stat(&self) -> io::Result<libc::stat> {
        // SAFETY: zeroed stat is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and pointer.
        cvt(unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) })?;
        Ok(st)
    }

    /// Open a directory that must already be ours: owned by our euid and writable by nobody
    /// else (so no one can plant a symlink in it between our check and our write).
    pub fn open_private(path: &Path) -> io::Result<Dir> {
        let d = Dir::open(path)?;
        let st = d.stat()?;
        if st.st_uid != euid() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} belongs to uid {}, not to us (uid {}): refusing to write into it",
                    path.display(),
                    st.st_uid,
                    euid()
                ),
            ));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} is writable by others (mode {:o}): refusing to write into it",
                    path.display(),
                    st.st_mode & 0o7777
                ),
            ));
        }
        Ok(d)
    }

    /// Create the subdirectory `name` (mode 0700; fails if the name exists, even as a
    /// dangling symlink) and open it without following symlinks, checking it is ours.
    pub fn create_subdir(&self, name: &str) -> io::Result<Dir> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid dirfd and NUL-terminated name.
        cvt(unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), 0o700) })?;
        // SAFETY: as above; O_NOFOLLOW: if someone swapped our new directory for a symlink
        // we fail instead of following it.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: fd is fresh and owned here.
        let d = Dir {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: self.path.join(name),
        };
        let st = d.stat()?;
        if st.st_uid != euid() || st.st_mode & 0o077 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} was replaced while being created", d.path.display()),
            ));
        }
        Ok(d)
    }

    /// Create a fresh private subdirectory named `<prefix><random>`.
    pub fn create_temp_subdir(&self, prefix: &str) -> io::Result<(Dir, String)> {
        let mut last = None;
        for _ in 0..16 {
            let name = format!("{prefix}{}", random_suffix());
            match self.create_subdir(&name) {
                Ok(d) => return Ok((d, name)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free temporary name")))
    }

    /// Open the subdirectory `name` without following a link, and check it is ours.
    pub fn open_subdir(&self, name: &str) -> io::Result<Dir> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid dirfd and NUL-terminated name; O_NOFOLLOW: a link is an error.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: fd is fresh and owned here.
        let d = Dir {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: self.path.join(name),
        };
        if d.stat()?.st_uid != euid() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is not ours", d.path.display()),
            ));
        }
        Ok(d)
    }

    /// flock(2) this directory: exclusive, held while the descriptor lives (a bundle being
    /// written holds it; `bundle::recover` tells a dead writer's directory by getting it).
    /// With `wait` false, `Ok(false)` when another process holds it.
    pub fn lock(&self, wait: bool) -> io::Result<bool> {
        let op = libc::LOCK_EX | if wait { 0 } else { libc::LOCK_NB };
        // SAFETY: a valid descriptor.
        match cvt(unsafe { libc::flock(self.fd.as_raw_fd(), op) }) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The directory's modification time, and setting it back (a note written into it must
    /// not make an old bundle the spool's newest).
    pub fn modified(&self) -> io::Result<libc::timespec> {
        let st = self.stat()?;
        Ok(libc::timespec {
            tv_sec: st.st_mtime,
            tv_nsec: st.st_mtime_nsec,
        })
    }

    pub fn set_modified(&self, t: libc::timespec) -> io::Result<()> {
        let times = [
            libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            },
            t,
        ];
        // SAFETY: a valid descriptor and two timespecs.
        cvt(unsafe { libc::futimens(self.fd.as_raw_fd(), times.as_ptr()) }).map(|_| ())
    }

    /// Create `name` with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, and stream into it with
    /// `fill` (a buffered writer). On error the half-written file is removed. Returns the
    /// bytes written.
    pub fn write_with(
        &self,
        name: &str,
        fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<u64> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid dirfd and NUL-terminated name; the fd is owned by the File below.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        })?;
        // SAFETY: fd is fresh and owned by the File.
        let f = unsafe { File::from_raw_fd(fd) };
        let mut w = io::BufWriter::with_capacity(1 << 20, f);
        let r = fill(&mut w)
            .and_then(|()| w.flush())
            .and_then(|()| w.get_ref().sync_all())
            .and_then(|()| w.get_ref().metadata().map(|m| m.len()));
        if r.is_err() {
            let _ = self.remove(name);
        }
        r
    }

    /// Create `name` with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, and write `data` to it.
    pub fn write_new(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid dirfd and NUL-terminated name; the fd is owned by the File below.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        })?;
        // SAFETY: fd is fresh and owned by the File.
        let mut f = unsafe { File::from_raw_fd(fd) };
        let r = f.write_all(data).and_then(|()| f.sync_all());
        if r.is_err() {
            // A half-written file is worse than none (a full disk leaves no zero-byte files).
            let _ = self.remove(name);
        }
        r
    }

    /// Replace `name` atomically: write a fresh temporary file, then rename it over `name`
    /// (rename replaces a symlink named `name`; it never writes through it).
    pub fn replace(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let tmp = format!(".{name}.tmp-{}", random_suffix());
        self.write_new(&tmp, data)?;
        let (a, b) = (cstr(tmp.as_bytes())?, cstr(name.as_bytes())?);
        // SAFETY: valid dirfds and names.
        let r = cvt(unsafe {
            libc::renameat(
                self.fd.as_raw_fd(),
                a.as_ptr(),
                self.fd.as_raw_fd(),
                b.as_ptr(),
            )
        });
        if r.is_err() {
            let _ = self.remove(&tmp);
        }
        r.map(|_| ())
    }

    /// Create `name` with `data` whole or not at all: a fresh temporary file, then a hard link
    /// to `name`, which fails with EEXIST when `name` is there (on NFS and 9p too, where
    /// `renameat2`'s RENAME_NOREPLACE is not), so nobody ever sees `name` half written.
    pub fn create_whole(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let tmp = format!(".{name}.tmp-{}", random_suffix());
        self.write_new(&tmp, data)?;
        let (a, b) = (cstr(tmp.as_bytes())?, cstr(name.as_bytes())?);
        // SAFETY: valid dirfds and names; flags 0: a link to `tmp` itself, never followed.
        let r = cvt(unsafe {
            libc::linkat(
                self.fd.as_raw_fd(),
                a.as_ptr(),
                self.fd.as_raw_fd(),
                b.as_ptr(),
                0,
            )
        });
        let _ = self.remove(&tmp);
        match r {
            Ok(_) => Ok(()),
            // A filesystem without hard links (CIFS, object-store FUSE mounts): O_EXCL, then
            // the write (a writer killed between the two leaves an empty file).
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EPERM | libc::ENOTSUP | libc::ENOSYS | libc::EMLINK)
                ) =>
            {
                self.write_new(name, data)
            }
            Err(e) => Err(e),
        }
    }

    pub fn remove(&self, name: &str) -> io::Result<()> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid dirfd and name.
        cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) }).map(|_| ())
    }

    pub fn remove_dir(&self, name: &str) -> io::Result<()> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid dirfd and name.
        cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) })
            .map(|_| ())
    }

    /// Rename `from` to `to` inside this directory, failing if `to` exists in any form.
    pub fn rename_noreplace(&self, from: &str, to: &str) -> io::Result<()> {
        let (a, b) = (cstr(from.as_bytes())?, cstr(to.as_bytes())?);
        // SAFETY: valid dirfds and names.
        cvt(unsafe {
            libc::renameat2(
                self.fd.as_raw_fd(),
                a.as_ptr(),
                self.fd.as_raw_fd(),
                b.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        })
        .map(|_| ())
    }
}

/// Check an output directory before any work is done (redteam 1.19, 1.20, 1.24): it exists or
/// can be created, it is a directory, and a subdirectory can be made in it.
pub fn check_out_dir(out: &Path) -> io::Result<()> {
    let err = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    if let Ok(m) = std::fs::symlink_metadata(out) {
        if !m.is_dir() && !out.is_dir() {
            return Err(err(format!(
                "--out {} exists and is not a directory",
                out.display()
            )));
        }
    }
    std::fs::create_dir_all(out)
        .map_err(|e| err(format!("--out {}: cannot create it: {e}", out.display())))?;
    let d = Dir::open(out).map_err(|e| err(format!("--out {}: {e}", out.display())))?;
    let (_probe, name) = d
        .create_temp_subdir(".nantrace-writable-")
        .map_err(|e| err(format!("--out {} is not writable: {e}", out.display())))?;
    d.remove_dir(&name)?;
    Ok(())
}

/// Write `path` (mode 0600) without following a symlink at `path` and without writing into a
/// file someone else created: in a directory that is ours alone the old file is replaced by
/// rename; anywhere else (e.g. /tmp) the file must not exist yet.
pub fn write_file_0600(path: &Path, data: &[u8]) -> io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a file name", path.display()),
        )
    })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(d) = Dir::open_private(parent) {
        return d.replace(name, data);
    }
    let d = Dir::open(parent)?;
    d.write_new(name, data).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            io::Error::new(e.kind(), format!("{} already exists in a directory others can write to: refusing to overwrite it (remove it, or write into a directory only you can write)", path.display()))
        } else {
            e
        }
    })
}

/// True when `a` is `b` or lies inside it (both resolved; a path that does not exist yet is
/// resolved through its nearest existing ancestor).
pub fn is_within(a: &Path, b: &Path) -> bool {
    fn resolve(p: &Path) -> Option<PathBuf> {
        if let Ok(c) = p.canonicalize() {
            return Some(c);
        }
        let parent = p
            .parent()
            .filter(|x| !x.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        Some(resolve(parent)?.join(p.file_name()?))
    }
    match (resolve(a), resolve(b)) {
        (Some(a), Some(b)) => a.starts_with(b),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_the_machine_cannot_escape() {
        assert_eq!(sanitize("../../escaped", "host"), "____escaped");
        assert_eq!(
            sanitize("gpu-node-07.cluster.local", "host"),
            "gpu-node-07.cluster.local"
        );
        assert_eq!(sanitize("a/b\n\x1b[2J", "host"), "a_b___2J");
        assert_eq!(sanitize("", "host"), "host");
        assert_eq!(sanitize("..", "host"), "_");
        assert_eq!(sanitize(".hidden", "host"), "hidden");
        for s in ["../x", "....", "a/../b", "\u{202e}x"] {
            let n = sanitize(s, "host");
            assert!(
                !n.contains('/') && !n.contains("..") && !n.starts_with('.'),
                "{s:?} -> {n:?}"
            );
        }
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("nantrace-safefs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).unwrap();
        p
    }

    #[test]
    fn write_new_refuses_symlinks_and_existing_files() {
        let p = tmpdir("new");
        let victim = p.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, p.join("link")).unwrap();
        let d = Dir::open(&p).unwrap();
        assert!(d.write_new("link", b"evil").is_err());
        assert!(d.write_new("victim", b"evil").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        d.write_new("fresh", b"ok").unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(p.join("fresh"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600
        );
        // replace: the symlink is replaced, its target untouched.
        d.replace("link", b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(std::fs::read_to_string(p.join("link")).unwrap(), "new");
        assert!(!std::fs::symlink_metadata(p.join("link"))
            .unwrap()
            .file_type()
            .is_symlink());
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn rename_noreplace_does_not_clobber_a_dangling_symlink() {
        let p = tmpdir("rn");
        std::os::unix::fs::symlink("/nonexistent", p.join("taken")).unwrap();
        let d = Dir::open(&p).unwrap();
        let (_t, tmp) = d.create_temp_subdir(".t-").unwrap();
        assert_eq!(
            d.rename_noreplace(&tmp, "taken").unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        d.rename_noreplace(&tmp, "free").unwrap();
        assert!(p.join("free").is_dir());
        std::fs::remove_dir_all(&p).unwrap();
    }

    #[test]
    fn within() {
        let p = tmpdir("within");
        assert!(is_within(&p, &p));
        assert!(is_within(&p.join("sub/new"), &p));
        assert!(is_within(&p.join("."), &p));
        assert!(!is_within(&std::env::temp_dir(), &p));
        std::fs::remove_dir_all(&p).unwrap();
    }
}
