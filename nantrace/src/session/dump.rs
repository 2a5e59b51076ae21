//! One dump, on its own thread: the incident's window (moved from the recorder, not copied)
//! becomes a bundle; the window goes back to the recorder afterwards.
use std::path::PathBuf;

use serde_json::json;

use super::Dumped;
use crate::bundle::{self, Host, Incident, JobInfo};
use crate::clock::ClockMap;
use crate::event::Event;
use crate::recorder::Recorder;
use crate::trigger::Fired;

/// Everything one dump needs, owned, so it runs on its own thread.
pub(super) struct OwnedDump {
    pub(super) out: PathBuf,
    pub(super) host: Host,
    pub(super) clock: ClockMap,
    pub(super) triggers: Vec<Fired>,
    pub(super) job: JobInfo,
    pub(super) accounting: serde_json::Value,
    /// The recorder's two lanes (evidence, logs), moved here.
    pub(super) lanes: crate::recorder::Window,
    /// The agent's node-wide events (hardware, other processes' I/O), copied.
    pub(super) shared: Vec<Event>,
    pub(super) window_pre_s: f64,
    pub(super) post_s: f64,
    /// The snapshot taken at the first trigger (awaited on the dump's thread, not the loop's).
    pub(super) snapshot: Option<tokio::task::JoinHandle<serde_json::Value>>,
    pub(super) make_room: Option<super::RoomHook>,
    /// Check who wrote the window's kernel log lines (`writers`).
    pub(super) check_writers: bool,
}

/// What a dump says when it is done, and the bundle it wrote.
pub(super) struct DumpDone {
    pub(super) lines: Vec<String>,
    pub(super) result: Dumped,
    /// The recorder's lanes, handed back for the next incident's history.
    pub(super) lanes: Option<crate::recorder::Window>,
}

impl DumpDone {
    pub(super) fn failed(line: String) -> Self {
        Self {
            lines: vec![line],
            result: Dumped {
                dir: None,
                verdict: None,
                family: None,
                top_suspect: None,
                top_signal: None,
                top_action: None,
                top_kernel_lines: Vec::new(),
                top_unforgeable: false,
                gpus: Vec::new(),
                faults: Vec::new(),
                gpu_witnesses: Vec::new(),
                trigger: String::new(),
            },
            lanes: None,
        }
    }
}

