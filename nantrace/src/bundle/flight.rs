//! The job's Flight Recorder dumps in a bundle (docs/bundle.md): `flight_recorder.json`, the
//! dumps as read at the end of the post-window (`collect::flight::read`: per rank, where it
//! was read, its size, the decoded entries or why none), and `flight_recorder/fr_rank_<N>`,
//! the raw dumps for torch's own `torchfrtrace`. In memory the snapshot holds the read under
//! `flight_recorder.read`; snapshot.json keeps the trigger's `sources` and what was read,
//! and [`merge`] puts the file back when a bundle is loaded.
use std::borrow::Cow;
use std::path::Path;

use serde_json::{json, Value};

pub const FILE: &str = "flight_recorder.json";

/// snapshot.json's value (the `read` moved out, a count and the file named instead) and
/// flight_recorder.json's.
pub fn split(snapshot: &Value) -> (Cow<'_, Value>, Option<&Value>) {
    let read = &snapshot["flight_recorder"]["read"];
    if !read.is_object() {
        return (Cow::Borrowed(snapshot), None);
    }
    let mut s = snapshot.clone();
    let statuses: Vec<Value> = read["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| json!({ "rank": r["rank"], "status": r["status"] }))
        .collect();
    s["flight_recorder"]["read"] =
        json!({ "file": FILE, "ranks_read": read["ranks_read"], "ranks": statuses });
    (Cow::Owned(s), Some(read))
}

/// The files to write: flight_recorder.json, then each raw copy under its directory (made
/// here, 0700, in the bundle's own temporary directory).
pub fn files<'a>(
    dir: &crate::safefs::Dir,
    read: Option<&Value>,
    copies: &'a [(String, Vec<u8>)],
) -> Vec<(String, Cow<'a, [u8]>)> {
    let mut out = Vec::new();
    if let Some(r) = read {
        out.push((
            FILE.to_string(),
            Cow::Owned(serde_json::to_vec_pretty(r).unwrap_or_default()),
        ));
    }
    let sub = crate::collect::flight::COPY_DIR;
    if !copies.is_empty() && dir.create_subdir(sub).is_ok() {
        for (name, b) in copies {
            out.push((
                format!("{sub}/{}", crate::safefs::sanitize(name, "fr")),
                Cow::Borrowed(b.as_slice()),
            ));
        }
    }
    out
}

/// A loaded bundle's snapshot with its flight_recorder.json back under
/// `flight_recorder.read` (read as a plain file, at most 64 MiB).
pub fn merge(dir: &Path, snapshot: &mut Value) {
    let Some(v) = super::open_plain(&dir.join(FILE))
        .ok()
        .filter(|f| f.metadata().is_ok_and(|m| m.len() <= 64 << 20))
        .and_then(|f| serde_json::from_reader::<_, Value>(std::io::BufReader::new(f)).ok())
        .filter(Value::is_object)
    else {
        return;
    };
    if snapshot.is_object()
        && (snapshot["flight_recorder"].is_object() || snapshot["flight_recorder"].is_null())
    {
        snapshot["flight_recorder"]["read"] = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// snapshot.json keeps the sources and a count, flight_recorder.json the read, the raw
    /// dumps go under flight_recorder/, and a loaded bundle has the read back.
    #[test]
    fn the_read_is_written_apart_and_merged_back() {
        let d = std::env::temp_dir().join(format!("nantrace-frb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let dir = crate::safefs::Dir::open(&d).unwrap();
        let read = json!({ "ranks_read": 1, "ranks": [{ "rank": 1, "status": "read", "dump": { "entries": [] } }] });
        let snap = json!({ "flight_recorder": { "sources": [{ "rank": 1 }], "read": read } });
        let (s, r) = split(&snap);
        assert_eq!(
            s["flight_recorder"]["read"],
            json!({ "file": FILE, "ranks_read": 1, "ranks": [{ "rank": 1, "status": "read" }] })
        );
        assert_eq!(s["flight_recorder"]["sources"][0]["rank"], 1);
        let copies = vec![("fr_rank_1".to_string(), b"\x80\x02}.".to_vec())];
        for (name, data) in files(&dir, r, &copies) {
            dir.write_new(&name, &data).unwrap();
        }
        std::fs::write(d.join("snapshot.json"), serde_json::to_vec(&*s).unwrap()).unwrap();
        assert_eq!(
            std::fs::read(d.join("flight_recorder/fr_rank_1")).unwrap(),
            copies[0].1
        );
        let mut back: Value =
            serde_json::from_slice(&std::fs::read(d.join("snapshot.json")).unwrap()).unwrap();
        merge(&d, &mut back);
        assert_eq!(back["flight_recorder"]["read"], read);
        assert!(matches!(
            split(&json!({ "gpu": {} })),
            (Cow::Borrowed(_), None)
        ));
        let _ = std::fs::remove_dir_all(&d);
    }
}
