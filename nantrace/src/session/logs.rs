//! The job's output: passing it through, splitting it into lines, scanning each line (log
//! files are followed in `follow.rs`).
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::mpsc;

use super::Input;
use crate::clock::monotonic_ns;
use crate::event::{Detail, Event, LogLine};
use crate::nanscan::Scanner;

/// Split a byte stream into lines (`\n` or `\r`, so progress bars count), bounded in length:
/// a line longer than `MAX` keeps its first `MAX - TAIL` bytes and its last `TAIL` bytes (a
/// NaN printed at the end of a 50 MB line is still seen), with a marker of what was cut.
#[derive(Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
    /// Ring of the last `TAIL` bytes once the line is over `MAX - TAIL`.
    tail: Vec<u8>,
    tail_at: usize,
    cut: u64,
}

impl LineSplitter {
    pub const MAX: usize = 64 * 1024;
    const TAIL: usize = 4096;

    fn emit(&mut self, out: &mut impl FnMut(String)) {
        if self.buf.is_empty() && self.tail.is_empty() {
            return;
        }
        let mut line = std::mem::take(&mut self.buf);
        if self.cut > 0 || !self.tail.is_empty() {
            let (a, b) = self.tail.split_at(self.tail_at.min(self.tail.len()));
            line.extend_from_slice(format!(" [... {} bytes not kept ...] ", self.cut).as_bytes());
            line.extend_from_slice(b);
            line.extend_from_slice(a);
        }
        self.tail.clear();
        self.tail_at = 0;
        self.cut = 0;
        out(String::from_utf8_lossy(&line).into_owned());
        line.clear();
        self.buf = line;
    }

    pub fn push(&mut self, chunk: &[u8], mut out: impl FnMut(String)) {
        for &b in chunk {
            // NUL bytes (a sparse file's holes, binary junk) are not text.
            if b == 0 {
                continue;
            }
            if b == b'\n' || b == b'\r' {
                self.emit(&mut out);
            } else if self.buf.len() < Self::MAX - Self::TAIL {
                self.buf.push(b);
            } else if self.tail.len() < Self::TAIL {
                self.tail.push(b);
            } else {
                self.tail[self.tail_at] = b;
                self.tail_at = (self.tail_at + 1) % Self::TAIL;
                self.cut += 1;
            }
        }
    }

    pub fn finish(&mut self, mut out: impl FnMut(String)) {
        self.emit(&mut out);
    }
}

/// Reads the job's lines: the NaN scanner and the failure-line classifier, with the state a
/// traceback needs. One per stream.
pub struct LineReader {
    scanner: Scanner,
    faults: crate::joblog::Reader,
    /// Loss columns of the last table header (`Epoch GPU_mem box_loss cls_loss ...`).
    header: Option<(Vec<String>, Vec<usize>)>,
    lines: u64,
    last_overflow: Option<u64>,
    last_scale: Option<f64>,
}

/// A table header: three or more word-like columns, at least one of them a loss.
fn table_header(line: &str) -> Option<(Vec<String>, Vec<usize>)> {
    let cols: Vec<&str> = line.split_whitespace().collect();
    if cols.len() < 3 || cols.len() > 40 {
        return None;
    }
    let wordy = cols.iter().all(|c| {
        c.chars().next().is_some_and(char::is_alphabetic)
            && c.chars()
                .all(|ch| ch.is_alphanumeric() || "_/.-()%".contains(ch))
    });
    let loss: Vec<usize> = cols
        .iter()
        .enumerate()
        .filter(|(_, c)| c.to_ascii_lowercase().contains("loss"))
        .map(|(i, _)| i)
        .collect();
    (wordy && !loss.is_empty()).then(|| (cols.iter().map(|c| (*c).to_string()).collect(), loss))
}

impl LineReader {
    pub fn new(scanner: Scanner) -> Self {
        Self {
            scanner,
            faults: crate::joblog::Reader::default(),
            header: None,
            lines: 0,
            last_overflow: None,
            last_scale: None,
        }
    }

