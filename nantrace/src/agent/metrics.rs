//! Prometheus metrics: counters and gauges with labels, rendered in the text exposition
//! format, served on `GET /metrics` by a minimal HTTP/1.1 responder (one request per
//! connection, bounded request size and time). GPU gauges dcgm-exporter already exports
//! (temperature, power, utilisation, ECC) are left to it.
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// name -> (help, type)
const FAMILIES: &[(&str, &str, &str)] = &[
    ("nantrace_build_info", "gauge", "Version of the running agent (value 1)."),
    ("nantrace_xid_total", "counter", "NVIDIA Xid events seen in the kernel log, by Xid code and GPU PCI address."),
    ("nantrace_sxid_total", "counter", "NVSwitch SXid events seen in the kernel log, by code."),
    ("nantrace_aer_total", "counter", "PCIe AER errors seen in the kernel log, by severity and device."),
    ("nantrace_oom_kills_total", "counter", "OOM kills seen by the kernel probe, by whether the victim belonged to a watched job."),
    ("nantrace_kernel_errors_total", "counter", "Classified kernel log lines (MCE, hung task, soft lockup, NFS, NIC, block errors...), by class."),
    ("nantrace_job_output_failures_total", "counter", "Failure lines in watched jobs' output, by family (gpu_hw, network, storage, ...)."),
    ("nantrace_incidents_total", "counter", "Bundles written, by trigger and verdict family."),
    ("nantrace_incident_failures_total", "counter", "Incidents whose bundle could not be written."),
    ("nantrace_jobs_watched", "gauge", "Training jobs the agent is watching now."),
    ("nantrace_jobs_not_watched", "gauge", "Training jobs found but not watched (max_jobs or max_jobs_per_user reached)."),
    ("nantrace_jobs_seen_total", "counter", "Training jobs discovered since the agent started, by kind (slurm, kubernetes, process)."),
    ("nantrace_ringbuf_drops_total", "counter", "Kernel events lost because the ring buffer was full, by source."),
    ("nantrace_events_total", "counter", "Kernel events received from the probes, by source."),
    ("nantrace_events_dropped_total", "counter", "Events dropped in userspace, by reason."),
    ("nantrace_probes_attached", "gauge", "Kernel probes attached."),
    ("nantrace_probes_failed", "gauge", "Kernel probes that could not be attached."),
    ("nantrace_spool_bytes", "gauge", "Bytes of bundles in the spool directory."),
    ("nantrace_spool_bundles", "gauge", "Bundles in the spool directory."),
    ("nantrace_spool_incomplete_bundles", "gauge", "Bundles in the spool kept incomplete: their writer died (kept at the agent's start) or the disk refused some of their files."),
    ("nantrace_spool_limit_bytes", "gauge", "The spool's size limit (spool_max_mb), in bytes."),
    ("nantrace_spool_removed_total", "counter", "Bundles removed by the spool's size or age limit."),
    ("nantrace_recorder_bytes", "gauge", "Bytes held by the flight recorders (node-wide and per job)."),
    ("nantrace_webhook_failures_total", "counter", "Incident webhooks that failed after all retries."),
    ("nantrace_discovery_seconds", "gauge", "Duration of the last /proc scan for jobs."),
    ("nantrace_job_dir_ok", "gauge", "1 when the job directory (job_dir) is in use, 0 when it was refused."),
    ("nantrace_job_dir_failures_total", "counter", "Job-wide incidents not opened or bundles not shared in the job directory."),
    ("nantrace_gpu_implicated_total", "counter", "Incidents whose verdict implicated this GPU on the kernel's or NVML's evidence, by GPU PCI address (from the durable incident history: it survives restarts)."),
    ("nantrace_gpu_incidents_7d", "gauge", "Incidents that implicated this GPU in the last 7 days, from the durable incident history, by GPU PCI address."),
    ("nantrace_last_incident_timestamp_seconds", "gauge", "Unix time of this node's last incident bundle."),
    ("nantrace_block_losses_total", "counter", "What the block probes could not keep or attribute to a job, by what (accounting.block_losses in docs/bundle.md): e.g. completions_without_issuer_on_job_devices, job_requests_not_attributed."),
    ("nantrace_node_triggers_total", "counter", "Node-wide triggers (a fatal Xid outside any job), by result: fired (every job on that GPU dumped), unverified (its kernel log line was not the kernel's: written from user space; no job dumped)."),
    ("nantrace_drains_total", "counter", "What each incident did about draining this node (drain in agent.toml), by result: drained, recommended, held_by_cap, already_drained, not_needed, unverified, failed."),
];

