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

/// Remove the oldest bundles until the spool is within `max_bytes` and none is older than
/// `max_age_s` (0: no age limit). The newest bundle stays. Returns what was removed.
pub fn enforce(dir: &Path, max_bytes: u64, max_age_s: f64) -> Vec<PathBuf> {
    let b = bundles(dir);
    let mut total: u64 = b.iter().map(|x| x.1).sum();
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for (i, (p, bytes, t)) in b.iter().enumerate() {
        if i + 1 == b.len() {
            break;
        }
        let old = max_age_s > 0.0 && now.duration_since(*t).is_ok_and(|d| d.as_secs_f64() > max_age_s);
        if total <= max_bytes && !old {
            continue;
        }
        // remove_dir_all does not follow links inside the bundle.
        if std::fs::remove_dir_all(p).is_ok() {
            total = total.saturating_sub(*bytes);
            removed.push(p.clone());
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
        let removed = super::enforce(&d, 15_000, 0.0);
        assert_eq!(removed.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect::<Vec<_>>(), ["nantrace-h-1", "nantrace-h-2"]);
        assert!(d.join("nantrace-h-3").exists() && d.join(".nantrace-h-4.tmp-1-x").exists());
        // Age: everything older than 5 s but the newest.
        assert!(super::enforce(&d, u64::MAX, 5.0).is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }
}
