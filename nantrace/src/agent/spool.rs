//! The spool: bundles under one 0700 directory, kept within a size and an age limit, oldest
//! first; a bundle being written (a `.nantrace-*.tmp-*` directory) is never removed, nor the
//! newest bundle.
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use std::time::SystemTime;

/// Bytes under `p`, links not followed.
fn du(p: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if !m.is_dir() {
        return m.len();
    }
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| du(&e.path()))
        .sum::<u64>()
        + m.len()
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Usage {
    pub bundles: usize,
    pub bytes: u64,
    pub in_progress: usize,
    /// Bundles kept incomplete: a dead writer's, or one whose files a full disk refused
    /// (`bundle::recover`). Counted in `bundles` and `bytes` too, and evicted like the others.
    pub incomplete: usize,
}

/// The bundles in the spool, oldest first: (path, bytes, modified).
pub fn bundles(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let mut v: Vec<(PathBuf, u64, SystemTime)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name().to_string_lossy().starts_with("nantrace-")
                && e.file_type().is_ok_and(|t| t.is_dir())
        })
        .map(|e| {
            let p = e.path();
            let t = std::fs::symlink_metadata(&p)
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            (p.clone(), du(&p), t)
        })
        .collect();
    v.sort_by_key(|b| (b.2, b.0.clone()));
    v
}

pub fn usage(dir: &Path) -> Usage {
    let b = bundles(dir);
    let in_progress = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".nantrace-"))
        .count();
    let incomplete = b
        .iter()
        .filter(|x| {
            x.0.file_name()
                .is_some_and(|n| crate::bundle::recover::is_incomplete(&n.to_string_lossy()))
        })
        .count();
    Usage {
        bundles: b.len(),
        bytes: b.iter().map(|x| x.1).sum(),
        in_progress,
        incomplete,
    }
}

/// Room for a bundle that a full disk refused (redteam3 D-12): a quarter of the spool's
/// bytes, at least one bundle, taken as [`enforce`] takes them (the biggest user's oldest
/// first, never the newest).
pub fn make_room(
    dir: &Path,
    uid_of: &dyn Fn(&Path) -> Option<u32>,
    spare: Option<&Path>,
) -> Vec<PathBuf> {
    let total: u64 = bundles(dir)
        .iter()
        .filter(|b| Some(b.0.as_path()) != spare)
        .map(|b| b.1)
        .sum();
    enforce_sparing(
        dir,
        total.saturating_sub((total / 4).max(1)),
        0.0,
        uid_of,
        spare,
    )
}