#[derive(Default)]
pub struct Metrics {
    values: Mutex<BTreeMap<(&'static str, String), f64>>,
}

/// Label values are escaped as the exposition format requires (untrusted text: a process name,
/// a device string).
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars().take(128) {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c if c.is_control() => {}
            c => s.push(c),
        }
    }
    s
}

fn labels(l: &[(&str, &str)]) -> String {
    if l.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = l
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{{{}}}", parts.join(","))
}

impl Metrics {
    fn check(name: &str) -> &'static str {
        FAMILIES
            .iter()
            .find(|f| f.0 == name)
            .map(|f| f.0)
            .unwrap_or_else(|| panic!("metric {name} is not declared"))
    }

    pub fn add(&self, name: &str, l: &[(&str, &str)], v: f64) {
        let k = (Self::check(name), labels(l));
        *self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(k)
            .or_default() += v;
    }

    pub fn inc(&self, name: &str, l: &[(&str, &str)]) {
        self.add(name, l, 1.0);
    }

    pub fn set(&self, name: &str, l: &[(&str, &str)], v: f64) {
        let k = (Self::check(name), labels(l));
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(k, v);
    }

    /// Replace every series of one family (gauges recomputed as a whole, e.g. drops per source).
    pub fn set_all(&self, name: &str, series: &[(Vec<(&str, &str)>, f64)]) {
        let n = Self::check(name);
        let mut m = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.retain(|k, _| k.0 != n);
        for (l, v) in series {
            m.insert((n, labels(l)), *v);
        }
    }

    pub fn get(&self, name: &str, l: &[(&str, &str)]) -> f64 {
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(Self::check(name), labels(l)))
            .copied()
            .unwrap_or(0.0)
    }

    /// The text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let m = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = String::new();
        for (name, kind, help) in FAMILIES {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for ((n, l), v) in m.range((*name, String::new())..) {
                if n != name {
                    break;
                }
                out.push_str(&format!("{name}{l} {v}\n"));
            }
        }
        out
    }
}

/// Serve `GET /metrics` on `addr` until the process ends.
pub async fn serve(
    addr: std::net::SocketAddr,
    metrics: std::sync::Arc<Metrics>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    crate::say!("nantrace: metrics on http://{addr}/metrics");
    // At most 32 connections wait for their request at once: a new one pushes out the oldest
    // that has not sent its request yet, so idle connections cannot keep a scraper out
    // (re-review D4). An accept error (EMFILE) backs off instead of spinning (review 3).
    let waiting: std::sync::Arc<
        std::sync::Mutex<std::collections::VecDeque<(u64, tokio::task::AbortHandle)>>,
    > = std::sync::Arc::default();
    tokio::spawn(async move {
        let mut next_id = 0u64;
        loop {
            let mut conn = match listener.accept().await {
                Ok((c, _)) => c,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            let id = next_id;
            next_id += 1;
            let waiting2 = waiting.clone();
            let task = tokio::spawn(async move {
                // The request head only, at most 8 KiB within 2 s: a slow or huge client gets nothing.
                let mut buf = vec![0u8; 8192];
                let mut n = 0;
                let head = tokio::time::timeout(Duration::from_secs(2), async {
                    while n < buf.len() {
                        match conn.read(&mut buf[n..]).await {
                            Ok(0) | Err(_) => return false,
                            Ok(k) => n += k,
                        }
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n")
                            || buf[..n].windows(2).any(|w| w == b"\n\n")
                        {
                            return true;
                        }
                    }
                    false
                })
                .await
                .unwrap_or(false);
                waiting2
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .retain(|w| w.0 != id);
                if !head {
                    return;
                }
                let first = String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string();
                let mut parts = first.split_whitespace();
                let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                let (status, ctype, body) =
                    if method == "GET" && (path == "/metrics" || path.starts_with("/metrics?")) {
                        (
                            "200 OK",
                            "text/plain; version=0.0.4; charset=utf-8",
                            metrics.render(),
                        )
                    } else if method == "GET" && path == "/" {
                        (
                            "200 OK",
                            "text/plain; charset=utf-8",
                            "nantrace agent: see /metrics\n".to_string(),
                        )
                    } else {
                        (
                            "404 Not Found",
                            "text/plain; charset=utf-8",
                            "not found\n".to_string(),
                        )
                    };
                let resp = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), conn.write_all(resp.as_bytes()))
                        .await;
                let _ = conn.shutdown().await;
            });
            let mut w = waiting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !task.is_finished() {
                w.push_back((id, task.abort_handle()));
            }
            while w.len() > 32 {
                if let Some((_, old)) = w.pop_front() {
                    old.abort();
                }
            }
        }
    });
    Ok(())
}

