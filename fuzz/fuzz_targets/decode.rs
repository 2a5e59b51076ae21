//! The ring-buffer decoder: any bytes give an event or an error, never a panic; an event
//! serialises.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = nantrace::decode::decode(data) {
        let _ = e.to_json(&nantrace::clock::ClockMap::sample());
    }
});