impl OwnedDump {
    pub(super) fn write(mut self) -> DumpDone {
        let snapshot = match self.snapshot.take() {
            Some(t) => tokio::runtime::Handle::current()
                .block_on(t)
                .unwrap_or_else(|e| json!({ "error": format!("snapshot collector failed: {e}") })),
            None => json!({ "error": "no snapshot taken" }),
        };
        // The job's Flight Recorder dumps, written by torch at its timeout (after the
        // trigger, in the post-window): read now, where the trigger's snapshot said.
        let mut snapshot = snapshot;
        let (fr, flight_copies) = crate::collect::flight::read(&snapshot["flight_recorder"])
            .map_or((None, Vec::new()), |(v, c)| (Some(v), c));
        if let Some(v) = fr.filter(|_| snapshot["flight_recorder"].is_object()) {
            snapshot["flight_recorder"]["read"] = v;
        }
        let mut order = Recorder::by_time(&self.lanes);
        if !self.shared.is_empty() {
            order.extend(self.shared.iter());
            order.sort_by_key(|e| e.mono_ns);
        }
        let mut accounting = self.accounting.clone();
        if self.check_writers {
            if let Some(w) = super::writers::check(&order) {
                accounting["kernel_writers"] = w;
            }
        } else {
            accounting["kernel_writers"] = json!({ "not_checked": "lines root's processes wrote into /dev/kmsg count as the kernel's here (the agent's trust_user_written_kmsg, or a demo's staged fault)" });
        }
        let inc = Incident {
            host: &self.host,
            clock: &self.clock,
            triggers: &self.triggers,
            job: &self.job,
            accounting,
            events: &order,
            window_pre_s: self.window_pre_s,
            post_s: self.post_s,
            flight_copies: &flight_copies,
        };
        let mut lines = Vec::new();
        let mut result = Dumped {
            dir: None,
            verdict: None,
            family: None,
            top_suspect: None,
            top_signal: None,
            top_action: None,
            top_kernel_lines: Vec::new(),
            top_unforgeable: false,
            gpus: Vec::new(),
            faults: Vec::new(),
            gpu_witnesses: Vec::new(),
            trigger: self
                .triggers
                .first()
                .map(|t| t.kind.name().to_string())
                .unwrap_or_default(),
        };
        match self.write_making_room(&inc, &snapshot, &mut lines) {
            Ok(w) => {
                for f in &w.failures {
                    lines.push(format!("nantrace: WARNING: bundle file not written: {f}"));
                }
                if !w.failures.is_empty() {
                    lines.push(format!("nantrace: WARNING: {} is incomplete ({} file(s) missing; its INCOMPLETE.txt lists them)", w.dir.display(), w.failures.len()));
                }
                lines.push(crate::export::summary(
                    &w.dir,
                    &inc,
                    Some(&w.analysis.verdict),
                ));
                result.verdict = Some(w.analysis.verdict.clone());
                result.family = Some(w.analysis.family.clone());
                // The top suspect that is not a consequence of another (report::order).
                let top = w
                    .analysis
                    .suspects
                    .iter()
                    .find(|f| !f.consequence && !f.user_written_only())
                    .or_else(|| w.analysis.suspects.iter().find(|f| !f.consequence));
                result.top_suspect = top.map(|f| f.text.clone());
                result.top_signal = top.map(|f| f.signal);
                result.top_action = top.and_then(|f| f.action);
                result.top_kernel_lines = top.map(|f| f.kernel_lines.clone()).unwrap_or_default();
                result.top_unforgeable = top.is_some_and(|f| f.unforgeable);
                result.gpus = crate::report::implicated_gpus(&w.analysis, &snapshot);
                result.gpu_witnesses = crate::report::implicated_witnesses(&w.analysis);
                // The analysis counts from the first NaN, else the first trigger.
                let reference = crate::bundle::first_nan(inc.events)
                    .map(|e| e.mono_ns)
                    .or(self.triggers.first().map(|t| t.mono_ns))
                    .unwrap_or(0);
                result.faults =
                    crate::report::implicated_faults(&w.analysis, self.clock.to_wall(reference));
                result.dir = Some(w.dir);
            }
            Err(e) => lines.push(format!(
                "nantrace: ERROR: could not write the bundle under {}: {e}",
                self.out.display()
            )),
        }
        drop(inc);
        drop(order);
        DumpDone {
            lines,
            result,
            lanes: Some(self.lanes),
        }
    }

    /// `bundle::write`; when the disk was full and the hook freed room (older bundles
    /// evicted, redteam3 D-12), once more, keeping whichever attempt wrote more.
    fn write_making_room(
        &self,
        inc: &Incident,
        snapshot: &serde_json::Value,
        lines: &mut Vec<String>,
    ) -> std::io::Result<bundle::Written<crate::report::Analysis>> {
        let first = bundle::write(&self.out, inc, snapshot, crate::export::derived);
        let full = match &first {
            Err(e) => e.kind() == std::io::ErrorKind::StorageFull,
            Ok(w) => w.failures.iter().any(|f| f.contains("No space left")),
        };
        let Some(make_room) = self.make_room.as_ref().filter(|_| full) else {
            return first;
        };
        // One dump at a time makes room and tries again: two sessions dumping on the same full
        // disk must not evict each other's first attempts.
        static ROOM: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ROOM
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let freed = make_room(first.as_ref().ok().map(|w| w.dir.as_path()));
        if freed.is_empty() {
            lines.push("nantrace: WARNING: the disk is full and no older bundle could be removed to make room".into());
            return first;
        }
        lines.push(format!("nantrace: the disk was full: removed {} older bundle(s) to make room, and wrote the bundle again", freed.len()));
        match (
            first,
            bundle::write(&self.out, inc, snapshot, crate::export::derived),
        ) {
            (Ok(a), Ok(b)) if b.written >= a.written || !a.dir.exists() => {
                let _ = std::fs::remove_dir_all(&a.dir);
                Ok(b)
            }
            (Ok(a), Ok(b)) => {
                let _ = std::fs::remove_dir_all(&b.dir);
                Ok(a)
            }
            (Ok(a), Err(_)) => Ok(a),
            (Err(_), second) => second,
        }
    }
}