/// The node's PCI devices: the only values a device label (`gpu`, `switch`, `device`) takes
/// from kernel text, so no text makes a series of its own (redteam3 D-1: 30 forged addresses
/// were 30 series). Read from sysfs at the agent's start and again, at most once a minute,
/// when an address is not among them (a device hot-added); a GPU that has fallen off the bus
/// was there at the start, so its Xid keeps its address.
pub struct PciDevices {
    dir: std::path::PathBuf,
    known: Mutex<(
        std::collections::BTreeSet<String>,
        Option<std::time::Instant>,
    )>,
}

/// The label of an address that is not one of the node's devices, and of a text that is not
/// a PCI address at all.
pub const NOT_ON_NODE: &str = "not_on_node";

impl PciDevices {
    pub fn new(dir: &std::path::Path) -> Self {
        let d = PciDevices {
            dir: dir.to_path_buf(),
            known: Mutex::new((Default::default(), None)),
        };
        d.refresh(
            &mut d
                .known
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        d
    }

    fn refresh(
        &self,
        k: &mut (
            std::collections::BTreeSet<String>,
            Option<std::time::Instant>,
        ),
    ) {
        for e in std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .take(4096)
        {
            let n = e.file_name().to_string_lossy().to_ascii_lowercase();
            if is_pci(&n) && k.0.len() < 4096 {
                k.0.insert(n);
            }
        }
        k.1 = Some(std::time::Instant::now());
    }

    /// `addr` as a label value: itself when it is one of the node's devices, else
    /// [`NOT_ON_NODE`].
    pub fn label(&self, addr: &str) -> String {
        let a = addr.to_ascii_lowercase();
        if !is_pci(&a) {
            return NOT_ON_NODE.into();
        }
        let mut k = self
            .known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !k.0.contains(&a) && k.1.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
            self.refresh(&mut k);
        }
        if k.0.contains(&a) {
            a
        } else {
            NOT_ON_NODE.into()
        }
    }
}

/// `dddd:bb:dd.f`, hexadecimal, as sysfs names devices.
fn is_pci(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && (b'0'..=b'7').contains(&b[11])
}

/// The node's devices for the labels (`/sys/bus/pci/devices`, or the agent's `--pci-devices`).
pub static PCI: std::sync::OnceLock<PciDevices> = std::sync::OnceLock::new();

fn pci_label(addr: &str) -> String {
    PCI.get_or_init(|| PciDevices::new(std::path::Path::new("/sys/bus/pci/devices")))
        .label(addr)
}

/// The AER severities the kernel prints; any other text is `unknown`.
fn aer_label(severity: &str) -> &'static str {
    [
        "corrected",
        "uncorrected_nonfatal",
        "uncorrected_fatal",
        "detail",
    ]
    .into_iter()
    .find(|k| *k == severity)
    .unwrap_or("unknown")
}

/// A GPU's label from the incident history (its address, validated as the Xid's).
pub(super) fn gpu_label(addr: &str) -> String {
    pci_label(addr)
}

