//! Kernel log classification: NVRM Xid, NVSwitch SXid, GPU fallen off the bus, PCIe AER (old
//! and new formats), OOM kills, NIC link changes, hung tasks, MCE/EDAC. Pure; the formats are
//! the ones in docs/probes/printk.md and the unit tests below.
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Info,
    Warning,
    Error,
    Critical,
}

/// What a kernel log line says, when it says something nantrace understands.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum KmsgClass {
    Xid {
        xid: u32,
        /// Normalised PCI address `0000:3b:00.0`.
        pci: String,
        xid_pid: Option<u32>,
        xid_process: Option<String>,
        meaning: &'static str,
        severity: Severity,
        message: String,
    },
    Sxid {
        sxid: u32,
        pci: String,
        severity: Severity,
        message: String,
    },
    GpuFallenOffBus {
        pci: String,
        severity: Severity,
    },
    Aer {
        /// corrected, uncorrected_nonfatal, uncorrected_fatal, or the text when unknown.
        #[serde(rename = "aer_severity")]
        severity: String,
        error_type: Option<String>,
        device: String,
        driver: String,
    },
    OomKill {
        victim_pid: u32,
        victim_comm: String,
        memcg: bool,
    },
    LinkDown {
        iface: String,
    },
    LinkUp {
        iface: String,
    },
    HungTask {
        task: String,
        task_pid: u32,
        seconds: u32,
    },
    MachineCheck {
        message: String,
    },
}

impl KmsgClass {
    /// Severity used by triggers and the report.
    pub fn severity(&self) -> Severity {
        match self {
            KmsgClass::Xid { severity, .. }
            | KmsgClass::Sxid { severity, .. }
            | KmsgClass::GpuFallenOffBus { severity, .. } => *severity,
            KmsgClass::Aer { severity, .. } => match severity.as_str() {
                "uncorrected_fatal" => Severity::Critical,
                "uncorrected_nonfatal" => Severity::Error,
                _ => Severity::Warning,
            },
            KmsgClass::OomKill { .. } | KmsgClass::HungTask { .. } => Severity::Error,
            KmsgClass::MachineCheck { .. } => Severity::Critical,
            KmsgClass::LinkDown { .. } => Severity::Warning,
            KmsgClass::LinkUp { .. } => Severity::Info,
        }
    }
}

/// NVIDIA Xid catalog (the codes that matter on Ampere and newer), with a severity for
/// nantrace: Critical = the GPU or its memory is unusable until reset, Error = the job's work
/// on it is lost or suspect, Warning = watch it, Info = context.
pub fn xid_info(xid: u32) -> (&'static str, Severity) {
    use Severity::*;
    match xid {
        13 => ("graphics engine exception", Error),
        31 => ("GPU memory page fault", Error),
        43 => ("GPU stopped processing", Info),
        45 => ("preemptive cleanup, due to previous errors", Info),
        48 => ("double-bit ECC error", Critical),
        61 => ("internal micro-controller breakpoint/warning", Error),
        62 => ("internal micro-controller halt", Critical),
        63 => ("ECC page retirement or row remapping recorded", Warning),
        64 => ("ECC page retirement or row remapper recording failure", Critical),
        68 => ("NVDEC0 exception", Error),
        69 => ("graphics engine class error", Error),
        74 => ("NVLink error", Critical),
        79 => ("GPU has fallen off the bus", Critical),
        92 => ("high single-bit ECC error rate", Warning),
        94 => ("contained ECC error", Error),
        95 => ("uncontained ECC error", Critical),
        109 => ("context switch timeout", Error),
        119 => ("GSP RPC timeout", Critical),
        120 => ("GSP error", Critical),
        121 => ("C2C link error", Critical),
        140 => ("unrecovered ECC error", Critical),
        143 => ("GPU initialization failure", Critical),
        144..=150 => ("NVLink error (NVLink5)", Critical),
        154 => ("GPU recovery action changed", Warning),
        155 => ("NVLink link down", Critical),
        _ => ("unlisted Xid (see NVIDIA's Xid catalog)", Warning),
    }
}