/// The job user's uid a bundle records (`"uid": N` in the head of its timeline.json).
pub fn bundle_uid(b: &Path) -> Option<u32> {
    use std::io::Read as _;
    let mut head = vec![0u8; 16 << 10];
    let n = std::fs::File::open(b.join("timeline.json"))
        .and_then(|mut f| f.read(&mut head))
        .ok()?;
    let text = String::from_utf8_lossy(&head[..n]);
    let i = text.find("\"uid\": ")?;
    text[i + 7..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Remove bundles older than `max_age_s` (0: no age limit), then, while the spool is over
/// `max_bytes`, the oldest bundle of the user whose bundles take the most room: one user's
/// incidents do not push out another's (review 10). The newest bundle always stays. Returns
/// what was removed.
pub fn enforce(
    dir: &Path,
    max_bytes: u64,
    max_age_s: f64,
    uid_of: &dyn Fn(&Path) -> Option<u32>,
) -> Vec<PathBuf> {
    enforce_sparing(dir, max_bytes, max_age_s, uid_of, None)
}

/// As [`enforce`], never removing `spare` either (a dump's own first attempt).
fn enforce_sparing(
    dir: &Path,
    max_bytes: u64,
    max_age_s: f64,
    uid_of: &dyn Fn(&Path) -> Option<u32>,
    spare: Option<&Path>,
) -> Vec<PathBuf> {
    let mut b = bundles(dir);
    // The newest bundle of all stays (usually the spared one itself: the dump in progress).
    let newest = b.last().map(|x| x.0.clone());
    if let Some(s) = spare {
        b.retain(|x| x.0 != s);
    }
    let now = SystemTime::now();
    let mut removed = Vec::new();
    // remove_dir_all does not follow links inside the bundle.
    b.retain(|(p, _, t)| {
        let old = max_age_s > 0.0
            && now
                .duration_since(*t)
                .is_ok_and(|d| d.as_secs_f64() > max_age_s);
        if old && Some(p) != newest.as_ref() && std::fs::remove_dir_all(p).is_ok() {
            removed.push(p.clone());
            return false;
        }
        true
    });
    let mut total: u64 = b.iter().map(|x| x.1).sum();
    let owner: Vec<u32> = b.iter().map(|x| uid_of(&x.0).unwrap_or(u32::MAX)).collect();
    let mut gone = vec![false; b.len()];
    while total > max_bytes {
        let mut per: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
        for (i, x) in b.iter().enumerate() {
            if !gone[i] && Some(&x.0) != newest.as_ref() {
                *per.entry(owner[i]).or_default() += x.1;
            }
        }
        let Some((&uid, _)) = per.iter().max_by_key(|(_, v)| **v) else {
            break;
        };
        let Some(i) =
            (0..b.len()).find(|&i| !gone[i] && owner[i] == uid && Some(&b[i].0) != newest.as_ref())
        else {
            break;
        };
        gone[i] = true;
        if std::fs::remove_dir_all(&b[i].0).is_ok() {
            total = total.saturating_sub(b[i].1);
            removed.push(b[i].0.clone());
        }
    }
    removed
}

/// Older bundles are removed for a dump that a full disk refused at most this often.
const ROOM_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

/// The sessions' hook for a full disk: older bundles go ([`make_room`]), counted and said; at
/// most once in ROOM_EVERY, so a disk that someone else keeps full does not drain the spool a
/// quarter per incident (the evidence of every other incident with it).
pub(super) fn room_hook(
    dir: PathBuf,
    metrics: std::sync::Arc<super::Metrics>,
) -> crate::session::RoomHook {
    use std::sync::atomic::{AtomicU64, Ordering};
    let last = std::sync::Arc::new(AtomicU64::new(0));
    std::sync::Arc::new(move |spare: Option<&Path>| {
        let now = crate::clock::monotonic_ns();
        let prev = last.load(Ordering::SeqCst);
        if prev != 0 && now.saturating_sub(prev) < ROOM_EVERY.as_nanos() as u64 {
            crate::say!("nantrace: spool: the disk is still full; older bundles were removed for room {} s ago, none removed now", now.saturating_sub(prev) / 1_000_000_000);
            return Vec::new();
        }
        let removed = make_room(&dir, &bundle_uid, spare);
        if !removed.is_empty() {
            last.store(now, Ordering::SeqCst);
        }
        for r in &removed {
            crate::say!(
                "nantrace: spool: removed {} (the disk is full)",
                r.display()
            );
        }
        metrics.add("nantrace_spool_removed_total", &[], removed.len() as f64);
        removed
    })
}

/// The spool directory: created 0700; an existing one must be a real directory of ours.
pub(super) fn open_spool(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    // SAFETY: geteuid has no failure mode.
    let me = unsafe { libc::geteuid() };
    if std::fs::symlink_metadata(dir).is_err() {
        // The part that exists is checked first; then each missing level is made by us, one
        // at a time and never through a link (re-review D5: creating first followed a user's
        // link as root).
        let abs = if dir.is_absolute() {
            dir.to_path_buf()
        } else {
            std::env::current_dir()?.join(dir)
        };
        let existing = abs
            .ancestors()
            .find(|a| std::fs::symlink_metadata(a).is_ok())
            .unwrap_or(Path::new("/"))
            .to_path_buf();
        check_ancestors(&existing, me, "spool")?;
        let em = std::fs::symlink_metadata(&existing)?;
        anyhow::ensure!(
            em.is_dir()
                && (em.uid() == 0 || em.uid() == me)
                && (em.mode() & 0o022 == 0 || em.mode() & 0o1000 != 0),
            "spool {}: {} is not a directory of root's that only root can write",
            dir.display(),
            existing.display()
        );
        let rest = abs.strip_prefix(&existing).unwrap_or(Path::new(""));
        let mut cur = existing.clone();
        for c in rest.components() {
            cur.push(c);
            match std::fs::DirBuilder::new().mode(0o700).create(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let m = std::fs::symlink_metadata(&cur)?;
                    anyhow::ensure!(
                        m.is_dir() && (m.uid() == 0 || m.uid() == me),
                        "spool {}: {} appeared meanwhile and is not ours (a link?)",
                        dir.display(),
                        cur.display()
                    );
                }
                Err(e) => return Err(e).with_context(|| format!("creating {}", cur.display())),
            }
        }
    }
    let m = std::fs::symlink_metadata(dir).with_context(|| format!("spool {}", dir.display()))?;
    anyhow::ensure!(
        m.is_dir(),
        "spool {} is not a directory (a link?)",
        dir.display()
    );
    anyhow::ensure!(
        m.uid() == me,
        "spool {} belongs to uid {}, not to the agent (uid {me})",
        dir.display(),
        m.uid()
    );
    if m.mode() & 0o077 != 0 {
        crate::say!("nantrace: WARNING: spool {} is readable by others (mode {:o}): bundles hold job logs and environments", dir.display(), m.mode() & 0o777);
    }
    check_ancestors(dir, me, "spool")?;
    crate::safefs::check_out_dir(dir)?;
    Ok(())
}

/// No one but root (or the agent's user) can rename or replace a directory on the way to the
/// spool: every ancestor, as given and as resolved, belongs to root or `me` and is not
/// writable by others, unless it is sticky (`/tmp`) and the next step belongs to root or
/// `me` (review 9: a user-owned parent let the spool be swapped for a link).
pub(super) fn check_ancestors(dir: &Path, me: u32, what: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let abs = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()?.join(dir)
    };
    let real = std::fs::canonicalize(&abs).with_context(|| format!("{what} {}", abs.display()))?;
    for path in [abs, real] {
        let comps: Vec<PathBuf> = path.ancestors().map(Path::to_path_buf).collect();
        // From the spool's parent up to /; `child` is the step below each one.
        for w in comps.windows(2) {
            let (child, parent) = (&w[0], &w[1]);
            let pm = std::fs::symlink_metadata(parent)
                .with_context(|| format!("{}", parent.display()))?;
            let cm =
                std::fs::symlink_metadata(child).with_context(|| format!("{}", child.display()))?;
            let ours = |uid: u32| uid == 0 || uid == me;
            anyhow::ensure!(ours(pm.uid()), "{what} {}: {} belongs to uid {}: a user who owns a directory on the way could swap the {what} for a link", dir.display(), parent.display(), pm.uid());
            // A link's own mode means nothing (`/var/run -> /run` is 0777): only its owner and
            // its directory can change it, and the resolved path is checked as well.
            if pm.file_type().is_symlink() {
                continue;
            }
            if pm.mode() & 0o022 != 0 {
                let sticky = pm.mode() & 0o1000 != 0;
                anyhow::ensure!(
                    sticky && ours(cm.uid()),
                    "{what} {}: {} is writable by others: a user could swap {} for a link",
                    dir.display(),
                    parent.display(),
                    child.display()
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn oldest_go_first_newest_and_in_progress_stay() {
        let d = std::env::temp_dir().join(format!("nantrace-spool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (i, name) in ["nantrace-h-1", "nantrace-h-2", "nantrace-h-3"]
            .iter()
            .enumerate()
        {
            std::fs::create_dir(d.join(name)).unwrap();
            std::fs::write(d.join(name).join("timeline.json"), vec![b'x'; 10_000]).unwrap();
            let t =
                std::time::SystemTime::now() - std::time::Duration::from_secs(100 - i as u64 * 10);
            let f = std::fs::File::open(d.join(name)).unwrap();
            f.set_modified(t).unwrap();
        }
        std::fs::create_dir(d.join(".nantrace-h-4.tmp-1-x")).unwrap();
        std::fs::write(d.join(".nantrace-h-4.tmp-1-x/app.log"), vec![b'x'; 50_000]).unwrap();
        let u = super::usage(&d);
        assert_eq!((u.bundles, u.in_progress, u.incomplete), (3, 1, 0));
        // 25 kB allowed: the oldest two go (the newest stays even when alone over the limit).
        let removed = super::enforce(&d, 15_000, 0.0, &|_| None);
        assert_eq!(
            removed
                .iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect::<Vec<_>>(),
            ["nantrace-h-1", "nantrace-h-2"]
        );
        assert!(d.join("nantrace-h-3").exists() && d.join(".nantrace-h-4.tmp-1-x").exists());
        // Age: everything older than 5 s but the newest.
        assert!(super::enforce(&d, u64::MAX, 5.0, &|_| None).is_empty());
        // A full disk: room is made from the older bundles, never the newest.
        std::fs::create_dir(d.join("nantrace-h-0-incomplete")).unwrap();
        std::fs::File::open(d.join("nantrace-h-0-incomplete"))
            .unwrap()
            .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(500))
            .unwrap();
        assert_eq!(super::usage(&d).incomplete, 1);
        assert_eq!(
            super::make_room(&d, &|_| None, Some(&d.join("nantrace-h-3"))),
            [d.join("nantrace-h-0-incomplete")],
            "never the spared one"
        );
        assert!(
            super::make_room(&d, &|_| None, None).is_empty(),
            "the newest bundle is never removed"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_biggest_user_loses_first() {
        let d = std::env::temp_dir().join(format!("nantrace-spool-uid-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        // uid 1001: one old bundle; uid 1002: five newer ones (an incident storm).
        let mut owners = std::collections::HashMap::new();
        for (i, uid) in [1001u32, 1002, 1002, 1002, 1002, 1002].iter().enumerate() {
            let name = format!("nantrace-h-{i}");
            std::fs::create_dir(d.join(&name)).unwrap();
            std::fs::write(
                d.join(&name).join("timeline.json"),
                format!(
                    "{{\n  \"job\": {{ \"uid\": {uid} }},\n{}",
                    " ".repeat(10_000)
                ),
            )
            .unwrap();
            let f = std::fs::File::open(d.join(&name)).unwrap();
            f.set_modified(
                std::time::SystemTime::now() - std::time::Duration::from_secs(100 - i as u64),
            )
            .unwrap();
            owners.insert(d.join(&name), *uid);
        }
        assert_eq!(super::bundle_uid(&d.join("nantrace-h-0")), Some(1001));
        let removed = super::enforce(&d, 35_000, 0.0, &|p: &std::path::Path| super::bundle_uid(p));
        assert!(removed.iter().all(|p| owners[p] == 1002), "{removed:?}");
        assert!(
            d.join("nantrace-h-0").exists(),
            "the other user's bundle was evicted"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
