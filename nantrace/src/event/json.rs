//! An event as JSON (docs/events.md): the header, then the fields of what happened, by kind.
use serde_json::{json, Map, Value};

use super::{
    aer_severity_name, comm_str, cstr16, dev_name, disk_name, signal_name, tcp_state, Detail,
    Event, Kmsg, LogLine,
};
use crate::clock::{rfc3339, ClockMap};

impl Event {
    /// The JSON object of this event (see docs/events.md).
    pub fn to_json(&self, clock: &ClockMap) -> Value {
        let mut m = Map::new();
        m.insert("time".into(), rfc3339(clock.to_wall(self.mono_ns)).into());
        m.insert("mono_ns".into(), self.mono_ns.into());
        m.insert("source".into(), self.source().into());
        m.insert("pid".into(), self.pid.into());
        m.insert("tid".into(), self.tid().into());
        m.insert("comm".into(), comm_str(&self.comm).into());
        m.insert("job".into(), self.job().into());
        self.detail_json(&mut m);
        Value::Object(m)
    }

    /// The fields of what happened, by kind.
    fn detail_json(&self, m: &mut Map<String, Value>) {
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        match &self.detail {
            Detail::Kmsg(k) => self.kmsg_json(k, &mut put),
            Detail::Aer(a) => {
                put("device", a.device.clone().into());
                put("status", format!("{:#010x}", a.status).into());
                put("aer_severity", aer_severity_name(a.severity).into());
                put(
                    "severity",
                    match a.severity {
                        1 => "critical",
                        0 => "error",
                        _ => "warning",
                    }
                    .into(),
                );
                put(
                    "tlp_header",
                    a.tlp_header
                        .map_or(Value::Null, |t| json!(t.map(|w| format!("{w:08x}")))),
                );
            }
            Detail::Oom(o) => {
                put("victim_pid", o.victim_pid.into());
                put("victim_comm", comm_str(&o.victim_comm).into());
                put("victim_job", o.victim_job.into());
                put("uid", o.uid.into());
                put("total_vm_kb", o.total_vm.into());
                put("anon_rss_kb", o.anon_rss.into());
                put("file_rss_kb", o.file_rss.into());
                put("shmem_rss_kb", o.shmem_rss.into());
                put("pgtables_kb", o.pgtables.into());
                put("oom_score_adj", o.oom_score_adj.into());
            }
            Detail::Block {
                dev,
                error,
                sector,
                latency_us,
                nr_sector,
                rwbs,
            } => {
                put("dev", dev_name(*dev).into());
                if let Some(n) = disk_name(*dev) {
                    put("disk", n.into());
                }
                put("error", (*error).into());
                put("sector", (*sector).into());
                put("latency_ms", (f64::from(*latency_us) / 1e3).into());
                put("bytes", (u64::from(*nr_sector) * 512).into());
                put("rwbs", cstr16(rwbs).into());
            }
            Detail::Tcp(t) => {
                put("saddr", t.saddr.to_string().into());
                put("sport", t.sport.into());
                put("daddr", t.daddr.to_string().into());
                put("dport", t.dport.into());
                put("state", tcp_state(t.state).into());
            }
            Detail::Fork {
                child_pid,
                child_comm,
                ..
            } => {
                put("child_pid", (*child_pid).into());
                put("child_comm", comm_str(child_comm).into());
            }
            Detail::Exec { filename } => put("filename", filename.as_ref().into()),
            Detail::Exit {
                code,
                signal,
                core_dumped,
                ..
            } => {
                exit_json(*code, *signal, *core_dumped, &mut put);
            }
            Detail::Signal {
                sig,
                code,
                target_pid,
                result,
                target_comm,
                ..
            } => {
                put("signal", signal_name(*sig).into());
                put("signo", (*sig).into());
                put("si_code", (*code).into());
                put("target_pid", (*target_pid).into());
                put("target_comm", comm_str(target_comm).into());
                put("result", (*result).into());
            }
            Detail::Log(l) => log_json(l, &mut put),
            Detail::Sample { fields, .. } => {
                for (k, v) in fields.iter() {
                    put(k, v.clone());
                }
            }
            Detail::Trigger { kind, reason } => {
                put("kind", (*kind).into());
                put("reason", reason.as_str().into());
            }
        }
    }

    /// A kernel log line: its text, and its class's fields.
    fn kmsg_json(&self, k: &Kmsg, put: &mut impl FnMut(&str, Value)) {
        put("text", k.text.as_ref().into());
        if let Some(q) = k.seq() {
            put("kmsg_seq", q.into());
        }
        if self.kmsg_truncated() {
            put("truncated", true.into());
        }
        if let Some(c) = k.class() {
            put(
                "severity",
                serde_json::to_value(c.severity()).unwrap_or(Value::Null),
            );
            if let Ok(Value::Object(cm)) = serde_json::to_value(c) {
                for (key, v) in cm {
                    if key != "severity" {
                        put(&key, v);
                    }
                }
            }
        }
    }
}

/// An exit: its code, or the signal that ended it, and a core dump.
fn exit_json(code: i32, signal: i32, core_dumped: bool, put: &mut impl FnMut(&str, Value)) {
    put(
        "exit_code",
        if code >= 0 { code.into() } else { Value::Null },
    );
    put(
        "signal",
        if signal > 0 {
            signal_name(signal).into()
        } else {
            Value::Null
        },
    );
    put("signo", signal.into());
    if core_dumped {
        put("core_dumped", true.into());
    }
}

/// A line of the job's output: the line, its stream, what the NaN scanner and the failure
/// classifier read in it.
fn log_json(l: &LogLine, put: &mut impl FnMut(&str, Value)) {
    put("line", l.text.as_ref().into());
    put(
        "stream",
        match l.stream {
            1 => "stdout",
            2 => "stderr",
            3 => "stdout+stderr",
            _ => "file",
        }
        .into(),
    );
    if l.nonfinite {
        put("nonfinite", true.into());
    }
    if let Some(s) = l.step {
        put("step", s.into());
    }
    if let Some(v) = l.loss {
        put(
            "loss",
            if v.is_finite() {
                v.into()
            } else {
                v.to_string().into()
            },
        );
    }
    if let Some(v) = l.loss_scale {
        put("loss_scale", v.into());
    }
    if l.overflow {
        put("overflow", true.into());
    }
    if let Some(f) = &l.fault {
        put("fault", serde_json::to_value(f).unwrap_or(Value::Null));
    }
}
