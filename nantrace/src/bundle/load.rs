//! Reading a bundle back (`report`, `merge`, the job report): bounded in memory whatever
//! the layout of its timeline.json, and never through a link or from a FIFO.
use std::fs;
use std::path::Path;

use serde_json::{json, Value};

use super::DIGEST_MAX;

/// The rank of an event read back from timeline.json (as [`digest_rank`] for typed events).
fn json_rank(e: &Value) -> u8 {
    let flagged = |k: &str| !e[k].is_null() && e[k] != false;
    match e["source"].as_str().unwrap_or("") {
        "log"
            if flagged("nonfinite")
                || flagged("overflow")
                || flagged("fault")
                || flagged("loss_scale") =>
        {
            0
        }
        "log" if flagged("loss") => 2,
        "log" => 9,
        "fork" | "exec" | "block" | "tcp_retransmit" => 3,
        "exit" if e["exit_code"].as_i64() == Some(0) && e["signal"].is_null() => 3,
        "kmsg" if e["class"].is_null() => 3,
        _ => 1,
    }
}

/// A bundle read back for `report` and `merge`: its timeline (bounded: at most [`DIGEST_MAX`]
/// events, as at the dump; what was left out is counted in `accounting.digest`) and snapshot.
/// timeline.json as nantrace writes it (one event per line) is read line by line, so a 200 MB
/// timeline never becomes one JSON tree; any other layout is parsed whole.
pub fn load(dir: &Path) -> anyhow::Result<(Value, Value)> {
    load_with(dir, false)
}

/// A bundle's timeline without its events (`"events": []`) and its snapshot: what a job's
/// clock needs from each node before any node's events are read. nantrace's layout is read
/// up to its first event only.
pub fn load_head(dir: &Path) -> anyhow::Result<(Value, Value)> {
    load_with(dir, true)
}

fn load_with(dir: &Path, head_only: bool) -> anyhow::Result<(Value, Value)> {
    use anyhow::Context as _;
    let path = dir.join("timeline.json");
    if let (Err(e), Some(note)) = (open_plain(&path), incomplete_note(dir)) {
        anyhow::bail!("{}: this bundle is incomplete and has no timeline to read ({e:#}). {note} Its app.log and kernel.log, where present, are as far as it went.", dir.display());
    }
    let t = match load_streamed(&path, head_only)? {
        Some(t) => t,
        None => {
            // Another layout (compact, or pretty-printed by a tool): parsed whole, within a cap.
            let f = open_plain(&path)?;
            let size = f.metadata().map(|m| m.len()).unwrap_or(0);
            anyhow::ensure!(
                size <= WHOLE_TIMELINE_MAX,
                "{}: {} MiB in a layout other than nantrace's own (one event per line); read whole it could take {}x that in memory, so it is refused over {} MiB. Write it back one event per line (e.g. `jq -c '.events[]'`), or point nantrace at the bundle it came from",
                path.display(),
                size >> 20,
                10,
                WHOLE_TIMELINE_MAX >> 20
            );
            let mut t: Value = serde_json::from_reader(std::io::BufReader::new(f)).with_context(|| match incomplete_note(dir) {
                Some(note) => format!("{}: not valid JSON: this bundle is incomplete, its writer stopped before the timeline's first event. {note}", path.display()),
                None => format!("{}: not valid JSON", path.display()),
            })?;
            if head_only {
                t["events"] = json!([]);
            } else {
                digest_whole(&mut t);
            }
            t
        }
    };
    let mut t = t;
    if let Some(note) = incomplete_note(dir) {
        if t.is_object() {
            t["accounting"]["incomplete"] = json!(note);
        }
    }
    let snapshot = open_plain(&dir.join("snapshot.json"))
        .ok()
        .filter(|f| f.metadata().is_ok_and(|m| m.len() <= WHOLE_TIMELINE_MAX))
        .and_then(|f| serde_json::from_reader(std::io::BufReader::new(f)).ok())
        .unwrap_or(Value::Null);
    let mut snapshot = snapshot;
    super::flight::merge(dir, &mut snapshot);
    Ok((t, snapshot))
}

