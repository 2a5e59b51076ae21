//! The node itself: host name, kernel release, boot id.
use std::fs;

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Host {
    pub hostname: String,
    pub kernel: String,
    pub boot_id: String,
}

impl Host {
    pub fn read() -> Self {
        let r = |p: &str| fs::read_to_string(p).unwrap_or_default().trim().to_string();
        Host {
            hostname: r("/proc/sys/kernel/hostname"),
            kernel: r("/proc/sys/kernel/osrelease"),
            boot_id: r("/proc/sys/kernel/random/boot_id"),
        }
    }
}