    /// A row under the last table header whose loss column is non-finite (YOLO-style logs).
    fn table_row(&self, line: &str) -> Option<String> {
        let (cols, loss) = self.header.as_ref()?;
        let cells: Vec<&str> = line.split_whitespace().collect();
        if cells.len() < cols.len() || !cells[0].starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        loss.iter().find_map(|&i| {
            let v = cells[i]
                .trim_end_matches([',', ':', ';'])
                .to_ascii_lowercase();
            matches!(v.trim_start_matches(['-', '+']), "nan" | "inf" | "infinity")
                .then(|| cols[i].clone())
        })
    }

    pub fn read(&mut self, line: &str) -> LogLine {
        use crate::nanscan::GradRule;
        let clean = crate::joblog::strip_ansi(line);
        let mut s = self.scanner.scan(&clean);
        if s.nonfinite.is_none() {
            s.nonfinite = self.table_row(&clean);
        }
        if let Some(h) = table_header(&clean) {
            self.header = Some(h);
        }
        self.lines += 1;
        // A non-finite gradient norm with a finite loss: the scaler's routine skip, or the NaN?
        if s.nonfinite.is_some() && s.grad_only {
            let skipped = s.overflow
                || self.last_overflow.is_some_and(|l| self.lines - l <= 10)
                || matches!((s.loss_scale, self.last_scale), (Some(now), Some(before)) if now < before);
            let precursor = match self.scanner.grad_rule {
                GradRule::Auto => skipped,
                GradRule::Precursor => true,
                GradRule::Incident => false,
            };
            if precursor {
                s.nonfinite = None;
                s.overflow = true;
            }
        }
        if s.overflow {
            self.last_overflow = Some(self.lines);
        }
        if let Some(sc) = s.loss_scale {
            self.last_scale = Some(sc);
        }
        let fault = self.faults.line(&clean);
        LogLine {
            // Scanned above; redacted before it is kept (it will leave the process, 4.5).
            text: crate::collect::redact::log_line(line.to_owned()).into(),
            stream: 0,
            nonfinite: s.nonfinite.is_some(),
            step: s.step,
            loss: s.loss,
            loss_scale: s.loss_scale,
            overflow: s.overflow,
            // A line that reports the NaN itself (`AssertionError: loss is nan`) is the NaN
            // incident, not a software fault.
            fault: fault.filter(|_| s.nonfinite.is_none()).map(Box::new),
        }
    }
}

pub(super) fn log_event(
    reader: &mut LineReader,
    line: String,
    stream: u8,
    pid: u32,
    comm: crate::event::Comm,
) -> Event {
    let mut l = reader.read(&line);
    l.stream = stream;
    Event::new(
        monotonic_ns(),
        pid,
        pid,
        comm,
        true,
        Detail::Log(Box::new(l)),
    )
}

/// Bytes of output waiting to be scanned, per stream, at most.
const SCAN_QUEUE_BYTES: usize = 16 << 20;
/// Beyond it, room for the lines a flood's skipped chunks may hold a NaN or a failure in.
const HINT_EXTRA_BYTES: usize = 1 << 20;

/// Words without which a line is neither a NaN nor a failure line the classifiers know
/// (checked against the corpus by a test).
static HINT: std::sync::LazyLock<regex::bytes::Regex> = std::sync::LazyLock::new(|| {
    regex::bytes::Regex::new(r"(?i-u)nan|inf|error|warn|fail|fatal|fault|kill|exception|traceback|timeout|timed out|timing out|abort|assert|denied|exceeded|unreachable|refused|closed|reset by peer|xid|ecc|oom|out of memory|bad_alloc|no space|stale|signal|diverg|watchdog|minimum|lost|fallen|invalid|duplicate|insufficient|unavailable|busy|returned|status=|cuda|nccl|nvrm|ib_|mlx|endpoint|terminat|杀死").unwrap()
});

/// A line could be the NaN: these go first, with a reserve of their own.
static NAN_HINT: std::sync::LazyLock<regex::bytes::Regex> =
    std::sync::LazyLock::new(|| regex::bytes::Regex::new(r"(?i-u)nan|inf").unwrap());

