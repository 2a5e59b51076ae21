//! Quick property tests of the entry points the fuzz targets (fuzz/) run for minutes: random and
//! mutated real inputs never panic, and what they return keeps its invariants. Seeded: a
//! failure reproduces. Not privileged.
use nantrace::session::{LineReader, LineSplitter};

/// xorshift64*: a small seeded generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Up to `max` random bytes.
    fn some_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max);
        self.bytes(n)
    }
}

/// Real lines of every kind, to mutate.
fn seeds() -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut out = Vec::new();
    for f in ["joblog.tsv", "kernel.tsv", "nan.tsv"] {
        for l in std::fs::read_to_string(dir.join(f))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
        {
            if let Some(line) = l.split('\t').nth(if f == "joblog.tsv" { 2 } else { 1 }) {
                out.push(line.as_bytes().to_vec());
            }
        }
    }
    out
}

fn mutate(r: &mut Rng, mut v: Vec<u8>) -> Vec<u8> {
    for _ in 0..=r.below(6) {
        match r.below(5) {
            0 if !v.is_empty() => {
                let i = r.below(v.len());
                v[i] = r.next() as u8;
            }
            1 => {
                let i = r.below(v.len() + 1);
                let b = r.some_bytes(16);
                v.splice(i..i, b);
            }
            2 if !v.is_empty() => {
                let i = r.below(v.len());
                v.truncate(i);
            }
            3 => {
                let i = r.below(v.len() + 1);
                let k = r.below(40);
                v.splice(
                    i..i,
                    b"\x1b[31m\r\n\0NVRM: Xid (PCI:0000:3b:00): 79, "
                        .iter()
                        .copied()
                        .take(k),
                );
            }
            _ => {
                let k = r.below(v.len() + 1);
                v.extend_from_slice(&v.clone()[..k]);
            }
        }
    }
    v
}

#[test]
fn kernel_and_job_line_classifiers_never_panic() {
    let seeds = seeds();
    let mut r = Rng(0x5eed_1234);
    let mut reader = LineReader::new(nantrace::nanscan::Scanner::default());
    for i in 0..4_000 {
        let pick = r.below(seeds.len());
        let input = if i % 4 == 0 {
            r.some_bytes(300)
        } else {
            mutate(&mut r, seeds[pick].clone())
        };
        let s = String::from_utf8_lossy(&input);
        if let Some(c) = nantrace::classify::classify(&s) {
            serde_json::to_string(&c).unwrap();
        }
        if let Some(f) = nantrace::joblog::classify(&s) {
            assert!(!f.kind.is_empty());
        }
        let _ = reader.read(&s);
    }
}

#[test]
fn the_line_splitter_bounds_every_line_and_loses_no_separator() {
    let mut r = Rng(0xfeed_beef);
    for _ in 0..60 {
        let data = r.some_bytes(200_000);
        let mut split = LineSplitter::default();
        let mut lines = Vec::new();
        // Fed in random chunks, as pipes deliver it.
        let mut at = 0;
        while at < data.len() {
            let n = (r.below(70_000) + 1).min(data.len() - at);
            split.push(&data[at..at + n], |l| lines.push(l));
            at += n;
        }
        split.finish(|l| lines.push(l));
        assert!(lines.iter().all(|l| l.len() <= LineSplitter::MAX + 64
            && !l.contains('\n')
            && !l.contains('\r')
            && !l.contains('\0')));
        // Every segment between separators with text in it is one line (NUL bytes are not
        // text: a segment of NULs only, a sparse file's hole, is no line).
        let segments = data
            .split(|b| *b == b'\n' || *b == b'\r')
            .filter(|s| s.iter().any(|b| *b != 0))
            .count();
        assert_eq!(lines.len(), segments);
    }
}

#[test]
fn the_ring_buffer_decoder_never_panics_on_any_bytes() {
    let mut r = Rng(0xdec0_de00);
    let clock = nantrace::clock::ClockMap::sample();
    for _ in 0..20_000 {
        let len = r.below(700);
        let mut b = r.bytes(len);
        // Mostly valid kinds, so decoding goes past the header.
        if b.len() >= 4 && r.below(4) > 0 {
            b[..4].copy_from_slice(&(r.below(12) as u32 + 1).to_le_bytes());
        }
        if let Ok(e) = nantrace::decode::decode(&b) {
            let _ = e.to_json(&clock);
        }
    }
}

#[test]
fn the_bundle_loader_gives_an_error_or_a_report_for_any_timeline() {
    let mut r = Rng(0xb0_0d1e);
    let base = serde_json::json!({
        "schema": nantrace::bundle::SCHEMA,
        "first_nan": { "offset_s": 0.0, "line": "loss nan" },
        "trigger": { "kind": "nan" },
        "accounting": { "probes_attached": ["printk:console"] },
        "events": [
            { "offset_s": -3.0, "source": "xid", "class": "xid", "xid": 79, "pci": "0000:3b:00.0", "severity": "critical" },
            { "offset_s": -1.0, "source": "log", "line": "RuntimeError: CUDA error: misaligned address", "fault": { "family": "gpu_ambiguous", "kind": "cuda_misaligned", "what": "x", "generic": false } },
            { "offset_s": 0.0, "source": "log", "line": "loss nan", "nonfinite": true },
            { "offset_s": 2.0, "source": "block", "dev": "8:0", "latency_ms": 900.0, "error": -5 },
        ],
    });
    let base = serde_json::to_vec(&base).unwrap();
    for i in 0..400 {
        let bytes = if i % 3 == 0 {
            r.some_bytes(400)
        } else {
            mutate(&mut r, base.clone())
        };
        if let Ok((a, t, snap)) = nantrace::report::from_bytes(&bytes, None) {
            let _ = nantrace::report::markdown(&a, &t);
            let html = nantrace::export::html::render(&a, &t, &snap);
            assert!(
                html.len() < 8 << 20,
                "HTML stays bounded: {} bytes",
                html.len()
            );
        }
    }
    // Type confusion in every field the report reads.
    for junk in ["1", "\"x\"", "null", "[]", "{}", "1e308", "-1e308", "true"] {
        for field in [
            "offset_s",
            "source",
            "class",
            "xid",
            "pci",
            "fault",
            "line",
            "severity",
            "victim_pid",
            "latency_ms",
        ] {
            let t = format!("{{\"schema\":\"{}\",\"events\":[{{\"source\":\"xid\",\"{field}\":{junk}}},{{\"source\":\"log\",\"{field}\":{junk}}}]}}", nantrace::bundle::SCHEMA);
            if let Ok((a, t, s)) = nantrace::report::from_bytes(t.as_bytes(), None) {
                let _ = nantrace::report::markdown(&a, &t);
                let _ = nantrace::export::html::render(&a, &t, &s);
            }
        }
    }
}