/// Count what the metrics export from one kernel event.
pub(super) fn observe(m: &Metrics, e: &crate::event::Event) {
    m.inc("nantrace_events_total", &[("source", e.source())]);
    match &e.detail {
        crate::event::Detail::Kmsg(k) => match k.class() {
            Some(crate::classify::KmsgClass::Xid { xid, pci, .. }) => m.inc(
                "nantrace_xid_total",
                &[("xid", &xid.to_string()), ("gpu", &pci_label(pci))],
            ),
            Some(crate::classify::KmsgClass::Sxid { sxid, pci, .. }) => m.inc(
                "nantrace_sxid_total",
                &[("sxid", &sxid.to_string()), ("switch", &pci_label(pci))],
            ),
            Some(crate::classify::KmsgClass::Aer {
                severity, device, ..
            }) => m.inc(
                "nantrace_aer_total",
                &[
                    ("severity", aer_label(severity)),
                    ("device", &pci_label(device)),
                ],
            ),
            Some(c) => {
                let class = serde_json::to_value(c)
                    .ok()
                    .and_then(|v| v["class"].as_str().map(str::to_string))
                    .unwrap_or_default();
                m.inc("nantrace_kernel_errors_total", &[("class", &class)]);
            }
            None => {}
        },
        crate::event::Detail::Aer(a) => m.inc(
            "nantrace_aer_total",
            &[
                ("severity", crate::event::aer_severity_name(a.severity)),
                ("device", &pci_label(&a.device)),
            ],
        ),
        crate::event::Detail::Oom(o) => m.inc(
            "nantrace_oom_kills_total",
            &[("job", if o.victim_job { "true" } else { "false" })],
        ),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    /// Device labels take only the node's own PCI devices; AER severities only the kernel's words.
    #[test]
    fn labels_from_kernel_text_come_from_a_bounded_set() {
        let d = std::env::temp_dir().join(format!("nantrace-pci-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("0000:3b:00.0")).unwrap();
        let p = super::PciDevices::new(&d);
        assert_eq!(p.label("0000:3b:00.0"), "0000:3b:00.0");
        assert_eq!(p.label("0000:3B:00.0"), "0000:3b:00.0");
        for bad in [
            "0000:5e:00.0",
            "0000:3b:00.9",
            "x\"} 1\nnantrace_evil 1",
            "",
            "0000:3b:00.0 ",
            "0000:3b:00",
        ] {
            assert_eq!(p.label(bad), super::NOT_ON_NODE, "{bad:?}");
        }
        // A device that appears later is found at the next refresh (at most once a minute).
        std::fs::create_dir_all(d.join("0000:5e:00.0")).unwrap();
        p.known.lock().unwrap().1 = None;
        assert_eq!(p.label("0000:5e:00.0"), "0000:5e:00.0");
        assert_eq!(super::aer_label("uncorrected_fatal"), "uncorrected_fatal");
        assert_eq!(super::aer_label("a user's words"), "unknown");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// dist/prometheus/nantrace-rules.yml names only metrics the agent exports (a renamed
    /// metric would silence an alert without a word), and its fatal-Xid list is NVIDIA's
    /// critical list in data/xid-catalog.tsv. promtool's own tests of the rules run in
    /// tests/alert_rules.rs.
    #[test]
    fn the_alert_rules_name_exported_metrics_and_the_catalogs_fatal_xids() {
        let rules = include_str!("../../../dist/prometheus/nantrace-rules.yml");
        let expr: String = rules
            .lines()
            .filter(|l| l.trim_start().starts_with("expr:"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut named = std::collections::BTreeSet::new();
        for (i, _) in expr.match_indices("nantrace_") {
            let name: String = expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // `nantrace:...` recording rules are not metrics; `nantrace_` inside them would be.
            if i == 0 || expr.as_bytes()[i - 1] != b':' {
                named.insert(name);
            }
        }
        assert!(named.len() >= 8, "{named:?}");
        for n in &named {
            assert!(
                super::FAMILIES.iter().any(|(f, _, _)| f == n),
                "the rules use {n}, which the agent does not export"
            );
        }
        // The Grafana dashboard: valid JSON, every panel a question with a query, and every
        // metric it names exported (or a recording rule of the shipped rules).
        let dash: serde_json::Value = serde_json::from_str(include_str!(
            "../../../dist/grafana/nantrace-dashboard.json"
        ))
        .expect("the dashboard is valid JSON");
        let panels = dash["panels"].as_array().expect("panels");
        assert!(panels.len() >= 8);
        for p in panels {
            let title = p["title"].as_str().unwrap_or("");
            assert!(
                title.contains('?'),
                "a panel named by its question: {title}"
            );
            let q = p["targets"][0]["expr"].as_str().unwrap_or("");
            assert!(!q.is_empty(), "{title}: no query");
            for (i, _) in q.match_indices("nantrace") {
                let name: String = q[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                if name == "nantrace" {
                    continue; // the scrape job's name, `up{job="nantrace"}`
                }
                let known = if name.contains(':') {
                    rules.contains(&format!("record: {name}\n"))
                } else {
                    super::FAMILIES.iter().any(|(f, _, _)| *f == name)
                };
                assert!(
                    known,
                    "{title}: {name} is neither an exported metric nor a shipped recording rule"
                );
            }
        }
        let critical: Vec<String> = (0..1000)
            .filter(|x| {
                crate::classify::xid_entry(*x)
                    .is_some_and(|e| e.severity == crate::classify::Severity::Critical)
            })
            .map(|x| x.to_string())
            .collect();
        let fatal = format!("xid=~\"{}\"", critical.join("|"));
        let uses = rules.matches(&fatal).count();
        assert!(uses >= 3, "the fatal-Xid selector is not the catalog's critical list {fatal} (found {uses} times)");
        // The repeat-offender rule counts the catalog's hardware Xids on the node's own GPUs
        // (redteam4 D-6: not 13/31/43, not `not_on_node`).
        let hw: Vec<String> = (0..1000)
            .filter(|x| {
                crate::classify::xid_entry(*x).is_some()
                    && !crate::classify::xid_maybe_application(*x)
            })
            .map(|x| x.to_string())
            .collect();
        let hw = format!("xid=~\"{}\",gpu!=\"not_on_node\"", hw.join("|"));
        let offender = rules
            .split("- alert: ")
            .find(|a| a.starts_with("NantraceGpuRepeatOffender"))
            .expect("the repeat-offender rule");
        let expr = offender
            .lines()
            .find(|l| l.trim_start().starts_with("expr:"))
            .unwrap_or("");
        assert_eq!(
            expr.matches("nantrace_xid_total").count(),
            expr.matches(&format!("nantrace_xid_total{{{hw}}}")).count(),
            "every Xid count of NantraceGpuRepeatOffender selects the catalog's hardware Xids on the node's GPUs: {hw}"
        );
        assert!(!hw.contains("|13|") && !hw.contains("|31|"), "{hw}");
    }

    #[test]
    fn exposition_format_with_escaped_labels() {
        let m = Metrics::default();
        m.inc(
            "nantrace_xid_total",
            &[("xid", "79"), ("gpu", "0000:3b:00.0")],
        );
        m.inc(
            "nantrace_xid_total",
            &[("xid", "79"), ("gpu", "0000:3b:00.0")],
        );
        m.set("nantrace_jobs_watched", &[], 2.0);
        m.inc(
            "nantrace_job_output_failures_total",
            &[("family", "a\"b\\c\nd")],
        );
        let t = m.render();
        assert!(t.contains("# TYPE nantrace_xid_total counter\nnantrace_xid_total{xid=\"79\",gpu=\"0000:3b:00.0\"} 2\n"), "{t}");
        assert!(t.contains("nantrace_jobs_watched 2\n"));
        assert!(t.contains(r#"family="a\"b\\c\nd""#), "{t}");
        // Every family has its HELP and TYPE even with no series.
        assert!(t.contains("# TYPE nantrace_aer_total counter"));
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            assert!(name.starts_with("nantrace_"), "{l}");
        }
    }
}

#[cfg(test)]
mod docs {
    #[test]
    fn every_metric_is_in_docs_agent_md() {
        let doc = include_str!("../../../docs/agent.md");
        for (name, kind, _) in super::FAMILIES {
            assert!(
                doc.contains(&format!("`{name}`")),
                "{name} is not documented in docs/agent.md"
            );
            assert!(
                name.ends_with("_total") == (*kind == "counter"),
                "{name}: counters end in _total, gauges do not"
            );
        }
    }
}
