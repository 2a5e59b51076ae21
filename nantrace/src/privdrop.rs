//! Who the job runs as (redteam 4.12). nantrace needs root for its probes; the job must never
//! get more privilege than the person who started nantrace:
//! - started through sudo (euid 0, `SUDO_UID` set): the job runs as `SUDO_UID`/`SUDO_GID`
//!   with that user's supplementary groups and HOME/USER/LOGNAME, the rest of the environment
//!   as sudo passed it;
//! - a set-uid root binary (uid ≠ euid): the job runs as the real uid;
//! - `--user NAME|UID`: the job runs as that user (the agent, a root shell);
//! - `--as-root`: the job keeps root, on purpose, with a warning;
//! - a plain root shell without sudo: the person is root, the job runs as root.
use std::ffi::{CStr, CString};
use std::io;

use anyhow::{bail, Context as _};

/// The identity the job is switched to before exec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (getgrouplist of the user; just `gid` when the user has no name).
    pub groups: Vec<libc::gid_t>,
    pub name: Option<String>,
    pub home: Option<String>,
    /// Why this identity was chosen, for the banner.
    pub why: String,
}

/// What the command line asked for.
#[derive(Clone, Debug, Default)]
pub enum Choice {
    #[default]
    Auto,
    User(String),
    AsRoot,
}

struct Pw {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

fn pw_lookup(by: Result<u32, &str>) -> Option<Pw> {
    // SAFETY: zeroed passwd is a valid out-parameter; buf outlives the use of its pointers.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut res: *mut libc::passwd = std::ptr::null_mut();
    let mut buf = vec![0u8; 16 * 1024];
    let rc = match by {
        // SAFETY: valid pointers and buffer length.
        Ok(uid) => unsafe {
            libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut res)
        },
        Err(name) => {
            let c = CString::new(name).ok()?;
            // SAFETY: valid NUL-terminated name, pointers and buffer length.
            unsafe {
                libc::getpwnam_r(
                    c.as_ptr(),
                    &mut pw,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    &mut res,
                )
            }
        }
    };
    if rc != 0 || res.is_null() {
        return None;
    }
    // SAFETY: on success pw_name and pw_dir point to NUL-terminated strings inside buf.
    let (name, home) = unsafe {
        (
            CStr::from_ptr(pw.pw_name).to_string_lossy().into_owned(),
            CStr::from_ptr(pw.pw_dir).to_string_lossy().into_owned(),
        )
    };
    Some(Pw {
        name,
        uid: pw.pw_uid,
        gid: pw.pw_gid,
        home,
    })
}

