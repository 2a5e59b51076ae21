//! System samples from /proc (memory, swap, CPU, PSI), as `Sample` events.
use procfs::Current as _;
use serde_json::{json, Map, Value};

use crate::clock::monotonic_ns;
use crate::event::{Detail, Event};

pub struct Sampler {
    root_pid: Option<u32>,
}

impl Sampler {
    pub fn new(root_pid: Option<u32>) -> Self {
        Self { root_pid }
    }

    pub fn sample(&mut self) -> Vec<Event> {
        let mut fields = Map::new();
        if let Ok(m) = procfs::Meminfo::current() {
            fields.insert("mem_total_kb".into(), json!(m.mem_total / 1024));
            fields.insert("mem_available_kb".into(), json!(m.mem_available.unwrap_or(m.mem_free) / 1024));
            fields.insert("swap_used_kb".into(), json!((m.swap_total - m.swap_free) / 1024));
        }
        if fields.is_empty() {
            return Vec::new();
        }
        let _ = self.root_pid;
        vec![Event { mono_ns: monotonic_ns(), pid: 0, tid: 0, comm: [0; 16], job: false, detail: Detail::Sample { source: "system", fields: Box::new(fields) } }]
    }
}

pub fn value(_: &Value) {}
