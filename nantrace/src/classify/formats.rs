//! The kernel line formats nantrace reads, one reader each, in the order they are tried
//! (`super::classify_line`): NVIDIA Xid and SXid, PCIe AER, OOM, hung tasks, soft lockups,
//! RCU stalls, CPU thermal, machine checks, network filesystems, stale handles, block errors,
//! NIC errors, links.
use std::sync::LazyLock;

use regex::Regex;

use super::*;

/// One kernel line format: its pattern, what a match says, and whether a match that says
/// nothing ends the search (a malformed Xid is no other kind of line) or lets the formats
/// after it try (an AER line of no known severity, a filesystem line of no known kind).
pub(super) struct Format {
    pub(super) re: &'static LazyLock<Regex>,
    pub(super) read: fn(&regex::Captures<'_>, &str) -> Option<KmsgClass>,
    pub(super) last: bool,
}

/// The formats, in the order they are tried.
pub(super) static FORMATS: [Format; 17] = [
    Format {
        re: &XID,
        read: xid,
        last: true,
    },
    Format {
        re: &SXID,
        read: sxid,
        last: true,
    },
    Format {
        re: &AER_DEV,
        read: aer,
        last: false,
    },
    Format {
        re: &OOM,
        read: oom_kill,
        last: true,
    },
    Format {
        re: &HUNG,
        read: hung_task,
        last: true,
    },
    Format {
        re: &HUNG_DETAIL,
        read: hung_task_detail,
        last: true,
    },
    Format {
        re: &OOM_CONSTRAINT,
        read: oom_constraint,
        last: true,
    },
    Format {
        re: &OOM_INVOKED,
        read: oom_invoked,
        last: true,
    },
    Format {
        re: &SOFT_LOCKUP,
        read: soft_lockup,
        last: true,
    },
    Format {
        re: &RCU,
        read: rcu_stall,
        last: true,
    },
    Format {
        re: &THERMAL,
        read: cpu_thermal,
        last: true,
    },
    Format {
        re: &MCE,
        read: machine_check,
        last: true,
    },
    Format {
        re: &NETFS,
        read: net_fs,
        last: false,
    },
    Format {
        re: &STALE,
        read: stale_handle,
        last: true,
    },
    Format {
        re: &BLOCK,
        read: block_error,
        last: true,
    },
    Format {
        re: &NIC_ERR,
        read: nic_error,
        last: true,
    },
    Format {
        re: &LINK,
        read: link,
        last: true,
    },
];

fn xid(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    let xid: u32 = c[3].parse().ok()?;
    let entry = xid_entry(xid);
    let (meaning, severity) = xid_info(xid);
    let message = c.get(6).map_or("", |m| m.as_str()).trim().to_string();
    Some(KmsgClass::Xid {
        xid,
        pci: normalize_pci(&c[1]),
        gpu_instance: c.get(2).and_then(|m| m.as_str().parse().ok()),
        xid_pid: c.get(4).and_then(|m| m.as_str().parse().ok()),
        xid_process: c
            .get(5)
            .map(|m| m.as_str().trim().to_string())
            .filter(|s| !s.is_empty() && s != "<unknown>"),
        meaning,
        implicates: entry.map_or("unknown", |e| e.implicates),
        action: entry.map_or("contact_support", |e| e.action),
        severity,
        previous_xid: PREVIOUS_XID
            .captures(&message)
            .and_then(|p| p[1].parse().ok()),
        message,
    })
}

fn sxid(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    let sxid: u32 = c[2].parse().ok()?;
    let entry = sxid_entry(sxid);
    let severity = match c.get(3).map(|m| m.as_str()) {
        Some("Fatal") => Severity::Critical,
        Some(_) => Severity::Warning,
        None => entry.map_or(Severity::Warning, |e| e.severity),
    };
    Some(KmsgClass::Sxid {
        sxid,
        pci: normalize_pci(&c[1]),
        severity,
        meaning: entry.map_or("SXid not in the catalog", |e| e.name),
        action: entry.map_or("contact_support", |e| e.action),
        message: c[4].trim().to_string(),
    })
}

fn aer(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    let rest = &c[3];
    let (sev, ty) = if let Some(s) = AER_SEV.captures(rest) {
        (Some(aer_severity(&s[1])), Some(s[2].trim().to_string()))
    } else if let Some(r) = AER_RECV.captures(rest) {
        (Some(aer_severity(&r[2])), None)
    } else if let Some(d) = AER_DETAIL.captures(rest) {
        (
            Some("detail".to_string()),
            d.get(1).map(|m| m.as_str().trim().to_string()),
        )
    } else {
        (None, None)
    };
    if let Some(severity) = sev {
        return Some(KmsgClass::Aer {
            severity,
            error_type: ty,
            device: normalize_pci(&c[2]),
            driver: c[1].to_string(),
        });
    }
    None
}

fn oom_kill(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::OomKill {
        victim_pid: c[2].parse().ok()?,
        victim_comm: c[3].to_string(),
        memcg: c
            .get(1)
            .is_some_and(|m| m.as_str().starts_with("Memory cgroup")),
    })
}