/// An incomplete bundle's own note (`INCOMPLETE.txt`, at most 4 KiB, on one line).
fn incomplete_note(dir: &Path) -> Option<String> {
    use std::io::Read as _;
    let f = open_plain(&dir.join(super::recover::NOTE)).ok()?;
    let mut s = String::new();
    f.take(4096).read_to_string(&mut s).ok()?;
    Some(s.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// The largest timeline.json read whole (a layout other than nantrace's own).
pub const WHOLE_TIMELINE_MAX: u64 = 64 << 20;

/// A bundle file opened for reading: never through a symbolic link, never a FIFO or a device
/// (a bundle directory may be a user's: a link or a FIFO there must not make `report`, run by
/// root, read another file or hang).
pub fn open_plain(path: &Path) -> anyhow::Result<fs::File> {
    use anyhow::Context as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| {
            format!(
                "{} (a bundle's files are read as plain files, never through a link)",
                path.display()
            )
        })?;
    let m = f
        .metadata()
        .with_context(|| format!("{}", path.display()))?;
    anyhow::ensure!(m.is_file(), "{}: not a plain file", path.display());
    Ok(f)
}

/// The events of a timeline read whole, digested as the streamed read does.
fn digest_whole(t: &mut Value) {
    let Some(evs) = t.get_mut("events").and_then(Value::as_array_mut) else {
        return;
    };
    let mut d = Digest::default();
    for e in evs.drain(..) {
        d.push(e);
    }
    d.finish(t);
}

/// The events analysed of a timeline, bounded while they are added: at most [`DIGEST_MAX`]
/// (the most important, and the latest of equal rank), plain log lines counted only.
#[derive(Default)]
struct Digest {
    events: Vec<(u8, usize, Value)>,
    total: usize,
    plain: usize,
}

impl Digest {
    fn push(&mut self, e: Value) {
        self.total += 1;
        let r = json_rank(&e);
        if r >= 9 {
            self.plain += 1;
            return;
        }
        self.events.push((r, self.total, e));
        if self.events.len() >= 4 * DIGEST_MAX {
            self.keep();
        }
    }

    fn keep(&mut self) {
        self.events.sort_by_key(|x| (x.0, std::cmp::Reverse(x.1)));
        self.events.truncate(DIGEST_MAX);
    }

    /// Into `t["events"]` in their order, and what was left out into the accounting.
    fn finish(mut self, t: &mut Value) {
        if self.events.len() > DIGEST_MAX {
            self.keep();
        }
        self.events.sort_by_key(|x| x.1);
        let analysed = self.events.len();
        let over = self.total - self.plain - analysed;
        t["events"] = Value::Array(self.events.into_iter().map(|x| x.2).collect());
        if t["accounting"].is_object() {
            t["accounting"]["digest"] = json!({ "events": self.total, "analysed": analysed, "plain_log_lines_not_analysed": self.plain, "over_the_cap_not_analysed": over });
        }
    }
}

/// timeline.json in nantrace's layout, read line by line; `None` when it is in another layout.
fn load_streamed(path: &Path, head_only: bool) -> anyhow::Result<Option<Value>> {
    use anyhow::Context as _;
    use std::io::BufRead as _;
    let f = open_plain(path)?;
    let mut head = String::new();
    let mut digest = Digest::default();
    let (mut in_events, mut streamed, mut closed, mut cut) = (false, false, false, false);
    // Lines are read with a bound: an event line is at most a few KiB as nantrace writes it.
    let mut r = std::io::BufReader::new(f);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = std::io::Read::take(&mut r, LINE_MAX as u64 + 1)
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        if buf.len() > LINE_MAX && !buf.ends_with(b"\n") {
            return Ok(None);
        }
        let Ok(line) = std::str::from_utf8(&buf) else {
            return Ok(None);
        };
        let line = line.trim_end_matches(['\n', '\r']);
        if !in_events {
            if line == "  \"events\": [" {
                in_events = true;
                streamed = true;
                head.truncate(head.trim_end().trim_end_matches(',').len());
                head.push_str("\n}");
                if head_only {
                    closed = true;
                    break;
                }
            } else {
                if head.len() + line.len() > LINE_MAX * 4 {
                    return Ok(None);
                }
                head.push_str(line);
                head.push('\n');
            }
            continue;
        }
        let l = line.trim().trim_end_matches(',');
        if l == "]" || l.is_empty() {
            closed = true;
            break;
        }
        match serde_json::from_str::<Value>(l) {
            Ok(e) => digest.push(e),
            // The last line cut in the middle: a writer that died (an incomplete bundle).
            Err(_) if !buf.ends_with(b"\n") => {
                cut = true;
                break;
            }
            Err(_) => return Ok(None),
        }
    }
    if !streamed {
        return Ok(None);
    }
    let Ok(mut t) = serde_json::from_str::<Value>(&head) else {
        return Ok(None);
    };
    if head_only {
        if t.is_object() {
            t["events"] = json!([]);
        }
        return Ok(Some(t));
    }
    let events = digest.total;
    digest.finish(&mut t);
    if !closed && t.is_object() {
        t["accounting"]["truncated"] = json!(format!("timeline.json ends {} after {events} event(s): its writer stopped before it finished; what follows is read from what there is", if cut { "in the middle of an event" } else { "without its end" }));
    }
    Ok(Some(t))
}

