//! Network evidence: TCP retransmission rate (/proc/net/snmp via procfs), NIC link state and
//! error counters (/sys/class/net), InfiniBand/RoCE port state and error counters
//! (/sys/class/infiniband/*/ports/*). Changes (link down, counters up) become events.
use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::system::sample_event;
use crate::clock::monotonic_ns;
use crate::event::Event;

const NIC_COUNTERS: &[&str] = &[
    "rx_errors",
    "tx_errors",
    "rx_dropped",
    "tx_dropped",
    "rx_crc_errors",
    "rx_missed_errors",
    "tx_carrier_errors",
];
const IB_COUNTERS: &[&str] = &[
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_rcv_constraint_errors",
    "port_xmit_constraint_errors",
];

/// State of one link (NIC or IB port) and its error counters.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Link {
    pub state: String,
    pub counters: BTreeMap<String, u64>,
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Links under a sysfs root (`/sys` normally; tests pass a recorded tree).
pub fn links(sys: &Path) -> BTreeMap<String, Link> {
    let mut out = BTreeMap::new();
    if let Ok(d) = std::fs::read_dir(sys.join("class/net")) {
        for e in d.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "lo" {
                continue;
            }
            let p = e.path();
            let mut l = Link {
                state: read(&p.join("operstate")).unwrap_or_default(),
                ..Default::default()
            };
            for c in NIC_COUNTERS {
                if let Some(v) = read(&p.join("statistics").join(c)).and_then(|s| s.parse().ok()) {
                    l.counters.insert((*c).to_string(), v);
                }
            }
            out.insert(format!("net/{name}"), l);
        }
    }
    if let Ok(d) = std::fs::read_dir(sys.join("class/infiniband")) {
        for hca in d.flatten() {
            let Ok(ports) = std::fs::read_dir(hca.path().join("ports")) else {
                continue;
            };
            for port in ports.flatten() {
                let p = port.path();
                let mut l = Link {
                    state: format!(
                        "{} / {}",
                        read(&p.join("state")).unwrap_or_default(),
                        read(&p.join("phys_state")).unwrap_or_default()
                    ),
                    ..Default::default()
                };
                for c in IB_COUNTERS {
                    if let Some(v) = read(&p.join("counters").join(c)).and_then(|s| s.parse().ok())
                    {
                        l.counters.insert((*c).to_string(), v);
                    }
                }
                out.insert(
                    format!(
                        "ib/{}/{}",
                        hca.file_name().to_string_lossy(),
                        port.file_name().to_string_lossy()
                    ),
                    l,
                );
            }
        }
    }
    out
}

/// What changed between two reads: state changes and counter increases, as messages.
pub fn link_changes(
    prev: &BTreeMap<String, Link>,
    cur: &BTreeMap<String, Link>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (name, c) in cur {
        let Some(p) = prev.get(name) else { continue };
        if p.state != c.state {
            out.push((
                name.clone(),
                format!("{name}: state {} -> {}", p.state, c.state),
            ));
        }
        for (k, v) in &c.counters {
            let before = p.counters.get(k).copied().unwrap_or(0);
            if *v > before {
                out.push((name.clone(), format!("{name}: {k} +{}", v - before)));
            }
        }
    }
    out
}

pub struct Sampler {
    sys: std::path::PathBuf,
    prev_links: Option<BTreeMap<String, Link>>,
    prev_tcp: Option<(u64, u64, u64)>,
}

impl Sampler {
    pub fn new(sys: &Path) -> Self {
        Self {
            sys: sys.to_path_buf(),
            prev_links: None,
            prev_tcp: None,
        }
    }

    pub fn sample(&mut self, dt_s: f64) -> Vec<Event> {
        let now = monotonic_ns();
        let mut out = Vec::new();
        if let Ok(s) = procfs::net::snmp() {
            let cur = (s.tcp_retrans_segs, s.tcp_out_segs, now);
            if let Some(p) = self.prev_tcp {
                let dt = ((cur.2 - p.2) as f64 / 1e9).max(dt_s.min(1e-3));
                let mut f = Map::new();
                let re = cur.0.saturating_sub(p.0);
                f.insert("tcp_retrans_per_s".into(), json!(re as f64 / dt));
                f.insert(
                    "tcp_out_segs_per_s".into(),
                    json!(cur.1.saturating_sub(p.1) as f64 / dt),
                );
                out.push(sample_event(now, crate::source::Source::Net, f));
            }
            self.prev_tcp = Some(cur);
        }
        let cur = links(&self.sys);
        if let Some(prev) = &self.prev_links {
            for (link, msg) in link_changes(prev, &cur) {
                let mut f = Map::new();
                f.insert("link".into(), json!(link));
                f.insert("change".into(), json!(msg));
                out.push(sample_event(now, crate::source::Source::NetChange, f));
            }
        }
        self.prev_links = Some(cur);
        out
    }
}