/// The complete lines of `chunk` (its first and last, possibly cut, included) that contain a
/// hint word, each ending with a newline: (lines that could be a NaN, the other hint lines),
/// each at most 32 KiB, the newest kept when there are more (the line after a flood is the
/// one that matters, re-review D2).
fn hint_lines(chunk: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    let mut last_end = 0usize;
    for m in HINT.find_iter(chunk) {
        if m.start() < last_end {
            continue;
        }
        let start = chunk[..m.start()]
            .iter()
            .rposition(|&b| b == b'\n' || b == b'\r')
            .map_or(0, |i| i + 1);
        let end = chunk[m.end()..]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
            .map_or(chunk.len(), |i| m.end() + i);
        ranges.push((start, end));
        last_end = end;
    }
    let pick = |nan: bool| {
        let mut keep: Vec<(usize, usize)> = Vec::new();
        let mut size = 0;
        for &(s, e) in ranges
            .iter()
            .rev()
            .filter(|(s, e)| NAN_HINT.is_match(&chunk[*s..*e]) == nan)
        {
            if size + (e - s) + 1 > 32 << 10 {
                break;
            }
            size += e - s + 1;
            keep.push((s, e));
        }
        let mut out = Vec::with_capacity(size);
        for &(s, e) in keep.iter().rev() {
            out.extend_from_slice(&chunk[s..e]);
            out.push(b'\n');
        }
        out
    };
    (pick(true), pick(false))
}

/// Pass a child's output through unchanged, and scan it line by line on a thread of its own.
///
/// Reading the job's output never waits for nantrace: the pump reads, writes through, stamps
/// the chunk with its arrival time and hands it to the scanner with `try_send`. When the
/// scanner is behind by more than `SCAN_QUEUE_BYTES` (a sustained flood faster than the
/// classifiers), the chunk is still passed through but not scanned, and counted in
/// `not_scanned` (bytes), which the bundle's accounting and the report show.
#[allow(
    clippy::too_many_arguments,
    reason = "the stream's identity, its ends and its accounting"
)]
pub(super) async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut from: R,
    mut to: W,
    stream: u8,
    pid: u32,
    comm: crate::event::Comm,
    scanner: Scanner,
    tx: mpsc::Sender<Input>,
    not_scanned: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Option<std::thread::JoinHandle<()>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // `None`: output was skipped here; the line in progress is incomplete and dropped.
    let (chunks, rx) = std::sync::mpsc::channel::<Option<(u64, Vec<u8>)>>();
    let queued = std::sync::Arc::new(AtomicUsize::new(0));
    let queued2 = queued.clone();
    let scan = std::thread::Builder::new()
        .name("nantrace-scan".into())
        .spawn(move || {
            let mut split = LineSplitter::default();
            let mut reader = LineReader::new(scanner);
            let mut last_t = 0;
            loop {
                // A line the job left without its newline for a second (`print(..., end="")`, then a
                // hang) is read as a line: a NaN in it triggers now, not at the job's end.
                let item = match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(item) => item,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        let mut last = None;
                        split.finish(|l| last = Some(l));
                        if let Some(l) = last {
                            let mut e = log_event(&mut reader, l, stream, pid, comm);
                            e.mono_ns = last_t.max(1);
                            if tx.blocking_send(Input::Log(e)).is_err() {
                                return;
                            }
                        }
                        continue;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                };
                let Some((t, chunk)) = item else {
                    split = LineSplitter::default();
                    continue;
                };
                queued2.fetch_sub(chunk.len(), Ordering::Relaxed);
                last_t = t;
                let mut lines = Vec::new();
                split.push(&chunk, |l| lines.push(l));
                for l in lines {
                    let mut e = log_event(&mut reader, l, stream, pid, comm);
                    e.mono_ns = t;
                    if tx.blocking_send(Input::Log(e)).is_err() {
                        return;
                    }
                }
            }
            let mut last = None;
            split.finish(|l| last = Some(l));
            if let Some(l) = last {
                let mut e = log_event(&mut reader, l, stream, pid, comm);
                e.mono_ns = last_t.max(1);
                let _ = tx.blocking_send(Input::Log(e));
            }
        });
    let mut buf = vec![0u8; 64 * 1024];
    let mut skipping = false;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // The user sees the output first; scanning comes after, elsewhere.
        let _ = to.write_all(&buf[..n]).await;
        let _ = to.flush().await;
        if queued.load(Ordering::Relaxed) + n > SCAN_QUEUE_BYTES {
            if !skipping {
                skipping = true;
                let _ = chunks.send(None);
            }
            // Not scanned whole, but not blind either: the lines of the chunk that could be a
            // NaN or a failure line (a fast literal search) still go to the scanner, within
            // a small extra budget. A NaN printed right after a flood is seen.
            // Lines that could be the NaN have a reserve of their own beyond the other hints'.
            let (nan, other) = hint_lines(&buf[..n]);
            let mut sent = 0;
            for (part, limit) in [
                (nan, SCAN_QUEUE_BYTES + 2 * HINT_EXTRA_BYTES),
                (other, SCAN_QUEUE_BYTES + HINT_EXTRA_BYTES),
            ] {
                if !part.is_empty() && queued.load(Ordering::Relaxed) + part.len() <= limit {
                    queued.fetch_add(part.len(), Ordering::Relaxed);
                    sent += part.len();
                    let _ = chunks.send(Some((monotonic_ns(), part)));
                    let _ = chunks.send(None);
                }
            }
            not_scanned.fetch_add(n.saturating_sub(sent) as u64, Ordering::Relaxed);
        } else {
            skipping = false;
            queued.fetch_add(n, Ordering::Relaxed);
            let _ = chunks.send(Some((monotonic_ns(), buf[..n].to_vec())));
        }
    }
    drop(chunks);
    // The scanner finishes what is queued; the caller waits for it before the job's exit.
    scan.ok()
}

