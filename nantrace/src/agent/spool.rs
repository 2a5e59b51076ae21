//! The spool: bundles under one 0700 directory, kept within a size and an age limit, oldest
//! first; a bundle being written (a `.nantrace-*.tmp-*` directory) is never removed, nor the
//! newest bundle.
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Bytes under `p`, links not followed.
fn du(p: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(p) else { return 0 };
    if !m.is_dir() {
        return m.len();
    }
    std::fs::read_dir(p).into_iter().flatten().flatten().map(|e| du(&e.path())).sum::<u64>() + m.len()
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Usage {
    pub bundles: usize,
    pub bytes: u64,
    pub in_progress: usize,
}

/// The bundles in the spool, oldest first: (path, bytes, modified).
pub fn bundles(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let mut v: Vec<(PathBuf, u64, SystemTime)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("nantrace-") && e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| {
            let p = e.path();
            let t = std::fs::symlink_metadata(&p).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
            (p.clone(), du(&p), t)
        })
        .collect();
    v.sort_by_key(|b| (b.2, b.0.clone()));
    v
}

pub fn usage(dir: &Path) -> Usage {
    let b = bundles(dir);
    let in_progress = std::fs::read_dir(dir).into_iter().flatten().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(".nantrace-")).count();
    Usage { bundles: b.len(), bytes: b.iter().map(|x| x.1).sum(), in_progress }
}

/// The job user's uid a bundle records (`"uid": N` in the head of its timeline.json).
pub fn bundle_uid(b: &Path) -> Option<u32> {
    use std::io::Read as _;
    let mut head = vec![0u8; 16 << 10];
    let n = std::fs::File::open(b.join("timeline.json")).and_then(|mut f| f.read(&mut head)).ok()?;
    let text = String::from_utf8_lossy(&head[..n]);
    let i = text.find("\"uid\": ")?;
    text[i + 7..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Remove bundles older than `max_age_s` (0: no age limit), then, while the spool is over
/// `max_bytes`, the oldest bundle of the user whose bundles take the most room: one user's
/// incidents do not push out another's (review 10). The newest bundle always stays. Returns
/// what was removed.
pub fn enforce(dir: &Path, max_bytes: u64, max_age_s: f64, uid_of: &dyn Fn(&Path) -> Option<u32>) -> Vec<PathBuf> {
    let mut b = bundles(dir);
    let newest = b.last().map(|x| x.0.clone());
    let now = SystemTime::now();
    let mut removed = Vec::new();
    // remove_dir_all does not follow links inside the bundle.
    b.retain(|(p, _, t)| {
        let old = max_age_s > 0.0 && now.duration_since(*t).is_ok_and(|d| d.as_secs_f64() > max_age_s);
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
        let Some((&uid, _)) = per.iter().max_by_key(|(_, v)| **v) else { break };
        let Some(i) = (0..b.len()).find(|&i| !gone[i] && owner[i] == uid && Some(&b[i].0) != newest.as_ref()) else { break };
        gone[i] = true;
        if std::fs::remove_dir_all(&b[i].0).is_ok() {
            total = total.saturating_sub(b[i].1);
            removed.push(b[i].0.clone());
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    #[test]
    fn oldest_go_first_newest_and_in_progress_stay() {
        let d = std::env::temp_dir().join(format!("nantrace-spool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (i, name) in ["nantrace-h-1", "nantrace-h-2", "nantrace-h-3"].iter().enumerate() {
            std::fs::create_dir(d.join(name)).unwrap();
            std::fs::write(d.join(name).join("timeline.json"), vec![b'x'; 10_000]).unwrap();
            let t = std::time::SystemTime::now() - std::time::Duration::from_secs(100 - i as u64 * 10);
            let f = std::fs::File::open(d.join(name)).unwrap();
            f.set_modified(t).unwrap();
        }
        std::fs::create_dir(d.join(".nantrace-h-4.tmp-1-x")).unwrap();
        std::fs::write(d.join(".nantrace-h-4.tmp-1-x/app.log"), vec![b'x'; 50_000]).unwrap();
        let u = super::usage(&d);
        assert_eq!((u.bundles, u.in_progress), (3, 1));
        // 25 kB allowed: the oldest two go (the newest stays even when alone over the limit).
        let removed = super::enforce(&d, 15_000, 0.0, &|_| None);
        assert_eq!(removed.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect::<Vec<_>>(), ["nantrace-h-1", "nantrace-h-2"]);
        assert!(d.join("nantrace-h-3").exists() && d.join(".nantrace-h-4.tmp-1-x").exists());
        // Age: everything older than 5 s but the newest.
        assert!(super::enforce(&d, u64::MAX, 5.0, &|_| None).is_empty());
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
            std::fs::write(d.join(&name).join("timeline.json"), format!("{{\n  \"job\": {{ \"uid\": {uid} }},\n{}", " ".repeat(10_000))).unwrap();
            let f = std::fs::File::open(d.join(&name)).unwrap();
            f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(100 - i as u64)).unwrap();
            owners.insert(d.join(&name), *uid);
        }
        assert_eq!(super::bundle_uid(&d.join("nantrace-h-0")), Some(1001));
        let removed = super::enforce(&d, 35_000, 0.0, &|p: &std::path::Path| super::bundle_uid(p));
        assert!(removed.iter().all(|p| owners[p] == 1002), "{removed:?}");
        assert!(d.join("nantrace-h-0").exists(), "the other user's bundle was evicted");
        let _ = std::fs::remove_dir_all(&d);
    }
}