/// TCP connections of the job's processes (socket inodes from /proc/PID/fd matched against the
/// process's own /proc/PID/net/tcp{,6}, so containers in other netns work): the peers the
/// report can tie retransmits to.
pub fn job_sockets(pids: &std::collections::BTreeSet<u32>) -> Vec<Value> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for pid in pids {
        let Ok(p) = procfs::process::Process::new(*pid as i32) else {
            continue;
        };
        let Ok(fds) = p.fd() else { continue };
        let inodes: std::collections::BTreeSet<u64> = fds
            .flatten()
            .filter_map(|f| match f.target {
                procfs::process::FDTarget::Socket(i) => Some(i),
                _ => None,
            })
            .collect();
        if inodes.is_empty() {
            continue;
        }
        for e in p
            .tcp()
            .unwrap_or_default()
            .into_iter()
            .chain(p.tcp6().unwrap_or_default())
        {
            if inodes.contains(&e.inode) && seen.insert(e.inode) {
                out.push(json!({ "pid": pid, "local": e.local_address.to_string(), "remote": e.remote_address.to_string(), "state": format!("{:?}", e.state) }));
            }
        }
    }
    out
}

pub fn snapshot() -> Value {
    let tcp = procfs::net::snmp().map(|s| json!({ "retrans_segs": s.tcp_retrans_segs, "out_segs": s.tcp_out_segs, "in_errs": s.tcp_in_errs, "curr_estab": s.tcp_curr_estab })).unwrap_or_else(|e| json!({ "error": e.to_string() }));
    json!({
        "tcp_since_boot": tcp,
        "links": links(Path::new("/sys")),
        "infiniband_present": Path::new("/sys/class/infiniband").exists(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_sys(root: &Path, ib_state: &str, symbol_errors: u64, eth_state: &str, rx_errors: u64) {
        let p = root.join("class/infiniband/mlx5_0/ports/1");
        std::fs::create_dir_all(p.join("counters")).unwrap();
        std::fs::write(p.join("state"), format!("{ib_state}\n")).unwrap();
        std::fs::write(p.join("phys_state"), "5: LinkUp\n").unwrap();
        std::fs::write(
            p.join("counters/symbol_error"),
            format!("{symbol_errors}\n"),
        )
        .unwrap();
        std::fs::write(p.join("counters/link_downed"), "0\n").unwrap();
        let n = root.join("class/net/eth9");
        std::fs::create_dir_all(n.join("statistics")).unwrap();
        std::fs::write(n.join("operstate"), format!("{eth_state}\n")).unwrap();
        std::fs::write(n.join("statistics/rx_errors"), format!("{rx_errors}\n")).unwrap();
    }

    #[test]
    fn ib_and_nic_changes_from_recorded_sysfs() {
        let root = std::env::temp_dir().join(format!("nt-sys-{}", std::process::id()));
        fake_sys(&root, "4: ACTIVE", 0, "up", 3);
        let a = links(&root);
        assert_eq!(a["ib/mlx5_0/1"].state, "4: ACTIVE / 5: LinkUp");
        assert_eq!(a["net/eth9"].counters["rx_errors"], 3);
        fake_sys(&root, "1: DOWN", 17, "down", 5);
        let b = links(&root);
        let ch: Vec<String> = link_changes(&a, &b).into_iter().map(|c| c.1).collect();
        assert!(
            ch.contains(
                &"ib/mlx5_0/1: state 4: ACTIVE / 5: LinkUp -> 1: DOWN / 5: LinkUp".to_string()
            ),
            "{ch:?}"
        );
        assert!(ch.contains(&"ib/mlx5_0/1: symbol_error +17".to_string()));
        assert!(ch.contains(&"net/eth9: state up -> down".to_string()));
        assert!(ch.contains(&"net/eth9: rx_errors +2".to_string()));
        assert!(link_changes(&b, &b).is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn job_sockets_lists_this_process_connections() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, _) = l.accept().unwrap();
        let mut pids = std::collections::BTreeSet::new();
        pids.insert(std::process::id());
        let socks = job_sockets(&pids);
        let want = l.local_addr().unwrap().to_string();
        assert!(
            socks.iter().any(|s| s["remote"] == want.as_str()
                && s["local"] == c.local_addr().unwrap().to_string().as_str()),
            "{socks:?}"
        );
    }

    #[test]
    fn tcp_rate_on_this_machine() {
        let mut s = Sampler::new(Path::new("/sys"));
        assert!(s.sample(1.0).iter().all(|e| e.source() != "net"));
        std::thread::sleep(std::time::Duration::from_millis(50));
        let e = s.sample(1.0);
        let net = e.iter().find(|e| e.source() == "net").expect("net sample");
        assert!(
            net.to_json(&crate::clock::ClockMap::sample())["tcp_retrans_per_s"]
                .as_f64()
                .unwrap()
                >= 0.0
        );
        assert!(snapshot()["tcp_since_boot"]["out_segs"].as_u64().is_some());
    }
}