/// Normalise `0000:3b:00`, `00000000:3B:00.0` or `3b:00.0` to `0000:3b:00.0`.
pub fn normalize_pci(s: &str) -> String {
    let s = s.trim().to_ascii_lowercase();
    let (addr, func) = match s.rsplit_once('.') {
        Some((a, f)) if f.len() == 1 => (a.to_string(), f.to_string()),
        _ => (s.clone(), "0".to_string()),
    };
    let parts: Vec<&str> = addr.split(':').collect();
    let (dom, bus, dev) = match parts.as_slice() {
        [d, b, v] => (*d, *b, *v),
        [b, v] => ("0000", *b, *v),
        _ => return s,
    };
    let dom = u32::from_str_radix(dom, 16).map_or_else(|_| dom.to_string(), |d| format!("{d:04x}"));
    format!("{dom}:{bus:0>2}:{dev:0>2}.{func}")
}

static XID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)(?:, pid=(?:'?<unknown>'?|(\d+)))?(?:, name=([^,]*))?,?\s*(.*)").unwrap()
});
static SXID: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"SXid \(PCI:([0-9A-Fa-f:.]+)\): (\d+), (?:(Non-fatal|Fatal)[^,]*, )?(.*)").unwrap());
static OFF_BUS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"NVRM: .*GPU (?:at (?:PCI:)?)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?)(?s:.*)fallen off the bus").unwrap()
});
static AER_DEV: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\S+) ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d): (?:AER: )?(.*)$").unwrap());
static AER_SEV: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"PCIe Bus Error: severity=([^,]+), type=([^,(]+)").unwrap());
static AER_RECV: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(Multiple )?(Corrected|Correctable|Uncorrected \(Non-Fatal\)|Uncorrected \(Fatal\)|Uncorrectable \(Non-Fatal\)|Uncorrectable \(Fatal\)) error (?:message )?received(?: from ([0-9a-fA-F:.]+))?").unwrap()
});
static OOM: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(Memory cgroup out of memory|Out of memory)[^:]*: Killed process (\d+) \(([^)]*)\)").unwrap()
});
static LINK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)(?:^|\s)(\S+?):? (?:NIC )?Link is (Down|Up)").unwrap());
static HUNG: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"INFO: task (.+):(\d+) blocked for more than (\d+) seconds").unwrap());
static MCE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(mce: \[Hardware Error\]|Machine check events logged|EDAC MC\d+: \d+ (?:CE|UE))").unwrap());

fn aer_severity(s: &str) -> String {
    let l = s.to_ascii_lowercase();
    if l.starts_with("correct") {
        "corrected".into()
    } else if l.contains("non-fatal") || l.contains("nonfatal") {
        "uncorrected_nonfatal".into()
    } else if l.contains("fatal") {
        "uncorrected_fatal".into()
    } else {
        l
    }
}