#[cfg(test)]
mod tests {
    use super::LineSplitter;

    #[test]
    fn splits_on_newline_and_carriage_return() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(
            b"step 1 loss 2.0\nprogress 10%\rprogress 20%\r\nstep 2 lo",
            |l| out.push(l),
        );
        s.push(b"ss nan\n", |l| out.push(l));
        s.push(b"tail without newline", |l| out.push(l));
        s.finish(|l| out.push(l));
        assert_eq!(
            out,
            [
                "step 1 loss 2.0",
                "progress 10%",
                "progress 20%",
                "step 2 loss nan",
                "tail without newline"
            ]
        );
    }

    #[test]
    fn very_long_lines_are_bounded() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(&vec![b'x'; LineSplitter::MAX * 2], |l| out.push(l));
        s.push(b"\n", |l| out.push(l));
        assert_eq!(out.len(), 1);
        assert!(out[0].len() <= LineSplitter::MAX + 64, "{}", out[0].len());
        // The end of a very long line is kept: a NaN printed there is still seen.
        let mut big = vec![b'x'; 50 * 1024 * 1024];
        big.extend_from_slice(b" step 9 loss: nan\n");
        out.clear();
        s.push(&big, |l| out.push(l));
        assert_eq!(out.len(), 1);
        assert!(
            out[0].ends_with("step 9 loss: nan") && out[0].contains("bytes not kept"),
            "{}",
            &out[0][out[0].len() - 80..]
        );
        let mut r = super::LineReader::new(crate::nanscan::Scanner::default());
        assert!(r.read(&out[0]).nonfinite);
        // Colour codes inside the value do not hide the NaN (redteam 2.5).
        assert!(r.read("step 2 | loss: \x1b[31mnan\x1b[0m").nonfinite);
    }

    #[test]
    fn table_rows_under_a_header_are_read_by_column() {
        let mut r = super::LineReader::new(crate::nanscan::Scanner::default());
        assert!(
            !r.read(
                "      Epoch    GPU_mem   box_loss   cls_loss   dfl_loss  Instances       Size"
            )
            .nonfinite
        );
        assert!(!r.read("      1/100      3.15G      1.234      2.345      1.111         22        640: 100%|##########| 8/8 [00:02<00:00,  3.09it/s]").nonfinite);
        let l = r.read("      2/100      3.15G        nan        nan        nan         22        640: 100%|##########| 8/8 [00:02<00:00,  3.09it/s]");
        assert!(l.nonfinite);
        // A NaN in a column that is not a loss is not the incident.
        let mut r = super::LineReader::new(crate::nanscan::Scanner::default());
        r.read("Epoch   lr   val_loss   acc");
        assert!(!r.read("3   nan   0.52   0.91").nonfinite);
    }

    #[test]
    fn nonfinite_grad_norm_is_a_precursor_only_when_the_scaler_skipped() {
        use crate::nanscan::{GradRule, Scanner};
        // fp16 with the scaler's overflow message just before: routine.
        let mut r = super::LineReader::new(Scanner::default());
        r.read("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768");
        let l = r.read("step 120 | loss 2.31 | grad_norm nan");
        assert!(!l.nonfinite && l.overflow);
        // Megatron counts the skip in the same line.
        let mut r = super::LineReader::new(Scanner::default());
        assert!(!r.read(" iteration 10/100 | lm loss: 2.1E+00 | loss scale: 32768.0 | grad norm: nan | number of skipped iterations:   1 |").nonfinite);
        // bf16: no scaler, no skip message: the incident.
        let mut r = super::LineReader::new(Scanner::default());
        assert!(
            r.read("{'loss': 2.31, 'grad_norm': nan, 'learning_rate': 1e-4}")
                .nonfinite
        );
        // The option changes the rule.
        let mut sc = Scanner::default();
        sc.grad_rule = GradRule::Precursor;
        assert!(
            !super::LineReader::new(sc)
                .read("{'loss': 2.31, 'grad_norm': nan}")
                .nonfinite
        );
        let mut sc = Scanner::default();
        sc.grad_rule = GradRule::Incident;
        let mut r = super::LineReader::new(sc);
        r.read("OVERFLOW! Skipping step");
        assert!(r.read("step 1 | loss 2.0 | grad_norm inf").nonfinite);
    }
}