/// The longest line of timeline.json read as one event (nantrace's events are a few KiB).
const LINE_MAX: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("nantrace-load-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn timeline() -> Value {
        json!({ "schema": crate::bundle::SCHEMA, "accounting": { "events": {} }, "events": [
            { "source": "log", "line": "step 1 | loss 2.0", "loss": 2.0 },
            { "source": "kmsg", "text": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus." },
            { "source": "log", "line": "plain" },
        ] })
    }

    /// The same content in nantrace's layout, compact and pretty-printed: the same timeline.
    #[test]
    fn every_layout_reads_the_same() {
        let t = timeline();
        let mut ours = Vec::new();
        let mut head = t.clone();
        let evs = head.as_object_mut().unwrap().remove("events").unwrap();
        let evs = evs.as_array().unwrap();
        crate::bundle::write_timeline_with(&mut ours, &head, evs.len(), &mut |i, w| {
            serde_json::to_writer(w, &evs[i]).map_err(std::io::Error::from)
        })
        .unwrap();
        let mut got = Vec::new();
        for (tag, bytes) in [
            ("ours", ours),
            ("compact", serde_json::to_vec(&t).unwrap()),
            ("pretty", serde_json::to_vec_pretty(&t).unwrap()),
        ] {
            let d = dir(tag);
            fs::write(d.join("timeline.json"), bytes).unwrap();
            let (l, snap) = load(&d).unwrap_or_else(|e| panic!("{tag}: {e:#}"));
            assert_eq!(snap, Value::Null);
            assert_eq!(l["accounting"]["digest"]["events"], 3, "{tag}: {l}");
            assert_eq!(
                l["accounting"]["digest"]["plain_log_lines_not_analysed"], 1,
                "{tag}"
            );
            got.push(l["events"].clone());
            let _ = fs::remove_dir_all(&d);
        }
        assert_eq!(got[0], got[1]);
        assert_eq!(got[1], got[2]);
        assert_eq!(got[0].as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_link_or_a_fifo_is_refused_not_followed() {
        let d = dir("link");
        let elsewhere = d.join("secret.json");
        fs::write(&elsewhere, serde_json::to_vec(&timeline()).unwrap()).unwrap();
        std::os::unix::fs::symlink(&elsewhere, d.join("timeline.json")).unwrap();
        let e = load(&d).unwrap_err();
        assert!(format!("{e:#}").contains("never through a link"), "{e:#}");
        fs::remove_file(d.join("timeline.json")).unwrap();
        let c = std::ffi::CString::new(d.join("timeline.json").to_str().unwrap()).unwrap();
        // SAFETY: a path of our own scratch directory.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = load(&d).unwrap_err();
        assert!(
            format!("{e:#}").contains("not a plain file"),
            "a FIFO must not hang the report: {e:#}"
        );
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_huge_timeline_in_another_layout_is_refused_with_the_way_out() {
        let d = dir("huge");
        let f = fs::File::create(d.join("timeline.json")).unwrap();
        f.set_len(WHOLE_TIMELINE_MAX + 1).unwrap();
        let e = load(&d).unwrap_err();
        assert!(format!("{e:#}").contains("one event per line"), "{e:#}");
        let _ = fs::remove_dir_all(&d);
    }
}
