//! The job-output readers: the line splitter (any bytes, bounded lines), the NaN scanner and the
//! failure-line classifier with traceback state, over several lines.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nantrace::session::{LineReader, LineSplitter};

fuzz_target!(|data: &[u8]| {
    let mut split = LineSplitter::default();
    let mut r = LineReader::new(nantrace::nanscan::Scanner::default());
    let mut lines = Vec::new();
    split.push(data, |l| lines.push(l));
    split.finish(|l| lines.push(l));
    for l in &lines {
        assert!(l.len() <= LineSplitter::MAX + 64);
        let _ = r.read(l);
        let _ = nantrace::joblog::classify(l);
    }
});
