//! The flight recorder: every event from every source, bounded by a time window and a memory
//! cap. The oldest go first; evictions are counted by cause and by source.
//!
//! Two classes share the cap: the job's log lines, and everything else (kernel, hardware,
//! system evidence). When the cap is reached, log lines evict log lines first; evidence is
//! evicted only while it holds more than its reserved share (`EVIDENCE_SHARE` of the cap), so a
//! log flood cannot push an Xid out of the window. Memory evictions are counted per source:
//! the report says the window is incomplete for a source that lost events.
use std::collections::{BTreeMap, VecDeque};

use crate::event::{Detail, Event};

#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct RecorderStats {
    pub events: u64,
    pub bytes: u64,
    pub evicted_by_time: u64,
    pub evicted_by_memory: u64,
    /// Events evicted (by time or memory) per source.
    pub evicted_per_source: BTreeMap<String, u64>,
    /// Events evicted by the memory cap per source (the window is incomplete for these).
    pub evicted_by_memory_per_source: BTreeMap<String, u64>,
    pub window_s: f64,
    pub cap_bytes: u64,
}

#[derive(Default)]
struct Lane {
    events: EventQueue,
    bytes: usize,
}

/// Events per chunk of an [`EventQueue`] (12 KiB of events).
const CHUNK: usize = 256;

/// A FIFO of events in fixed chunks: its memory follows the number of events (at most one
/// chunk is partly empty at each end), where a `VecDeque` doubles and then keeps up to half of
/// its capacity empty. Moving a whole queue (a dump's window) moves chunk pointers only.
#[derive(Default)]
pub struct EventQueue {
    chunks: VecDeque<Chunk>,
    len: usize,
}

struct Chunk {
    /// `None` before `head` (popped); `Option<Event>` is as small as `Event` (niche).
    items: Vec<Option<Event>>,
    head: usize,
}

impl EventQueue {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Event slots allocated.
    pub fn capacity(&self) -> usize {
        self.chunks.len() * CHUNK
    }

    /// Pushing now allocates a chunk.
    fn full(&self) -> bool {
        self.chunks.back().is_none_or(|c| c.items.len() == CHUNK)
    }

    pub fn push_back(&mut self, e: Event) {
        if self.full() {
            self.chunks.push_back(Chunk {
                items: Vec::with_capacity(CHUNK),
                head: 0,
            });
        }
        if let Some(c) = self.chunks.back_mut() {
            c.items.push(Some(e));
            self.len += 1;
        }
    }

    pub fn pop_front(&mut self) -> Option<Event> {
        let several = self.chunks.len() > 1;
        let c = self.chunks.front_mut()?;
        let e = c.items.get_mut(c.head)?.take();
        c.head += 1;
        if c.head == c.items.len() {
            if several || c.items.len() == CHUNK {
                self.chunks.pop_front();
            } else {
                c.items.clear();
                c.head = 0;
            }
        }
        self.len -= 1;
        e
    }

    pub fn front(&self) -> Option<&Event> {
        let c = self.chunks.front()?;
        c.items.get(c.head)?.as_ref()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Event> {
        self.chunks
            .iter()
            .flat_map(|c| c.items[c.head..].iter().filter_map(Option::as_ref))
    }

    /// `other`'s events after this queue's.
    fn append(&mut self, mut other: EventQueue) {
        self.len += other.len;
        self.chunks.append(&mut other.chunks);
    }
}

/// A dump's window: the recorder's two queues (evidence, logs), moved out.
pub type Window = (EventQueue, EventQueue);

pub struct Recorder {
    logs: Lane,
    evidence: Lane,
    window_ns: u64,
    cap_bytes: usize,
    evicted_time: u64,
    evicted_mem: u64,
    evicted_src: BTreeMap<&'static str, u64>,
    evicted_mem_src: BTreeMap<&'static str, u64>,
}

/// The share of the cap that log lines cannot take from kernel/hardware/system evidence.
pub const EVIDENCE_SHARE: f64 = 0.5;

impl Recorder {
    pub fn new(window_ns: u64, cap_bytes: usize) -> Self {
        Self {
            logs: Lane::default(),
            evidence: Lane::default(),
            window_ns,
            cap_bytes,
            evicted_time: 0,
            evicted_mem: 0,
            evicted_src: BTreeMap::new(),
            evicted_mem_src: BTreeMap::new(),
        }
    }

    fn lane(&mut self, log: bool) -> &mut Lane {
        if log {
            &mut self.logs
        } else {
            &mut self.evidence
        }
    }

    fn pop_front(&mut self, log: bool) -> Option<&'static str> {
        let lane = self.lane(log);
        let e = lane.events.pop_front()?;
        lane.bytes -= e.heap_bytes();
        let src = e.source();
        *self.evicted_src.entry(src).or_default() += 1;
        Some(src)
    }

