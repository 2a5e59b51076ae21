//! The kernel-line classifier: any text, any class; the class serialises.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let s = String::from_utf8_lossy(data);
    if let Some(c) = nantrace::classify::classify(&s) {
        let _ = c.severity();
        let _ = serde_json::to_string(&c).expect("class serialises");
    }
});
