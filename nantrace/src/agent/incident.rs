//! What the agent does with each bundle a job's session writes: the job directory hears of
//! it, the metrics count it, the incident history remembers it (and appends its section to
//! the report), a drain is decided, and the incident's record goes to `ctl incidents` and the
//! webhook.
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{drain, history, jobdir, lock, Metrics, State, MAX_INCIDENTS_LISTED};
use crate::session::Dumped;

/// The job's side of the agent, moved into its session's dump hook.
pub(super) struct Hook {
    pub key: String,
    pub identity: Value,
    pub host: String,
    pub job_uid: u32,
    pub gpucheck: bool,
    /// `trust_user_written_kmsg`: the history counts GPUs on lines root's processes wrote.
    pub trust_user_written_kmsg: bool,
    pub metrics: Arc<Metrics>,
    pub state: Arc<Mutex<State>>,
    pub webhook: Option<mpsc::Sender<Value>>,
    pub jobdir: Option<std::sync::mpsc::Sender<jobdir::Msg>>,
    pub drainer: Option<Arc<drain::Drainer>>,
    pub history: Arc<Mutex<history::History>>,
}

impl Hook {
    pub fn dumped(&self, d: &Dumped) {
        if let Some(jd) = &self.jobdir {
            let _ = jd.send(jobdir::Msg::Dumped {
                key: self.key.clone(),
                bundle: d.dir.clone(),
            });
        }
        let family = d.family.clone().unwrap_or_else(|| "none".into());
        match &d.dir {
            Some(_) => self.metrics.inc(
                "nantrace_incidents_total",
                &[("trigger", &d.trigger), ("family", &family)],
            ),
            None => self.metrics.inc("nantrace_incident_failures_total", &[]),
        }
        let mut rec = json!({
            "time": crate::clock::rfc3339(crate::clock::realtime_ns()),
            "host": self.host,
            "job": self.key,
            "scheduler": self.identity,
            "trigger": d.trigger,
            "verdict": d.verdict,
            "family": family,
            "top_suspect": d.top_suspect,
            "bundle": d.dir.as_ref().map(|p| p.display().to_string()),
        });
        let mut st = lock(&self.state);
        st.spool_dirty = true;
        if let Some(d) = &d.dir {
            st.bundle_uid.insert(d.clone(), self.job_uid);
        }
        if let Some(j) = st.jobs.get_mut(&self.key) {
            j.incidents += 1;
        }
        if self.gpucheck && d.trigger == "nan" && family == "none" {
            st.gpucheck_queue.extend(d.dir.clone());
        }
        drop(st);
        if let Some(dir) = &d.dir {
            rec["history"] = history::record(
                &self.history,
                &self.metrics,
                d,
                &self.key,
                dir,
                self.trust_user_written_kmsg,
            );
        }
        let (state, webhook, metrics) = (
            self.state.clone(),
            self.webhook.clone(),
            self.metrics.clone(),
        );
        let publish = Box::new(move |rec: Value| {
            let mut st = lock(&state);
            st.incidents.push_back(rec.clone());
            while st.incidents.len() > MAX_INCIDENTS_LISTED {
                st.incidents.pop_front();
            }
            drop(st);
            if let Some(w) = &webhook {
                if w.try_send(rec).is_err() {
                    metrics.inc("nantrace_webhook_failures_total", &[]);
                }
            }
        });
        match &self.drainer {
            Some(dr) => drain::after_dump(
                dr,
                d,
                self.metrics.clone(),
                format!("job {}: ", self.key),
                rec,
                publish,
            ),
            None => publish(rec),
        }
    }
}
