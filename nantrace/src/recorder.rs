//! The flight recorder: every event from every source, bounded by a time window and a memory
//! cap. The oldest go first; evictions are counted by cause and by source.
use std::collections::{BTreeMap, VecDeque};

use crate::event::Event;

#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct RecorderStats {
    pub events: u64,
    pub bytes: u64,
    pub evicted_by_time: u64,
    pub evicted_by_memory: u64,
    pub evicted_per_source: BTreeMap<String, u64>,
    pub window_s: f64,
    pub cap_bytes: u64,
}

pub struct Recorder {
    events: VecDeque<Event>,
    bytes: usize,
    window_ns: u64,
    cap_bytes: usize,
    evicted_time: u64,
    evicted_mem: u64,
    evicted_src: BTreeMap<&'static str, u64>,
}

impl Recorder {
    pub fn new(window_ns: u64, cap_bytes: usize) -> Self {
        Self {
            events: VecDeque::new(),
            bytes: 0,
            window_ns,
            cap_bytes,
            evicted_time: 0,
            evicted_mem: 0,
            evicted_src: BTreeMap::new(),
        }
    }

    fn pop_front(&mut self) -> Option<Event> {
        let e = self.events.pop_front()?;
        self.bytes -= e.bytes();
        *self.evicted_src.entry(e.source()).or_default() += 1;
        Some(e)
    }

    /// Add an event. Events arrive nearly in time order (per-CPU ring order); the recorder keeps
    /// arrival order and the exporters sort.
    pub fn push(&mut self, e: Event) {
        self.bytes += e.bytes();
        self.events.push_back(e);
        while self.bytes > self.cap_bytes && self.events.len() > 1 {
            self.pop_front();
            self.evicted_mem += 1;
        }
    }

    /// Drop events older than the window, relative to `now_mono_ns`.
    pub fn expire(&mut self, now_mono_ns: u64) {
        let horizon = now_mono_ns.saturating_sub(self.window_ns);
        while self.events.front().is_some_and(|e| e.mono_ns < horizon) {
            self.pop_front();
            self.evicted_time += 1;
        }
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn iter(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    /// Events sorted by time (a copy, for a bundle).
    pub fn sorted(&self) -> Vec<Event> {
        let mut v: Vec<Event> = self.events.iter().cloned().collect();
        v.sort_by_key(|e| e.mono_ns);
        v
    }

    pub fn stats(&self) -> RecorderStats {
        RecorderStats {
            events: self.events.len() as u64,
            bytes: self.bytes as u64,
            evicted_by_time: self.evicted_time,
            evicted_by_memory: self.evicted_mem,
            evicted_per_source: self.evicted_src.iter().map(|(k, v)| ((*k).to_string(), *v)).collect(),
            window_s: self.window_ns as f64 / 1e9,
            cap_bytes: self.cap_bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Detail, Event};

    fn ev(t: u64) -> Event {
        Event { mono_ns: t, pid: 1, tid: 1, comm: crate::event::Comm::NONE, job: false, detail: Detail::Exit { code: 0, signal: 0 } }
    }

    #[test]
    fn evicts_by_time_and_counts() {
        let mut r = Recorder::new(10, 1 << 20);
        for t in 0..20 {
            r.push(ev(t));
        }
        r.expire(25);
        assert_eq!(r.len(), 5, "events 15..20 remain");
        assert_eq!(r.iter().next().unwrap().mono_ns, 15);
        let s = r.stats();
        assert_eq!((s.evicted_by_time, s.evicted_by_memory), (15, 0));
        assert_eq!(s.evicted_per_source["exit"], 15);
        assert_eq!(r.bytes(), 5 * ev(0).bytes());
    }

    #[test]
    fn evicts_by_memory_cap_and_counts() {
        let one = ev(0).bytes();
        let mut r = Recorder::new(u64::MAX, one * 10);
        for t in 0..25 {
            r.push(ev(t));
        }
        assert_eq!(r.len(), 10);
        assert_eq!(r.stats().evicted_by_memory, 15);
        assert_eq!(r.iter().next().unwrap().mono_ns, 15);
        assert!(r.bytes() <= one * 10);
    }

    #[test]
    fn sorted_orders_by_time() {
        let mut r = Recorder::new(u64::MAX, 1 << 20);
        for t in [5, 3, 9, 1] {
            r.push(ev(t));
        }
        let v: Vec<u64> = r.sorted().iter().map(|e| e.mono_ns).collect();
        assert_eq!(v, vec![1, 3, 5, 9]);
    }

    #[test]
    fn kernel_events_are_compact() {
        // The recorder's per-event cost for the common kernel events (see docs/performance.md).
        assert!(std::mem::size_of::<Event>() <= 56, "Event is {} bytes", std::mem::size_of::<Event>());
        assert_eq!(ev(0).heap_bytes(), 0);
    }
}
