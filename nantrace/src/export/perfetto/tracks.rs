//! Each event on its track, by its source: the job's log lines, periodic samples, block I/O,
//! TCP, the job's processes and their spans, kernel lines; and the tracks' names.
use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{family, hash, Builder, Ev};

/// The job's processes seen so far: forked and not yet exited (start, name), and the spans
/// of those that exited.
pub(super) struct Procs {
    pub(super) open: BTreeMap<u64, (f64, String)>,
    pub(super) lifetimes: Vec<(u64, f64, f64, String)>,
    pub(super) start_ts: f64,
}

impl Builder {
    /// One event on its track, by its source.
    pub(super) fn event(&mut self, e: &Value, ts: f64, procs: &mut Procs) {
        let src = e["source"].as_str().unwrap_or("?");
        match src {
            "log" => self.log_line(e, ts),
            "gpu" | "system" | "job_procs" | "disk" | "net" => self.sample(e, src, ts),
            "block" => self.block(e, ts),
            "tcp_retransmit" => self.retransmit(e, ts),
            "fork" | "exit" | "exec" | "signal" | "oom" => self.process(e, src, ts, procs),
            "kmsg" | "xid" | "aer" => self.kernel_line(e, src, ts),
            "gpu_change" | "nvml_xid" | "net_change" | "scheduler_change" => {
                let name = e["change"]
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| format!("NVML Xid {}", e["xid"]));
                self.instant(ts, family(src), 1, src, &name, e.clone(), false);
            }
            "trigger" => self.instant(
                ts,
                8,
                1,
                "triggers",
                &format!("TRIGGER {}", e["kind"].as_str().unwrap_or("")),
                json!({ "reason": e["reason"] }),
                true,
            ),
            _ => {}
        }
    }

    /// The job's loss and loss scale, its failure lines, its first non-finite value and fp16
    /// overflows.
    fn log_line(&mut self, e: &Value, ts: f64) {
        if let Some(l) = e["loss"].as_f64() {
            self.counter(ts, 5, "loss", json!({ "loss": l }));
        }
        if let Some(s) = e["loss_scale"].as_f64() {
            self.counter(ts, 5, "loss scale", json!({ "loss_scale": s }));
        }
        if e["fault"].is_object() {
            let f = &e["fault"];
            let name = format!(
                "{}: {}",
                f["family"].as_str().unwrap_or("?"),
                f["what"].as_str().unwrap_or("?")
            );
            self.instant(
                ts,
                5,
                3,
                "job errors",
                &name,
                json!({ "line": e["line"], "code": f["code"], "rank": f["rank"] }),
                false,
            );
        }
        if e["nonfinite"] == true {
            self.instant(
                ts,
                5,
                1,
                "non-finite values",
                "non-finite loss",
                json!({ "line": e["line"] }),
                false,
            );
        } else if e["overflow"] == true {
            self.instant(
                ts,
                5,
                2,
                "fp16 overflow",
                "gradient overflow",
                json!({ "line": e["line"] }),
                false,
            );
        }
    }

    /// A periodic sample's counters (GPU, system, the job's RSS, disk await, TCP retransmits/s).
    fn sample(&mut self, e: &Value, src: &str, ts: f64) {
        match src {
            "gpu" => {
                let g = e["gpu"].as_u64().unwrap_or(0);
                for (k, label) in [
                    ("temp_c", "temperature C"),
                    ("power_w", "power W"),
                    ("util_gpu_pct", "utilization %"),
                    ("sm_clock_mhz", "SM clock MHz"),
                ] {
                    if let Some(v) = e[k].as_f64() {
                        self.counter(ts, 2, &format!("GPU{g} {label}"), json!({ k: v }));
                    }
                }
            }
            "system" => {
                for (k, label) in [
                    ("mem_available_kb", "memory available KiB"),
                    ("swap_used_kb", "swap used KiB"),
                    ("cpu_busy_pct", "CPU busy %"),
                    ("iowait_pct", "iowait %"),
                    ("swap_in_kb_s", "swap-in KiB/s"),
                ] {
                    if let Some(v) = e[k].as_f64() {
                        self.counter(ts, 3, label, json!({ k: v }));
                    }
                }
            }
            "job_procs" => {
                if let Some(v) = e["job_rss_kb"].as_f64() {
                    self.counter(ts, 3, "job RSS KiB", json!({ "rss_kb": v }));
                }
            }
            "disk" => {
                if let Some(m) = e["disks"].as_object() {
                    for (d, v) in m {
                        self.counter(
                            ts,
                            7,
                            &format!("{d} await ms"),
                            json!({ "r_await_ms": v["r_await_ms"], "w_await_ms": v["w_await_ms"] }),
                        );
                    }
                }
            }
            "net" => {
                if let Some(v) = e["tcp_retrans_per_s"].as_f64() {
                    self.counter(ts, 6, "TCP retransmits/s", json!({ "retrans_per_s": v }));
                }
            }
            _ => {}
        }
    }

    /// A block request's latency, and its error when it failed.
    fn block(&mut self, e: &Value, ts: f64) {
        let dev = e["dev"].as_str().unwrap_or("?");
        self.counter(
            ts,
            7,
            &format!("I/O latency ms {dev}"),
            json!({ "latency_ms": e["latency_ms"] }),
        );
        if e["error"].as_i64().is_some_and(|x| x != 0) {
            self.instant(
                ts,
                7,
                hash(dev),
                &format!("block {dev}"),
                "I/O error",
                json!({ "error": e["error"], "sector": e["sector"] }),
                false,
            );
        }
    }

    /// A TCP retransmission, on its peer's track.
    fn retransmit(&mut self, e: &Value, ts: f64) {
        let peer = format!("{}:{}", e["daddr"].as_str().unwrap_or("?"), e["dport"]);
        self.instant(
            ts,
            6,
            hash(&peer),
            &format!("peer {peer}"),
            "retransmit",
            json!({ "saddr": e["saddr"], "sport": e["sport"], "state": e["state"] }),
            false,
        );
    }

    /// The job's processes: forks and exits (which make their lifetimes), execs, signals, OOM
    /// kills.
    fn process(&mut self, e: &Value, src: &str, ts: f64, procs: &mut Procs) {
        let pid = e["pid"].as_u64().unwrap_or(0);
        let comm = e["comm"].as_str().unwrap_or("");
        let (open, lifetimes, start_ts) = (&mut procs.open, &mut procs.lifetimes, procs.start_ts);
        match src {
            "fork" => {
                let child = e["child_pid"].as_u64().unwrap_or(0);
                open.insert(
                    child,
                    (ts, e["child_comm"].as_str().unwrap_or("").to_string()),
                );
                self.instant(
                    ts,
                    4,
                    pid,
                    &format!("{comm} {pid}"),
                    &format!("fork {child}"),
                    json!({ "child_comm": e["child_comm"] }),
                    false,
                );
            }
            "exit" => {
                let (start, name) = open.remove(&pid).unwrap_or((start_ts, comm.to_string()));
                lifetimes.push((pid, start, ts, name));
                let what = match (e["exit_code"].as_i64(), e["signal"].as_str()) {
                    (_, Some(s)) if e["core_dumped"] == true => format!("{s} (core dumped)"),
                    (_, Some(s)) => s.to_string(),
                    (Some(c), _) => format!("exit {c}"),
                    _ => "exit".into(),
                };
                self.instant(ts, 4, pid, &format!("{comm} {pid}"), &what, json!({ "exit_code": e["exit_code"], "signal": e["signal"], "core_dumped": e["core_dumped"] == true }), false);
            }
            "exec" | "signal" | "oom" => {
                let name = match src {
                    "signal" => format!(
                        "{} -> {}",
                        e["signal"].as_str().unwrap_or("?"),
                        e["target_pid"]
                    ),
                    "oom" => format!("OOM kill {}", e["victim_pid"]),
                    _ => format!("exec {}", e["filename"].as_str().unwrap_or("")),
                };
                let tid = if src == "exec" {
                    pid
                } else {
                    e["target_pid"]
                        .as_u64()
                        .or(e["victim_pid"].as_u64())
                        .unwrap_or(pid)
                };
                self.instant(
                    ts,
                    4,
                    tid,
                    &format!("process {tid}"),
                    &name,
                    e.clone(),
                    src == "oom",
                );
            }
            _ => {}
        }
    }

    /// A kernel log line: the hardware's errors (Xid, AER) on their own track, critical ones
    /// across the whole trace.
    fn kernel_line(&mut self, e: &Value, src: &str, ts: f64) {
        let name = match e["class"].as_str() {
            Some("xid") => format!("Xid {}", e["xid"]),
            Some(c) => c.to_string(),
            None if src == "aer" => "AER".to_string(),
            None => "kmsg".to_string(),
        };
        let global = matches!(e["severity"].as_str(), Some("critical"));
        self.instant(
            ts,
            1,
            if src == "kmsg" { 1 } else { 2 },
            if src == "kmsg" {
                "kernel log"
            } else {
                "hardware errors"
            },
            &name,
            json!({ "text": e["text"], "severity": e["severity"] }),
            global,
        );
    }

    /// The job's processes' spans: each exited one, the ones still running at the end, and
    /// the job's root when it was never seen to fork.
    pub(super) fn lifetimes(&mut self, procs: Procs, root: Option<u64>, end_ts: f64) {
        let Procs {
            open,
            mut lifetimes,
            start_ts,
        } = procs;
        // Job processes still running at the end of the window.
        for (pid, (start, name)) in open {
            lifetimes.push((pid, start, end_ts, name));
        }
        if let Some(r) = root {
            if !lifetimes.iter().any(|l| l.0 == r) {
                lifetimes.push((r, start_ts, end_ts, "job root".into()));
            }
        }
        for (pid, start, end, name) in lifetimes {
            let (p, t) = self.thread(4, pid, &format!("{name} {pid}"));
            self.out.push(Ev {
                name: format!("{name} {pid}"),
                ph: "B",
                s: None,
                ts: Some(start),
                pid: p,
                tid: t,
                args: Value::Null,
            });
            self.out.push(Ev {
                name: format!("{name} {pid}"),
                ph: "E",
                s: None,
                ts: Some(end.max(start)),
                pid: p,
                tid: t,
                args: Value::Null,
            });
        }
    }

    /// The tracks' names and order (`M` events), each named for the node in a merged trace.
    pub(super) fn metadata(&self, prefix: String) -> Vec<Ev> {
        let mut meta = Vec::new();
        let families: std::collections::BTreeSet<(u64, &str)> = crate::source::Source::ALL
            .iter()
            .map(|s| s.trace_family())
            .collect();
        for (fam, name) in &families {
            meta.push(Ev {
                name: "process_name".into(),
                ph: "M",
                s: None,
                ts: None,
                pid: self.pid(*fam),
                tid: 0,
                args: json!({ "name": format!("{prefix}{name}") }),
            });
            meta.push(Ev {
                name: "process_sort_index".into(),
                ph: "M",
                s: None,
                ts: None,
                pid: self.pid(*fam),
                tid: 0,
                args: json!({ "sort_index": self.pid(*fam) }),
            });
        }
        for ((p, t), n) in &self.threads {
            meta.push(Ev {
                name: "thread_name".into(),
                ph: "M",
                s: None,
                ts: None,
                pid: *p,
                tid: *t,
                args: json!({ "name": n }),
            });
        }
        meta
    }
}