fn grouplist(name: &str, gid: u32) -> Vec<libc::gid_t> {
    let Ok(c) = CString::new(name) else {
        return vec![gid];
    };
    let mut n: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let asked = n;
        // SAFETY: groups has room for n entries; getgrouplist writes at most n and sets n.
        let rc = unsafe { libc::getgrouplist(c.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
        if rc >= 0 {
            groups.truncate(n.max(0) as usize);
            if !groups.contains(&gid) {
                groups.insert(0, gid);
            }
            return groups;
        }
        if n <= asked {
            n = asked * 2;
        }
        if n > 65_536 {
            return vec![gid];
        }
    }
}

fn euid() -> u32 {
    // SAFETY: no failure mode.
    unsafe { libc::geteuid() }
}

fn ruid() -> u32 {
    // SAFETY: no failure mode.
    unsafe { libc::getuid() }
}

fn for_uid(uid: u32, gid: Option<u32>, why: String) -> RunAs {
    let pw = pw_lookup(Ok(uid));
    let gid = gid.or(pw.as_ref().map(|p| p.gid)).unwrap_or(uid);
    let groups = pw
        .as_ref()
        .map_or_else(|| vec![gid], |p| grouplist(&p.name, gid));
    RunAs {
        uid,
        gid,
        groups,
        name: pw.as_ref().map(|p| p.name.clone()),
        home: pw.map(|p| p.home),
        why,
    }
}

/// Resolve the job's identity from the command line and nantrace's own environment.
/// `Ok(None)`: the job runs as nantrace itself.
pub fn resolve(
    choice: &Choice,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<RunAs>> {
    let root = euid() == 0;
    // Started through sudo by someone else than root: that person may not choose a more
    // privileged identity for the job (a sudoers rule for `nantrace run *` allows any flag).
    let sudo_caller = env("SUDO_UID")
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|u| root && *u != 0);
    match choice {
        Choice::AsRoot if sudo_caller.is_some() => {
            bail!("--as-root: nantrace was started through sudo by uid {}, and the job may not get more privilege than its caller (a root shell opened with `sudo -i` keeps SUDO_UID: there, use `env -u SUDO_UID nantrace run --as-root ...`)", sudo_caller.unwrap_or(0))
        }
        Choice::AsRoot => {
            if root {
                crate::say!("nantrace: WARNING: --as-root: the job runs as root (uid 0), with every privilege nantrace has");
            }
            Ok(None)
        }
        Choice::User(u) => {
            let by = u.parse::<u32>().map_err(|_| u.as_str());
            let ra = match (pw_lookup(by), by) {
                (Some(p), _) => RunAs {
                    groups: grouplist(&p.name, p.gid),
                    uid: p.uid,
                    gid: p.gid,
                    name: Some(p.name),
                    home: Some(p.home),
                    why: format!("--user {u}"),
                },
                (None, Ok(uid)) => for_uid(uid, None, format!("--user {u}")),
                (None, Err(_)) => bail!("--user {u:?}: no such user"),
            };
            if let Some(caller) = sudo_caller.filter(|c| *c != ra.uid) {
                bail!("--user {u}: nantrace was started through sudo by uid {caller}; the job runs as that user, not as another");
            }
            if !root {
                if ra.uid != euid() {
                    bail!("--user {u}: switching to another user needs root");
                }
                return Ok(None);
            }
            Ok((ra.uid != 0).then_some(ra))
        }
        Choice::Auto => {
            if !root {
                return Ok(None);
            }
            if let Some(s) = env("SUDO_UID") {
                let uid: u32 = s
                    .trim()
                    .parse()
                    .with_context(|| format!("SUDO_UID={s:?} is not a uid"))?;
                if uid == 0 {
                    return Ok(None);
                }
                let gid = match env("SUDO_GID") {
                    Some(g) => Some(
                        g.trim()
                            .parse::<u32>()
                            .with_context(|| format!("SUDO_GID={g:?} is not a gid"))?,
                    ),
                    None => None,
                };
                let mut ra = for_uid(uid, gid, format!("started through sudo by uid {uid}"));
                // sudo's SUDO_USER names the caller; the name from the uid wins when they differ.
                if ra.name.is_none() {
                    if let Some(p) = env("SUDO_USER")
                        .and_then(|n| pw_lookup(Err(&n)))
                        .filter(|p| p.uid == uid)
                    {
                        ra.groups = grouplist(&p.name, ra.gid);
                        ra.name = Some(p.name);
                        ra.home = Some(p.home);
                    }
                }
                return Ok(Some(ra));
            }
            let r = ruid();
            if r != 0 {
                return Ok(Some(for_uid(
                    r,
                    None,
                    format!("set-uid binary started by uid {r}"),
                )));
            }
            Ok(None)
        }
    }
}

impl RunAs {
    /// Make `cmd` switch to this identity in the child, between fork and exec.
    pub fn apply(&self, cmd: &mut std::process::Command) {
        use std::os::unix::process::CommandExt as _;
        let user = self.name.clone().unwrap_or_else(|| self.uid.to_string());
        cmd.env("HOME", self.home.clone().unwrap_or_else(|| "/".into()))
            .env("USER", &user)
            .env("LOGNAME", &user);
        let (uid, gid, groups) = (self.uid, self.gid, self.groups.clone());
        // SAFETY: the closure runs in the child between fork and exec and only makes
        // async-signal-safe system calls (setgroups, setresgid, setresuid, getresuid) on data
        // prepared before the fork; it allocates nothing. Order matters: supplementary groups
        // and the gid can only be changed while still root, so the uid goes last.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::setresgid(gid, gid, gid) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::setresuid(uid, uid, uid) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // Check that it took, including the saved set-user-id.
                let (mut r, mut e, mut s) = (0, 0, 0);
                if libc::getresuid(&mut r, &mut e, &mut s) != 0 || r != uid || e != uid || s != uid
                {
                    return Err(io::Error::from_raw_os_error(libc::EPERM));
                }
                if uid != 0 && libc::setuid(0) == 0 {
                    return Err(io::Error::from_raw_os_error(libc::EPERM));
                }
                Ok(())
            });
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "uid {} gid {} ({}; groups {:?})",
            self.uid, self.gid, self.why, self.groups
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sudo_caller_is_found() {
        if euid() != 0 {
            return;
        }
        let env = |k: &str| match k {
            "SUDO_UID" => Some("65534".to_string()),
            "SUDO_GID" => Some("65534".to_string()),
            _ => None,
        };
        let ra = resolve(&Choice::Auto, env).unwrap().expect("drops");
        assert_eq!((ra.uid, ra.gid), (65534, 65534));
        assert!(ra.groups.contains(&65534));
        assert!(resolve(&Choice::Auto, |k| (k == "SUDO_UID")
            .then(|| "0".to_string()))
        .unwrap()
        .is_none());
        assert!(resolve(&Choice::Auto, |k| (k == "SUDO_UID")
            .then(|| "x".to_string()))
        .is_err());
        // Through sudo, the caller cannot pick more privilege (or someone else).
        assert!(resolve(&Choice::AsRoot, env).is_err());
        assert!(resolve(&Choice::User("0".into()), env).is_err());
        assert!(resolve(&Choice::User("4000000".into()), env).is_err());
        assert_eq!(
            resolve(&Choice::User("65534".into()), env)
                .unwrap()
                .unwrap()
                .uid,
            65534
        );
        // From a root shell (no sudo) they can.
        let none = |_: &str| None;
        assert!(resolve(&Choice::AsRoot, none).unwrap().is_none());
        assert_eq!(
            resolve(&Choice::User("4000000".into()), none)
                .unwrap()
                .unwrap()
                .gid,
            4_000_000
        );
        assert!(resolve(&Choice::User("no-such-user-xyz".into()), none).is_err());
    }
}