    /// Add an event. Events arrive nearly in time order (per-CPU ring order); the recorder keeps
    /// arrival order and the exporters sort.
    pub fn push(&mut self, e: Event) {
        let log = matches!(e.detail, Detail::Log(_));
        let lane = self.lane(log);
        lane.bytes += e.heap_bytes();
        lane.events.push_back(e);
        while self.bytes() > self.cap_bytes && self.len() > 1 {
            let reserved = (self.cap_bytes as f64 * EVIDENCE_SHARE) as usize;
            let lane_bytes =
                |l: &Lane| l.bytes + l.events.capacity() * std::mem::size_of::<Event>();
            let (logs_b, ev_b) = (lane_bytes(&self.logs), lane_bytes(&self.evidence));
            // Logs go first, unless evidence holds more than its share or there are no logs.
            let from_logs = !self.logs.events.is_empty()
                && (ev_b <= reserved || logs_b > self.cap_bytes - reserved.min(self.cap_bytes));
            let from_logs = from_logs || self.evidence.events.is_empty();
            let Some(src) = self.pop_front(from_logs) else {
                break;
            };
            *self.evicted_mem_src.entry(src).or_default() += 1;
            self.evicted_mem += 1;
        }
    }

    /// A new memory cap (the agent shares one budget among its jobs): over it, the oldest
    /// events go now, counted as memory evictions. Shrinking the queues gives memory back.
    pub fn set_cap(&mut self, cap_bytes: usize) {
        self.cap_bytes = cap_bytes;
        while self.bytes() > self.cap_bytes && self.len() > 1 {
            let log = self.logs.bytes >= self.evidence.bytes && !self.logs.events.is_empty();
            if let Some(src) = self.pop_front(log || self.evidence.events.is_empty()) {
                *self.evicted_mem_src.entry(src).or_default() += 1;
                self.evicted_mem += 1;
            }
        }
    }