fn hung_task(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::HungTask {
        task: c[1].to_string(),
        task_pid: c[2].parse().ok()?,
        seconds: c[3].parse().ok()?,
    })
}

fn hung_task_detail(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::HungTask {
        task: c.get(1).map_or("?", |m| m.as_str()).trim().to_string(),
        task_pid: c.get(2).and_then(|m| m.as_str().parse().ok()).unwrap_or(0),
        seconds: 0,
    })
}

fn oom_constraint(c: &regex::Captures<'_>, line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::OomKill {
        victim_pid: c[2].parse().ok()?,
        victim_comm: c[1].to_string(),
        memcg: line.contains("CONSTRAINT_MEMCG"),
    })
}

fn oom_invoked(_c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::OomInvoked)
}

fn soft_lockup(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::SoftLockup {
        cpu: c[1].parse().ok()?,
        seconds: c[2].parse().ok()?,
    })
}

fn rcu_stall(_c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::RcuStall)
}

fn cpu_thermal(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::CpuThermal {
        cpu: c[1].parse().ok()?,
        scope: c[2].to_ascii_lowercase(),
    })
}

fn machine_check(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    let m = c.get(0).map_or("", |m| m.as_str());
    let corrected_only =
        m.contains("CMCI storm") || m.contains(" CE ") || m.contains(" CE") && !m.contains(" UE");
    Some(KmsgClass::MachineCheck {
        uncorrected: !corrected_only && MCE_UNCORRECTED.is_match(m),
        message: m.trim().to_string(),
    })
}

fn net_fs(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    if let Some(fs) = c.get(1) {
        let ok = &c[3] == "OK";
        let (server, fs) = (
            c[2].trim_end_matches(',').to_string(),
            fs.as_str().to_string(),
        );
        return Some(if ok {
            KmsgClass::NetFsOk { server, fs }
        } else {
            KmsgClass::NetFsDown { server, fs }
        });
    }
    if c.get(4).is_some() {
        if let Some(s) = c.get(6) {
            return Some(KmsgClass::NetFsOk {
                server: s.as_str().to_string(),
                fs: "lustre".into(),
            });
        }
        let server = c
            .get(5)
            .or(c.get(7))
            .map_or("?", |m| m.as_str())
            .to_string();
        return Some(KmsgClass::NetFsDown {
            server,
            fs: "lustre".into(),
        });
    }
    if c.get(8).is_some() {
        return Some(KmsgClass::NetFsOk {
            server: c.get(10).map_or("?", |m| m.as_str()).to_string(),
            fs: "lustre".into(),
        });
    }
    if c.get(11).is_some() {
        return Some(KmsgClass::NetFsDown {
            server: c.get(12).map_or("?", |m| m.as_str()).to_string(),
            fs: "gpfs".into(),
        });
    }
    None
}

fn stale_handle(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::StaleHandle {
        message: c[1].trim().to_string(),
    })
}

fn block_error(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    let pick = |i: &[usize]| {
        i.iter()
            .find_map(|&i| c.get(i))
            .map(|m| m.as_str().to_string())
    };
    let dev = pick(&[2, 4, 5, 15, 17, 19]).unwrap_or_default();
    let kind = pick(&[1, 3, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18]).unwrap_or_default();
    let kind = match kind.as_str() {
        "I/O error" | "Buffer I/O error" => "io_error",
        k if k.ends_with("Error") => "io_error",
        "timeout" => "nvme_timeout",
        "EXT4-fs error" | "EXT4-fs warning" | "XFS" | "Aborting journal" => "fs_error",
        _ => "nvme_reset",
    };
    Some(KmsgClass::BlockError {
        dev,
        kind: kind.to_string(),
    })
}

fn nic_error(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    Some(KmsgClass::NicError {
        device: c[1].trim().to_string(),
        message: c[2].trim().chars().take(160).collect(),
    })
}

fn link(c: &regex::Captures<'_>, _line: &str) -> Option<KmsgClass> {
    let iface = c
        .get(1)
        .or(c.get(3))
        .map_or("", |m| m.as_str())
        .trim_end_matches(':')
        .to_string();
    let state = c
        .get(2)
        .or(c.get(4))
        .or(c.get(5))
        .or(c.get(6))
        .map_or("", |m| m.as_str())
        .to_ascii_lowercase();
    Some(if matches!(state.as_str(), "down" | "init") {
        KmsgClass::LinkDown { iface }
    } else {
        KmsgClass::LinkUp { iface }
    })
}
