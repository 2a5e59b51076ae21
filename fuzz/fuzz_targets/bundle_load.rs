//! The bundle loader: any timeline.json bytes give an error or an analysis, and the analysis
//! renders as Markdown and HTML.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((a, t, snap)) = nantrace::report::from_bytes(data, None) {
        let _ = nantrace::report::markdown(&a, &t);
        let _ = nantrace::export::html::render(&a, &t, &snap);
    }
});