    /// Drop events older than the window, relative to `now_mono_ns`.
    pub fn expire(&mut self, now_mono_ns: u64) {
        let horizon = now_mono_ns.saturating_sub(self.window_ns);
        for log in [true, false] {
            while self
                .lane(log)
                .events
                .front()
                .is_some_and(|e| e.mono_ns < horizon)
            {
                self.pop_front(log);
                self.evicted_time += 1;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.logs.events.len() + self.evidence.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory the window really holds: the events' heap parts plus the two queues'
    /// capacity (a grown queue does not shrink; the cap counts it, so fewer events fit).
    pub fn bytes(&self) -> usize {
        self.logs.bytes
            + self.evidence.bytes
            + (self.logs.events.capacity() + self.evidence.events.capacity())
                * std::mem::size_of::<Event>()
    }

    /// Every event, evidence first then log lines (not in time order: see `sorted`).
    pub fn iter(&self) -> impl Iterator<Item = &Event> {
        self.evidence.events.iter().chain(self.logs.events.iter())
    }

    /// Events sorted by time (a copy, for a bundle).
    pub fn sorted(&self) -> Vec<Event> {
        let mut v: Vec<Event> = self.iter().cloned().collect();
        v.sort_by_key(|e| e.mono_ns);
        v
    }

    /// Both lanes (evidence, logs), moved out without copying: a dump takes the window and
    /// recording goes on. [`Recorder::by_time`] orders them.
    pub fn take_lanes(&mut self) -> Window {
        let mut take = |log: bool| {
            let lane = self.lane(log);
            lane.bytes = 0;
            std::mem::take(&mut lane.events)
        };
        (take(false), take(true))
    }

    /// Give back the lanes a dump took: they go before what was recorded during the dump, so
    /// the next incident still has the history (then the window and the cap apply as usual).
    pub fn restore(&mut self, lanes: Window) {
        for (log, mut old) in [(false, lanes.0), (true, lanes.1)] {
            let lane = self.lane(log);
            let newer = std::mem::take(&mut lane.events);
            old.append(newer);
            lane.bytes = old.iter().map(Event::heap_bytes).sum();
            lane.events = old;
        }
        while self.bytes() > self.cap_bytes && self.len() > 1 {
            let log = self.logs.bytes >= self.evidence.bytes && !self.logs.events.is_empty();
            if let Some(src) = self.pop_front(log || self.evidence.events.is_empty()) {
                *self.evicted_mem_src.entry(src).or_default() += 1;
                self.evicted_mem += 1;
            }
        }
    }

    /// References to the events of both lanes in time order (8 bytes per event, not a copy;
    /// a stable sort: lines of one chunk keep their order).
    pub fn by_time(lanes: &Window) -> Vec<&Event> {
        let mut v: Vec<&Event> = lanes.0.iter().chain(lanes.1.iter()).collect();
        v.sort_by_key(|e| e.mono_ns);
        v
    }

    pub fn stats(&self) -> RecorderStats {
        RecorderStats {
            events: self.len() as u64,
            bytes: self.bytes() as u64,
            evicted_by_time: self.evicted_time,
            evicted_by_memory: self.evicted_mem,
            evicted_per_source: self
                .evicted_src
                .iter()
                .map(|(k, v)| ((*k).to_string(), *v))
                .collect(),
            evicted_by_memory_per_source: self
                .evicted_mem_src
                .iter()
                .map(|(k, v)| ((*k).to_string(), *v))
                .collect(),
            window_s: self.window_ns as f64 / 1e9,
            cap_bytes: self.cap_bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn event_queue_is_a_fifo_whose_memory_follows_its_length() {
        use super::{EventQueue, CHUNK};
        assert_eq!(
            std::mem::size_of::<Option<Event>>(),
            std::mem::size_of::<Event>()
        );
        let mut q = EventQueue::default();
        for t in 0..(3 * CHUNK as u64 + 10) {
            q.push_back(ev(t));
        }
        assert_eq!((q.len(), q.capacity()), (3 * CHUNK + 10, 4 * CHUNK));
        for t in 0..(2 * CHUNK as u64 + 5) {
            assert_eq!(q.pop_front().unwrap().mono_ns, t);
        }
        // Two chunks went back to the allocator as soon as they were empty.
        assert_eq!((q.len(), q.capacity()), (CHUNK + 5, 2 * CHUNK));
        assert_eq!(q.front().unwrap().mono_ns, 2 * CHUNK as u64 + 5);
        let rest: Vec<u64> = q.iter().map(|e| e.mono_ns).collect();
        assert_eq!(rest.len(), CHUNK + 5);
        assert!(rest.windows(2).all(|w| w[1] == w[0] + 1));
        let mut older = EventQueue::default();
        older.push_back(ev(1));
        older.append(q);
        assert_eq!(older.len(), CHUNK + 6);
        while older.pop_front().is_some() {}
        assert!(older.is_empty() && older.front().is_none());
        // A single partly used chunk is reused, not freed and reallocated.
        older.push_back(ev(9));
        older.pop_front();
        assert_eq!(older.capacity(), CHUNK);
    }

    use super::*;
    use crate::event::{Detail, Event};

    fn ev(t: u64) -> Event {
        Event::new(
            t,
            1,
            1,
            crate::event::Comm::NONE,
            false,
            Detail::Exit {
                code: 0,
                signal: 0,
                tid: 0,
                core_dumped: false,
            },
        )
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
        // Exit events have no heap part: what the window holds is its queue.
        assert_eq!(
            r.bytes(),
            r.evidence.events.capacity() * std::mem::size_of::<Event>()
        );
    }

    #[test]
    fn evicts_by_memory_cap_and_counts() {
        let cap = 64 << 10;
        let mut r = Recorder::new(u64::MAX, cap);
        for t in 0..5_000 {
            r.push(ev(t));
        }
        let s = r.stats();
        assert!(r.bytes() <= cap, "{} > {cap}", r.bytes());
        assert_eq!(
            s.evicted_by_memory + r.len() as u64,
            5_000,
            "every event is kept or counted"
        );
        assert!(r.len() > 300, "{}", r.len());
        assert_eq!(
            r.iter().next().unwrap().mono_ns,
            5_000 - r.len() as u64,
            "the oldest went first"
        );
        assert_eq!(s.evicted_by_memory_per_source["exit"], s.evicted_by_memory);
    }

    fn log(t: u64) -> Event {
        let l = crate::event::LogLine {
            text: "step 1 loss 2.0".into(),
            stream: 1,
            nonfinite: false,
            step: None,
            loss: None,
            loss_scale: None,
            overflow: false,
            fault: None,
        };
        Event::new(
            t,
            1,
            1,
            crate::event::Comm::NONE,
            true,
            Detail::Log(Box::new(l)),
        )
    }

    #[test]
    fn a_log_flood_does_not_evict_kernel_evidence() {
        // Redteam 7.5: an Xid, then a flood of log lines far over the cap.
        let cap = 256 << 10;
        let mut r = Recorder::new(u64::MAX, cap);
        r.push(ev(0));
        for t in 1..100_000 {
            r.push(log(t));
        }
        assert!(r.bytes() <= cap);
        assert_eq!(
            r.iter().filter(|e| e.source() == "exit").count(),
            1,
            "the evidence event survived"
        );
        let s = r.stats();
        assert_eq!(s.evicted_by_memory_per_source.get("exit"), None);
        assert!(s.evicted_by_memory_per_source["log"] > 95_000, "{s:?}");
        // Evidence beyond its share is evicted (oldest first) when logs also fill theirs.
        let mut r = Recorder::new(u64::MAX, cap);
        for t in 0..10_000 {
            r.push(if t % 2 == 0 { ev(t) } else { log(t) });
        }
        assert!(r.bytes() <= cap);
        assert!(r.stats().evicted_by_memory_per_source["exit"] > 0);
        assert!(r.iter().any(|e| e.source() == "log") && r.iter().any(|e| e.source() == "exit"));
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
        assert!(
            std::mem::size_of::<Event>() <= 48,
            "Event is {} bytes",
            std::mem::size_of::<Event>()
        );
        assert_eq!(ev(0).heap_bytes(), 0);
    }
}
