//! Network: links down, NIC (mlx5) errors, TCP retransmit storms to the job's peers, link state changes.
use std::collections::BTreeMap;

use super::{kernel_events, Acc, Ctx};
use crate::report::rules::signal;
use crate::source::Source;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    for (rel, e) in &kernel_events(ctx) {
        match e["class"].as_str().unwrap_or("") {
            "link_down" => {
                let key = e["iface"].as_str().unwrap_or("");
                acc.add(signal("ib_link_down"), key, *rel, false, || {
                    format!("link down on {}", e["iface"].as_str().unwrap_or("?"))
                });
                acc.witness(signal("ib_link_down"), key, e);
            }
            "nic_error" => {
                let key = e["device"].as_str().unwrap_or("");
                acc.add(signal("nic_error"), key, *rel, false, || {
                    format!(
                        "NIC error on {}: {}",
                        e["device"].as_str().unwrap_or("?"),
                        e["message"].as_str().unwrap_or("")
                    )
                });
                acc.witness(signal("nic_error"), key, e);
            }
            _ => {}
        }
    }
    {
        let sig = signal("retransmit_storm");
        let mut per_peer: BTreeMap<String, (usize, usize, f64, bool)> = BTreeMap::new();
        // Loopback is never the fabric: a retransmit to 127.0.0.0/8 or ::1 is a process on this
        // node that does not read its socket (any user can make thousands: D-3 of the third
        // adversarial test), not a network fault, whoever's socket it is.
        for (r, e) in ctx
            .src(Source::TcpRetransmit)
            .filter(|(r, _)| *r > -120.0)
            .filter(|(_, e)| !loopback(e["daddr"].as_str()) && !loopback(e["saddr"].as_str()))
        {
            let peer = format!("{}:{}", e["daddr"].as_str().unwrap_or("?"), e["dport"]);
            let peer_of_job = ctx.job_peers.contains(&peer);
            let s = per_peer
                .entry(peer)
                .or_insert((0, 0, f64::NEG_INFINITY, false));
            if *r > -60.0 {
                s.0 += 1
            } else {
                s.1 += 1
            }
            s.2 = s.2.max(*r);
            // Retransmits run in softirq context: tie them to the job through its sockets.
            let local = format!("{}:{}", e["saddr"].as_str().unwrap_or("?"), e["sport"]);
            s.3 |= e["job"] == true || peer_of_job || ctx.job_peers.contains(&local);
        }
        for (peer, (recent, earlier, last, job)) in per_peer {
            if recent >= 20 && recent as f64 >= sig.threshold * (earlier.max(1) as f64) {
                acc.add(sig, &peer, last, job, || {
                    format!(
                        "TCP retransmits to {peer}{} up {}× ({recent} in the minute before)",
                        if job { ", a peer of this job" } else { "" },
                        recent / earlier.max(1)
                    )
                });
            }
        }
    }
    for (rel, e) in ctx.src(Source::NetChange) {
        let c = e["change"].as_str().unwrap_or("");
        // The state it went to decides: `ACTIVE -> DOWN` is a link down, `DOWN -> ACTIVE` is not.
        let to = c
            .rsplit_once("->")
            .map_or("", |(_, t)| t)
            .to_ascii_lowercase();
        let sig = if c.contains("->")
            && (to.trim_start().starts_with("down")
                || to.contains(": down")
                || to.contains("polling")
                || to.contains("disabled"))
        {
            signal("ib_link_down")
        } else if c.contains("->") && c.contains("state") {
            continue;
        } else {
            signal("link_errors")
        };
        acc.add(sig, e["link"].as_str().unwrap_or(""), *rel, false, || {
            c.to_string()
        });
    }
}

/// Whether an address (as the probes print it: `127.0.0.1`, `::1`, `::ffff:127.0.0.1`) is a
/// loopback address. An address that does not parse is not.
pub(crate) fn loopback(addr: Option<&str>) -> bool {
    match addr.and_then(|a| a.parse::<std::net::IpAddr>().ok()) {
        Some(std::net::IpAddr::V4(a)) => a.is_loopback(),
        Some(std::net::IpAddr::V6(a)) => {
            a.is_loopback() || a.to_ipv4_mapped().is_some_and(|m| m.is_loopback())
        }
        None => false,
    }
}