/// Classify one kernel log record (it may hold several lines; the first match wins).
pub fn classify(text: &str) -> Option<KmsgClass> {
    if let Some(c) = XID.captures(text) {
        let xid: u32 = c[2].parse().ok()?;
        let (meaning, severity) = xid_info(xid);
        return Some(KmsgClass::Xid {
            xid,
            pci: normalize_pci(&c[1]),
            xid_pid: c.get(3).and_then(|m| m.as_str().parse().ok()),
            xid_process: c.get(4).map(|m| m.as_str().trim().to_string()).filter(|s| !s.is_empty() && s != "<unknown>"),
            meaning,
            severity,
            message: c.get(5).map_or("", |m| m.as_str()).trim().to_string(),
        });
    }
    if let Some(c) = SXID.captures(text) {
        let fatal = c.get(3).is_some_and(|m| m.as_str() == "Fatal");
        return Some(KmsgClass::Sxid {
            sxid: c[2].parse().ok()?,
            pci: normalize_pci(&c[1]),
            severity: if fatal { Severity::Critical } else { Severity::Warning },
            message: c[4].trim().to_string(),
        });
    }
    if let Some(c) = OFF_BUS.captures(text) {
        return Some(KmsgClass::GpuFallenOffBus { pci: normalize_pci(&c[1]), severity: Severity::Critical });
    }
    for line in text.lines() {
        if let Some(c) = AER_DEV.captures(line) {
            let rest = &c[3];
            let (sev, ty) = if let Some(s) = AER_SEV.captures(rest) {
                (Some(aer_severity(&s[1])), Some(s[2].trim().to_string()))
            } else if let Some(r) = AER_RECV.captures(rest) {
                (Some(aer_severity(&r[2])), None)
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
        }
    }
    if let Some(c) = OOM.captures(text) {
        return Some(KmsgClass::OomKill {
            victim_pid: c[2].parse().ok()?,
            victim_comm: c[3].to_string(),
            memcg: c[1].starts_with("Memory cgroup"),
        });
    }
    if let Some(c) = HUNG.captures(text) {
        return Some(KmsgClass::HungTask {
            task: c[1].to_string(),
            task_pid: c[2].parse().ok()?,
            seconds: c[3].parse().ok()?,
        });
    }
    if MCE.is_match(text) {
        return Some(KmsgClass::MachineCheck { message: text.trim().to_string() });
    }
    if let Some(c) = LINK.captures(text) {
        let iface = c[1].trim_end_matches(':').to_string();
        return Some(if &c[2].to_ascii_lowercase() == "down" {
            KmsgClass::LinkDown { iface }
        } else {
            KmsgClass::LinkUp { iface }
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(line: &str) -> (u32, String, Option<u32>, Option<String>, Severity) {
        match classify(line) {
            Some(KmsgClass::Xid { xid, pci, xid_pid, xid_process, severity, .. }) => (xid, pci, xid_pid, xid_process, severity),
            other => panic!("not an Xid: {line:?} -> {other:?}"),
        }
    }

    #[test]
    fn xid_with_pid_and_name() {
        let (x, pci, pid, name, sev) =
            xid("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.");
        assert_eq!((x, pci.as_str(), pid, name.as_deref(), sev), (79, "0000:3b:00.0", Some(1234), Some("python3"), Severity::Critical));
    }

    #[test]
    fn xid_with_unknown_pid_and_older_shapes() {
        let (x, pci, pid, name, _) = xid("NVRM: Xid (PCI:0000:b3:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.");
        assert_eq!((x, pci.as_str(), pid, name), (48, "0000:b3:00.0", None, None));
        let (x, pci, pid, name, sev) = xid("NVRM: Xid (PCI:0000:17:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address");
        assert_eq!((x, pci.as_str(), pid, name, sev), (13, "0000:17:00.0", None, None, Severity::Error));
        let (x, _, pid, _, sev) = xid("NVRM: Xid (PCI:0000:ca:00): 63, pid=2897, Row Remapper: New row marked for remapping, reset gpu to activate.");
        assert_eq!((x, pid, sev), (63, Some(2897), Severity::Warning));
        let (x, _, _, _, sev) = xid("[  123.456] NVRM: Xid (PCI:0000:41:00): 119, pid=911, name=python, Timeout after 6s of waiting for RPC response from GPU0 GSP!");
        assert_eq!((x, sev), (119, Severity::Critical));
    }

    #[test]
    fn every_listed_xid_has_a_meaning_and_fatal_ones_are_critical() {
        for x in [13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 149, 154] {
            assert!(!xid_info(x).0.starts_with("unlisted"), "Xid {x}");
        }
        for x in [48, 62, 64, 74, 79, 95, 119, 120, 140] {
            assert_eq!(xid_info(x).1, Severity::Critical, "Xid {x}");
        }
        assert_eq!(xid_info(43).1, Severity::Info);
    }

    #[test]
    fn fallen_off_bus_without_xid() {
        let c = classify("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330)\nNVRM: installed in this system has fallen off the bus and is not responding to commands.");
        assert_eq!(c, Some(KmsgClass::GpuFallenOffBus { pci: "0000:b3:00.0".into(), severity: Severity::Critical }));
    }

    #[test]
    fn nvswitch_sxid() {
        match classify("nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)") {
            Some(KmsgClass::Sxid { sxid, pci, severity, .. }) => assert_eq!((sxid, pci.as_str(), severity), (12028, "0000:05:00.0", Severity::Warning)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn aer_old_and_new_formats() {
        let old = classify("pcieport 0000:00:1c.5: PCIe Bus Error: severity=Corrected, type=Physical Layer, id=00e5(Receiver ID)");
        assert_eq!(old, Some(KmsgClass::Aer { severity: "corrected".into(), error_type: Some("Physical Layer".into()), device: "0000:00:1c.5".into(), driver: "pcieport".into() }));
        let new = classify("pcieport 0000:00:03.1: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)");
        assert_eq!(new.as_ref().map(KmsgClass::severity), Some(Severity::Error));
        let gpu = classify("nvidia 0000:81:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Inaccessible, (Unregistered Agent ID)");
        match gpu {
            Some(KmsgClass::Aer { severity, device, driver, .. }) => assert_eq!((severity.as_str(), device.as_str(), driver.as_str()), ("uncorrected_fatal", "0000:81:00.0", "nvidia")),
            other => panic!("{other:?}"),
        }
        let recv = classify("pcieport 0000:00:03.1: AER: Correctable error message received from 0000:00:00.0");
        assert_eq!(recv.as_ref().map(KmsgClass::severity), Some(Severity::Warning));
        let recv_old = classify("pcieport 0000:00:1c.5: AER: Corrected error received: id=00e5");
        assert!(matches!(recv_old, Some(KmsgClass::Aer { .. })));
    }

    #[test]
    fn oom_hung_mce_link() {
        assert_eq!(
            classify("Memory cgroup out of memory: Killed process 4711 (pt_data_worker) total-vm:1234kB, anon-rss:1000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:40kB oom_score_adj:0"),
            Some(KmsgClass::OomKill { victim_pid: 4711, victim_comm: "pt_data_worker".into(), memcg: true })
        );
        assert!(matches!(classify("Out of memory: Killed process 99 (python3) total-vm:1kB"), Some(KmsgClass::OomKill { victim_pid: 99, memcg: false, .. })));
        assert_eq!(
            classify("INFO: task python3:5123 blocked for more than 122 seconds."),
            Some(KmsgClass::HungTask { task: "python3".into(), task_pid: 5123, seconds: 122 })
        );
        assert!(matches!(classify("mce: [Hardware Error]: Machine check events logged"), Some(KmsgClass::MachineCheck { .. })));
        assert!(matches!(classify("EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"), Some(KmsgClass::MachineCheck { .. })));
        assert_eq!(classify("mlx5_core 0000:3b:00.0 ib0: Link is Down"), Some(KmsgClass::LinkDown { iface: "ib0".into() }));
        assert_eq!(classify("e1000e: eth0 NIC Link is Up 1000 Mbps Full Duplex"), Some(KmsgClass::LinkUp { iface: "eth0".into() }));
    }

    #[test]
    fn informational_lines_are_not_errors() {
        for l in [
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
            "nvidia-nvlink: Nvlink Core is being initialized, major device number 234",
            "pcieport 0000:00:01.0: AER: enabled with IRQ 26",
            "EXT4-fs (vda): mounted filesystem with ordered data mode",
            "",
        ] {
            assert_eq!(classify(l), None, "{l}");
        }
    }

    #[test]
    fn pci_normalisation() {
        assert_eq!(normalize_pci("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_pci("0000:3b:00"), "0000:3b:00.0");
        assert_eq!(normalize_pci("3b:00.1"), "0000:3b:00.1");
    }
}
