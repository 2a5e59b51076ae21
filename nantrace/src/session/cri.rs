//! Container log files as the kubelet writes them: CRI (`<RFC3339Nano> <stdout|stderr> <P|F>
//! <text>`, a long line split into `P` partials closed by an `F`) and Docker's json-file
//! (`{"log":"...\n","stream":"stderr","time":"..."}`). Plain lines pass through unchanged.

/// Joins a container log's records back into the job's lines. A line longer than
/// `LineSplitter::MAX` keeps its start and its last `TAIL` bytes (a NaN printed at the end of
/// a long line is still seen), and says how much was cut.
#[derive(Default)]
pub struct CriJoiner {
    partial: String,
    /// The latest text past the head, at most `2 * TAIL` bytes (trimmed to `TAIL` at the end).
    tail: String,
    cut: usize,
}

const TAIL: usize = 4096;

/// One record: its stream (1 stdout, 2 stderr, 0 unknown), whether the line goes on in the
/// next record, its text.
pub fn parse(line: &str) -> Option<(u8, bool, String)> {
    if line.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let text = v.get("log")?.as_str()?;
        let stream = match v.get("stream").and_then(serde_json::Value::as_str) {
            Some("stdout") => 1,
            Some("stderr") => 2,
            _ => 0,
        };
        // json-file keeps the newline in `log`; a record without one is a partial line.
        let partial = !text.ends_with('\n');
        return Some((
            stream,
            partial,
            text.trim_end_matches(['\n', '\r']).to_string(),
        ));
    }
    let mut it = line.splitn(4, ' ');
    let (ts, stream, tag) = (it.next()?, it.next()?, it.next()?);
    // The timestamp: a date, then `T`: enough to tell a CRI record from a plain line.
    if ts.len() < 20
        || ts.as_bytes().get(10) != Some(&b'T')
        || !ts.as_bytes()[..4].iter().all(u8::is_ascii_digit)
    {
        return None;
    }
    let stream = match stream {
        "stdout" => 1,
        "stderr" => 2,
        _ => return None,
    };
    // Tags are `:`-separated; `P` is the only one with a meaning for lines.
    let partial = tag.split(':').any(|t| t == "P");
    if !tag.split(':').all(|t| t == "P" || t == "F") {
        return None;
    }
    Some((stream, partial, it.next().unwrap_or("").to_string()))
}

impl CriJoiner {
    /// A record in; a whole line (stream, text) out when the record ends one.
    pub fn push(&mut self, record: &str) -> Option<(u8, String)> {
        let Some((stream, partial, text)) = parse(record) else {
            return Some((0, record.to_string()));
        };
        let room = (super::LineSplitter::MAX - TAIL).saturating_sub(self.partial.len());
        let mut end = room.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.partial.push_str(&text[..end]);
        if end < text.len() {
            self.tail.push_str(&text[end..]);
            if self.tail.len() > 2 * TAIL {
                let mut from = self.tail.len() - TAIL;
                while !self.tail.is_char_boundary(from) {
                    from += 1;
                }
                self.cut += from;
                self.tail.drain(..from);
            }
        }
        if partial {
            return None;
        }
        let mut line = std::mem::take(&mut self.partial);
        let mut tail = std::mem::take(&mut self.tail);
        if tail.len() > TAIL {
            let mut from = tail.len() - TAIL;
            while !tail.is_char_boundary(from) {
                from += 1;
            }
            self.cut += from;
            tail.drain(..from);
        }
        if self.cut > 0 {
            line.push_str(&format!(" [... {} bytes not kept ...] ", self.cut));
            self.cut = 0;
        }
        line.push_str(&tail);
        Some((stream, line))
    }
}

#[cfg(test)]
mod tests {
    use super::{parse, CriJoiner};

    #[test]
    fn cri_records_and_partials() {
        // As containerd writes them (kubelet's /var/log/pods/<ns>_<pod>_<uid>/<container>/0.log).
        let mut j = CriJoiner::default();
        assert_eq!(
            j.push("2024-05-02T10:11:12.123456789Z stdout F step 10 loss 2.31"),
            Some((1, "step 10 loss 2.31".into()))
        );
        assert_eq!(
            j.push(
                "2024-05-02T10:11:13.000000001Z stderr P RuntimeError: CUDA error: uncorrectable "
            ),
            None
        );
        assert_eq!(
            j.push("2024-05-02T10:11:13.000000002Z stderr F ECC error encountered"),
            Some((
                2,
                "RuntimeError: CUDA error: uncorrectable ECC error encountered".into()
            ))
        );
        // An empty line is a record with no text.
        assert_eq!(
            j.push("2024-05-02T10:11:14.5Z stdout F "),
            Some((1, String::new()))
        );
        assert_eq!(
            j.push("2024-05-02T10:11:14.5+02:00 stdout F x"),
            Some((1, "x".into()))
        );
        // Not CRI: passed through as it is.
        assert_eq!(
            j.push("step 11 loss nan"),
            Some((0, "step 11 loss nan".into()))
        );
        assert_eq!(parse("2024-05-02 10:11:12 stdout F x"), None);
        assert_eq!(parse("2024-05-02T10:11:12.1Z stdin F x"), None);
    }

    #[test]
    fn docker_json_file_records() {
        let mut j = CriJoiner::default();
        assert_eq!(
            j.push(
                r#"{"log":"epoch 1 loss nan\n","stream":"stdout","time":"2024-05-02T10:11:12.1Z"}"#
            ),
            Some((1, "epoch 1 loss nan".into()))
        );
        assert_eq!(j.push(r#"{"log":"NCCL WARN NET/IB : Got completion ","stream":"stderr","time":"2024-05-02T10:11:12.1Z"}"#), None);
        assert_eq!(
            j.push(
                r#"{"log":"with error 12\n","stream":"stderr","time":"2024-05-02T10:11:12.2Z"}"#
            ),
            Some((2, "NCCL WARN NET/IB : Got completion with error 12".into()))
        );
    }

    #[test]
    fn endless_partials_are_bounded() {
        let mut j = CriJoiner::default();
        let rec = format!("2024-05-02T10:11:12.1Z stdout P {}", "x".repeat(16 * 1024));
        for _ in 0..100 {
            assert_eq!(j.push(&rec), None);
        }
        let (_, line) = j
            .push("2024-05-02T10:11:12.1Z stdout F step 6 loss nan")
            .unwrap();
        assert!(
            line.len() < super::super::LineSplitter::MAX + 64,
            "{}",
            line.len()
        );
        // The end of the long line is kept: the NaN printed there is seen (review 13).
        assert!(
            line.contains("bytes not kept") && line.ends_with("step 6 loss nan"),
            "{}",
            &line[line.len() - 100..]
        );
    }
}