#[cfg(test)]
mod hints {
    #[test]
    fn a_flood_chunk_gives_up_its_nan_and_failure_lines() {
        let mut chunk = Vec::new();
        for i in 0..2000 {
            chunk.extend_from_slice(
                format!("step {i} | loss 2.0 | lr 3e-4 | tokens/s 123456\n").as_bytes(),
            );
        }
        chunk.extend_from_slice(b"step 2001 | loss nan\nRuntimeError: CUDA error: an illegal memory access was encountered\nstep 2002 | lo");
        let (nan, other) = super::hint_lines(&chunk);
        assert_eq!(String::from_utf8(nan).unwrap(), "step 2001 | loss nan\n");
        assert_eq!(
            String::from_utf8(other).unwrap(),
            "RuntimeError: CUDA error: an illegal memory access was encountered\n"
        );
        // A flood whose every line holds a hint word: the newest lines are kept, so the NaN
        // after it is among them.
        let mut chunk = Vec::new();
        for i in 0..3000 {
            chunk.extend_from_slice(format!("step {i} error loss 0.5 lr 1e-4\n").as_bytes());
        }
        chunk.extend_from_slice(b"step 3001 loss: nan\n");
        let (nan, other) = super::hint_lines(&chunk);
        assert_eq!(String::from_utf8(nan).unwrap(), "step 3001 loss: nan\n");
        assert!(
            other.len() <= 32 << 10
                && String::from_utf8(other)
                    .unwrap()
                    .ends_with("step 2999 error loss 0.5 lr 1e-4\n")
        );
    }

    #[test]
    fn every_corpus_line_has_a_hint_word() {
        // The hint must not hide what the classifiers find: every NaN and failure line of the
        // corpus (nantrace/tests/corpus) that the readers flag contains a hint word.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
        let (mut checked, mut missed) = (0, Vec::new());
        let files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .chain(std::fs::read_dir(dir.join("heldout")).unwrap())
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "tsv"))
            .collect();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                // The line is the column before the source URL.
                let cols: Vec<&str> = line.split('\t').collect();
                if cols.len() < 3 {
                    continue;
                }
                let l = cols[cols.len() - 2];
                let mut r = super::LineReader::new(crate::nanscan::Scanner::default());
                let read = r.read(l);
                if read.nonfinite || read.fault.is_some() {
                    checked += 1;
                    if !super::HINT.is_match(l.as_bytes()) {
                        missed.push(l.to_string());
                    }
                }
            }
        }
        assert!(
            missed.is_empty(),
            "no hint word in {} lines the readers flag:\n{}",
            missed.len(),
            missed.join("\n")
        );
        assert!(checked > 300, "only {checked} corpus lines checked");
    }
}
