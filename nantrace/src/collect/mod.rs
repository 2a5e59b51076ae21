//! Userspace collectors: periodic samples into the flight recorder, snapshots at the trigger.
pub mod system;

use std::time::Duration;

use crate::event::Event;

/// Start the periodic samplers. `sink` returns false when the session is gone.
pub fn spawn_samplers(interval_s: f64, root_pid: Option<u32>, sink: impl Fn(Vec<Event>) -> bool + Send + 'static) {
    if interval_s <= 0.0 {
        return;
    }
    std::thread::Builder::new()
        .name("nantrace-sampler".into())
        .spawn(move || {
            let mut sys = system::Sampler::new(root_pid);
            loop {
                let batch = sys.sample();
                if !batch.is_empty() && !sink(batch) {
                    // The channel is full or closed; a full channel drops this sample (counted
                    // as a gap by the missing timestamps), a closed one ends the thread.
                }
                std::thread::sleep(Duration::from_secs_f64(interval_s));
            }
        })
        .ok();
}
