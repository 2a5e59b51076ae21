//! Kernel log classification: NVRM Xid (every code of NVIDIA's catalog, data/xid-catalog.tsv),
//! NVSwitch SXid, GPU fallen off the bus, PCIe AER (old and new formats), OOM kills (old and
//! new wording), NIC/IB link changes, mlx5 errors, hung tasks, soft lockups and RCU stalls,
//! MCE/EDAC/CMCI, CPU thermal throttling, NFS/Lustre/GPFS stalls, block and NVMe errors, and
//! segfaults in the GPU libraries. Pure; formats in docs/probes/printk.md and the tests below.
//!
//! Every pattern is anchored at the start of a line (after an optional `[ 123.456]` stamp) on
//! the kernel subsystem's own prefix. Text the kernel copies from a process name (`comm` in
//! segfault, trap, OOM and hung-task lines) is never matched as evidence: a process renamed
//! `EDAC MC0: 1 UE` that crashes is a segfault of that process, nothing more.
use std::collections::HashMap;
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

impl Severity {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "info" => Severity::Info,
            "warning" => Severity::Warning,
            "error" => Severity::Error,
            "critical" => Severity::Critical,
            _ => return None,
        })
    }
}

/// What a kernel log line says, when it says something nantrace understands.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum KmsgClass {
    Xid {
        xid: u32,
        /// Normalised PCI address `0000:3b:00.0`.
        pci: String,
        /// MIG GPU instance (`GPU-I:05`) when the line names one.
        #[serde(skip_serializing_if = "Option::is_none")]
        gpu_instance: Option<u32>,
        xid_pid: Option<u32>,
        xid_process: Option<String>,
        meaning: &'static str,
        /// From NVIDIA's catalog: hardware, driver, application, hardware_or_application,
        /// system, nvlink, info.
        implicates: &'static str,
        /// NVIDIA's recommended action (none, restart_app, reset_gpu, reboot_node, ...).
        action: &'static str,
        severity: Severity,
        /// "caused by previous Xid N" / "due to previous Xid N": the primary error.
        #[serde(skip_serializing_if = "Option::is_none")]
        previous_xid: Option<u32>,
        message: String,
    },
    Sxid {
        sxid: u32,
        pci: String,
        severity: Severity,
        meaning: &'static str,
        action: &'static str,
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
    /// `... invoked oom-killer`: the start of an OOM report (the victim follows).
    OomInvoked,
    LinkDown {
        iface: String,
    },
    LinkUp {
        iface: String,
    },
    /// mlx5 (ConnectX) CQE errors, health/firmware errors, command timeouts.
    NicError {
        device: String,
        message: String,
    },
    HungTask {
        task: String,
        task_pid: u32,
        seconds: u32,
    },
    SoftLockup {
        cpu: u32,
        seconds: u32,
    },
    RcuStall,
    MachineCheck {
        /// false for corrected errors (CE, corrected, CMCI storm).
        uncorrected: bool,
        message: String,
    },
    CpuThermal {
        cpu: u32,
        /// "core" or "package".
        scope: String,
    },
    /// NFS/Lustre/GPFS: a server stopped answering (reads and checkpoints stall).
    NetFsDown {
        server: String,
        fs: String,
    },
    NetFsOk {
        server: String,
        fs: String,
    },
    StaleHandle {
        message: String,
    },
    /// `I/O error, dev X`, `Buffer I/O error`, NVMe timeouts and controller resets.
    BlockError {
        dev: String,
        kind: String,
    },
    /// A user-space crash the kernel reported; `gpu_library` when it happened inside the
    /// NVIDIA driver's or NCCL's libraries.
    Segfault {
        /// The crashed process's name: its own text, never matched as evidence.
        crashed_comm: String,
        crashed_pid: u32,
        library: Option<String>,
        gpu_library: bool,
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
            KmsgClass::OomKill { .. } | KmsgClass::HungTask { .. } | KmsgClass::SoftLockup { .. } | KmsgClass::NicError { .. } | KmsgClass::BlockError { .. } | KmsgClass::NetFsDown { .. } => Severity::Error,
            KmsgClass::MachineCheck { uncorrected, .. } => if *uncorrected { Severity::Critical } else { Severity::Warning },
            KmsgClass::LinkDown { .. } | KmsgClass::RcuStall | KmsgClass::CpuThermal { .. } | KmsgClass::StaleHandle { .. } | KmsgClass::Segfault { .. } => Severity::Warning,
            KmsgClass::LinkUp { .. } | KmsgClass::NetFsOk { .. } | KmsgClass::OomInvoked => Severity::Info,
        }
    }
}

/// One row of NVIDIA's Xid (or NVSwitch SXid) catalog.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogEntry {
    pub name: &'static str,
    pub implicates: &'static str,
    pub action: &'static str,
    pub severity: Severity,
}

fn parse_catalog(text: &'static str) -> HashMap<u32, CatalogEntry> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let mut c = l.split('\t');
            let code = c.next()?.trim().parse().ok()?;
            let name = c.next()?.trim();
            let implicates = c.next()?.trim();
            let action = c.next()?.trim();
            let severity = Severity::parse(c.next()?.trim())?;
            Some((code, CatalogEntry { name, implicates, action, severity }))
        })
        .collect()
}

static XID_CATALOG: LazyLock<HashMap<u32, CatalogEntry>> = LazyLock::new(|| parse_catalog(include_str!("../data/xid-catalog.tsv")));
static SXID_CATALOG: LazyLock<HashMap<u32, CatalogEntry>> = LazyLock::new(|| parse_catalog(include_str!("../data/sxid-catalog.tsv")));

/// NVIDIA's catalog entry for an Xid (data/xid-catalog.tsv, every documented code).
pub fn xid_entry(xid: u32) -> Option<&'static CatalogEntry> {
    XID_CATALOG.get(&xid)
}

pub fn sxid_entry(sxid: u32) -> Option<&'static CatalogEntry> {
    SXID_CATALOG.get(&sxid)
}

/// The Xid's name and nantrace's severity: Critical = the GPU or its memory is unusable until
/// reset, Error = the job's work on it is lost or suspect, Warning = watch it, Info = context.
pub fn xid_info(xid: u32) -> (&'static str, Severity) {
    xid_entry(xid).map_or(("Xid not in NVIDIA's catalog (newer driver?)", Severity::Warning), |e| (e.name, e.severity))
}

/// Does NVIDIA's catalog say this Xid can be the application's own fault (13, 31, 43...)?
pub fn xid_maybe_application(xid: u32) -> bool {
    xid_entry(xid).is_none_or(|e| matches!(e.implicates, "application" | "hardware_or_application" | "info"))
}

/// NVIDIA's recommended action, in words.
pub fn action_text(action: &str) -> &'static str {
    match action {
        "none" => "no action (informational)",
        "restart_app" => "restart the application",
        "reset_gpu" => "reset the GPU (nvidia-smi -r) before reuse",
        "reboot_node" => "reboot the node",
        "check_nvlink" => "follow NVIDIA's NVLink workflow (check links, reset GPU)",
        "contact_support" => "contact NVIDIA support / hardware service",
        "update_sw" => "update the driver or firmware",
        "check_mechanicals" => "check power, cooling and seating",
        "ecc_workflow" => "follow NVIDIA's ECC workflow (row remap / page retirement, reset the GPU)",
        _ => "see NVIDIA's Xid catalog",
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

/// After [`strip_prefixes`]: an optional `<6>` level.
const STAMP: &str = r"^(?:<\d+>)?";

/// Prefixes that recorded kernel lines carry and printk:console records do not: dmesg stamps
/// (`[  123.456]`, `[  +0.000316]`, `[Feb22 04:01]`, `[Mon Nov 30 10:00:00 2026]`, ISO), dmesg -x
/// `kern  :err   : `, syslog/journal `Nov 30 10:00:00 host kernel: ` (any month spelling),
/// `kernel:`, a grep file name, a pdsh host. Only these shapes are removed; what follows must
/// still start with a kernel subsystem's prefix, and a process name is never read as one.
static PREFIX: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"^\s*(?:",
        r"\[\s*\+?\d+\.\d+\]|\d+\.\d{6}\]",
        r"|\[[A-Z][a-z]{2}\s?\d{1,2} \d\d:\d\d\]|\[[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]?\d \d\d:\d\d:\d\d \d{4}\]",
        r"|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[,.]\d+)?(?:[+-]\d\d:?\d\d|Z)?",
        r"|kern\s*:\s*[a-z]+\s*:",
        r"|\S{3,5}\.?\s+[ \d]?\d \d\d:\d\d:\d\d(?: \S+)?\s+kernel:",
        r"|kernel:|\[kernel\]|>(?:\s|$)",
        r"|/var/log/[^:\s]+:",
        r"|[\w.-]+:\s*\[\s*\d+\.\d+\]",
        r")\s*"
    ))
    .unwrap()
});

/// The record without the prefixes of [`PREFIX`] (repeated: `host: kernel: [stamp] `).
pub fn strip_prefixes(mut line: &str) -> &str {
    for _ in 0..6 {
        match PREFIX.find(line) {
            Some(m) if m.end() > 0 => line = &line[m.end()..],
            _ => break,
        }
    }
    line.trim_start()
}

fn re(body: &str) -> Regex {
    Regex::new(&format!("{STAMP}{body}")).expect("kernel pattern compiles")
}

/// A line the kernel starts with a process name: `comm[pid]: segfault at ...`,
/// `traps: comm[pid] general protection fault ...`. comm is at most 15 bytes and may be anything.
static PROC_MSG: LazyLock<Regex> = LazyLock::new(|| {
    // Greedy: the kernel's `[pid]` is the last one within the 16 bytes a comm can take, so a
    // name that holds a forged `[pid] trap` does not choose the pid.
    re(r"(?:traps: )?(?s)(.{1,16})\[(\d+)\]:? (?:segfault at|trap |general protection|potentially unexpected fatal signal|bad frame|invalid opcode)(?-s)(?:.*? in ([^\[\s]+)\[)?")
});
static XID: LazyLock<Regex> = LazyLock::new(|| {
    re(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{2,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)(?: GPU-I:(\d+))?(?: GPU-C:\d+)?\): (\d+)(?:, pid=(?:'?<unknown>'?|(\d+)))?(?:, name=([^,]*))?,?\s*(.*)")
});
static PREVIOUS_XID: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(?i)(?:caused by|due to|following) (?:a )?previous Xid:? ?(\d+)").unwrap());
static SXID: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:nvidia-nvswitch\d*: )?SXid \(PCI:([0-9A-Fa-f:.]+)\): (\d+), (?:(Non-fatal|Fatal)[^,]*, )?(.*)")
});
static OFF_BUS: LazyLock<Regex> = LazyLock::new(|| {
    re(r"NVRM: (?s:.*?)(?:GPU (?:at (?:PCI:)?)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?)(?s:.*))?(?:fallen off the bus|GPU lost from the bus|NV_ERR_GPU_IS_LOST)")
});
static AER_DEV: LazyLock<Regex> = LazyLock::new(|| re(r"(\S+) ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d): (?:AER: )?(.*)$"));
/// The lines of an AER report after its severity line: status/mask, one per error bit, and
/// what recovery did.
static AER_DETAIL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:\s*device \[[0-9a-f]{4}:[0-9a-f]{4}\] error status/mask=|\s*\[\s*\d+\] ([A-Za-z][A-Za-z /-]+?)\s*(?:\(First\))?\s*$|(?:AER: )?(?:can't recover|Root Port link has been reset|device recovery (?:successful|failed)|TLP Header:)|device has no AER-aware driver)").unwrap()
});
static AER_SEV: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^(?:\[[^\]]*\] )?PCIe Bus Error: severity=([^,]+), type=([^,(]+)").unwrap());
static AER_RECV: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)^(Multiple )?(Corrected|Correctable|Uncorrected \(Non-Fatal\)|Uncorrected \(Fatal\)|Uncorrectable \(Non-Fatal\)|Uncorrectable \(Fatal\)) error (?:message )?received(?: from ([0-9a-fA-F:.]+))?").unwrap()
});
static OOM: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): |oom_reaper: reaped process )?(?:Kill(?:ed)? process )?(\d+)(?:, UID \d+,)? \((.{0,16}?)\)(?:[ ,]|$)")
});
static OOM_CONSTRAINT: LazyLock<Regex> = LazyLock::new(|| re(r"oom-kill:constraint=[^\n]*?,task=(.{0,16}?),pid=(\d+),"));
/// `comm invoked oom-killer: gfp_mask=...`: the kernel's own text after the allocating task.
static OOM_INVOKED: LazyLock<Regex> = LazyLock::new(|| re(r"(?s:.{1,16}?) invoked oom-killer: gfp_mask=0x[0-9a-f]+"));
static LINK: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:IPv6: ADDRCONF\(NETDEV_(?:CHANGE|UP)\): (\S+?): link becomes (ready)|(?:\S+ \S+?: |\S+ [0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d )?(?:\S+: )?(\S+?):? (?:NIC )?(?:[Ll]ink is (Down|Up)|[Ll]ink ([Dd]own|[Uu]p)\b|Port: \d+ Link (ACTIVE|DOWN)))")
});
static NIC_ERR: LazyLock<Regex> = LazyLock::new(|| {
    re(r"((?:mlx5_core|mlx5_ib|infiniband|mlx5_\d+)[ :]\s*\S*?):? ?(.*(?:CQE error|dump error cqe|dump_cqe|health compromised|[Ff]atal error|FW_FATAL|internal error|syndrome 0x|cmd_work_handler.*timeout|synd 0x[0-9a-f]+:|irisc not responding|command timeout|wait_func.*(?:timeout|No done completion)|pci_channel_offline|device is in error state|Unrecoverable error|error cqe|\w+ failed(?: with error)?).*)")
});
static HUNG: LazyLock<Regex> = LazyLock::new(|| re(r"INFO: task (.{1,16}?):(\d+) blocked for more than (\d+) seconds"));
/// The hung-task report's other lines: its hint, and the D-state task dump.
static HUNG_DETAIL: LazyLock<Regex> = LazyLock::new(|| re(r#"(?:"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message|task:(.{1,16}?)\s+state:D stack:\s*\d+ pid:\s*(\d+))"#));
static SOFT_LOCKUP: LazyLock<Regex> = LazyLock::new(|| re(r"(?:(?:NMI )?watchdog: )?BUG: soft lockup - CPU#(\d+) stuck for (\d+)s"));
static RCU: LazyLock<Regex> = LazyLock::new(|| re(r"(?:rcu: )?(?:INFO: rcu_\w+ (?:self-)?detected (?:expedited )?stalls?|\s*rcu_\w+ kthread (?:starved|timer wakeup didn't happen)|\s*Unless rcu_\w+ kthread gets sufficient CPU time)"));
static THERMAL: LazyLock<Regex> = LazyLock::new(|| re(r"(?:mce: )?(?:\[Hardware Error\]: )?CPU(\d+): (Core|Package) temperature above threshold"));
static MCE: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:EDAC [^:]*:.*(?:\bCE\b|\bUE\b|[Cc]orrected|[Uu]ncorrected|Machine Check|\bMCE\b|[Ee]rror)|mce: \[Hardware Error\]|mce: CPU\d+: Machine Check|Machine check events logged|\{\d+\}\[Hardware Error\]|\[Hardware Error\]|EDAC \S+: ?\d+ (?:CE|UE)|EDAC \S+ (?:MC\d+|[^:]*): .*(?:CE|UE|[Cc]orrected|[Uu]ncorrected)|EDAC MC\d+: .*error|mce: \[Hardware Error\]|CMCI storm detected|mce_notify_irq|Memory failure: 0x[0-9a-f]+|HANDLING MCE MEMORY ERROR)(.*)")
});
static MCE_UNCORRECTED: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(?i)\bUE\b|uncorrect|fatal|Memory failure|Kernel panic|\bPCC\b|recoverable action|severity: (?:fatal|recoverable)").unwrap());
static NETFS: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:(nfs): server (\S+) (not responding|OK)|(Lustre): .*?(?:Connection to (\S+) \(at [^)]*\) was lost|(\S+)-\S+: Connection restored|(\S+)-\S+: Connection to \S+ \(at [^)]*\) was lost)|(Lustre): .*?Connection (restored) to (\S+)|(mmfs|GPFS)\S*:? .*?(?:[Ee]xpel|lost connection|not responding)[^\d]*?(\S+)?$)")
});
static STALE: LazyLock<Regex> = LazyLock::new(|| re(r"((?:NFS|nfs|Lustre|LustreError)\S*:? .*[Ss]tale (?:NFS )?file handle.*)"));
static BLOCK: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:(?:blk_update_request|print_req_error|critical (?:medium|target|space allocation) error|critical|\S+): )?(?:(I/O error), dev (\w+)|(Buffer I/O error) on (?:dev(?:ice)? )?(\w+)|(?:nvme )?(nvme\d+)(?:n\d+)?: (?:I/O \d+ (?:\([^)]*\) )?QID \d+ (timeout)|(controller is down)|(Device not ready)|(Removing after probe failure)|(\w+\(0x[0-9a-f]+\) @ LBA \d+, \d+ blocks, [^(]*Error)|.*?(reset controller)|(resetting controller))|(EXT4-fs (?:error|warning)) \(device ([\w-]+)\)|(XFS) \((\w+)\): (?:metadata I/O error|Corruption|log I/O error)|(Aborting journal) on device (\w+))")
});

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
    let text = strip_prefixes(text);
    // Records that start with a process name: only what the kernel says after the name counts.
    if let Some(c) = PROC_MSG.captures(text) {
        let library = c.get(3).map(|m| m.as_str().to_string());
        let gpu_library = library.as_deref().is_some_and(|l| {
            let base = l.rsplit('/').next().unwrap_or(l);
            ["libcuda", "libnvidia", "libnccl", "libcudnn", "libcublas", "libnvrtc", "libnvJitLink", "libcudart"].iter().any(|p| base.starts_with(p))
        });
        return Some(KmsgClass::Segfault { crashed_comm: c[1].to_string(), crashed_pid: c[2].parse().ok()?, library, gpu_library });
    }
    // NVRM's two-line "fallen off the bus" message: one record, several lines (an Xid 79
    // line says it too, and is an Xid).
    if let Some(c) = OFF_BUS.captures(text).filter(|_| !XID.is_match(text)) {
        return Some(KmsgClass::GpuFallenOffBus { pci: c.get(1).map_or_else(|| "unknown".to_string(), |m| normalize_pci(m.as_str())), severity: Severity::Critical });
    }
    text.lines().map(strip_prefixes).find_map(classify_line)
}

fn classify_line(line: &str) -> Option<KmsgClass> {
    if let Some(c) = XID.captures(line) {
        let xid: u32 = c[3].parse().ok()?;
        let entry = xid_entry(xid);
        let (meaning, severity) = xid_info(xid);
        let message = c.get(6).map_or("", |m| m.as_str()).trim().to_string();
        return Some(KmsgClass::Xid {
            xid,
            pci: normalize_pci(&c[1]),
            gpu_instance: c.get(2).and_then(|m| m.as_str().parse().ok()),
            xid_pid: c.get(4).and_then(|m| m.as_str().parse().ok()),
            xid_process: c.get(5).map(|m| m.as_str().trim().to_string()).filter(|s| !s.is_empty() && s != "<unknown>"),
            meaning,
            implicates: entry.map_or("unknown", |e| e.implicates),
            action: entry.map_or("contact_support", |e| e.action),
            severity,
            previous_xid: PREVIOUS_XID.captures(&message).and_then(|p| p[1].parse().ok()),
            message,
        });
    }
    if let Some(c) = SXID.captures(line) {
        let sxid: u32 = c[2].parse().ok()?;
        let entry = sxid_entry(sxid);
        let severity = match c.get(3).map(|m| m.as_str()) {
            Some("Fatal") => Severity::Critical,
            Some(_) => Severity::Warning,
            None => entry.map_or(Severity::Warning, |e| e.severity),
        };
        return Some(KmsgClass::Sxid {
            sxid,
            pci: normalize_pci(&c[1]),
            severity,
            meaning: entry.map_or("SXid not in the catalog", |e| e.name),
            action: entry.map_or("contact_support", |e| e.action),
            message: c[4].trim().to_string(),
        });
    }
    if let Some(c) = AER_DEV.captures(line) {
        let rest = &c[3];
        let (sev, ty) = if let Some(s) = AER_SEV.captures(rest) {
            (Some(aer_severity(&s[1])), Some(s[2].trim().to_string()))
        } else if let Some(r) = AER_RECV.captures(rest) {
            (Some(aer_severity(&r[2])), None)
        } else if let Some(d) = AER_DETAIL.captures(rest) {
            (Some("detail".to_string()), d.get(1).map(|m| m.as_str().trim().to_string()))
        } else {
            (None, None)
        };
        if let Some(severity) = sev {
            return Some(KmsgClass::Aer { severity, error_type: ty, device: normalize_pci(&c[2]), driver: c[1].to_string() });
        }
    }
    if let Some(c) = OOM.captures(line) {
        return Some(KmsgClass::OomKill {
            victim_pid: c[2].parse().ok()?,
            victim_comm: c[3].to_string(),
            memcg: c.get(1).is_some_and(|m| m.as_str().starts_with("Memory cgroup")),
        });
    }
    if let Some(c) = HUNG.captures(line) {
        return Some(KmsgClass::HungTask { task: c[1].to_string(), task_pid: c[2].parse().ok()?, seconds: c[3].parse().ok()? });
    }
    if let Some(c) = HUNG_DETAIL.captures(line) {
        return Some(KmsgClass::HungTask { task: c.get(1).map_or("?", |m| m.as_str()).trim().to_string(), task_pid: c.get(2).and_then(|m| m.as_str().parse().ok()).unwrap_or(0), seconds: 0 });
    }
    if let Some(c) = OOM_CONSTRAINT.captures(line) {
        return Some(KmsgClass::OomKill { victim_pid: c[2].parse().ok()?, victim_comm: c[1].to_string(), memcg: line.contains("CONSTRAINT_MEMCG") });
    }
    if OOM_INVOKED.is_match(line) {
        return Some(KmsgClass::OomInvoked);
    }
    if let Some(c) = SOFT_LOCKUP.captures(line) {
        return Some(KmsgClass::SoftLockup { cpu: c[1].parse().ok()?, seconds: c[2].parse().ok()? });
    }
    if RCU.is_match(line) {
        return Some(KmsgClass::RcuStall);
    }
    if let Some(c) = THERMAL.captures(line) {
        return Some(KmsgClass::CpuThermal { cpu: c[1].parse().ok()?, scope: c[2].to_ascii_lowercase() });
    }
    if let Some(c) = MCE.captures(line) {
        let m = c.get(0).map_or("", |m| m.as_str());
        let corrected_only = m.contains("CMCI storm") || m.contains(" CE ") || m.contains(" CE") && !m.contains(" UE");
        return Some(KmsgClass::MachineCheck { uncorrected: !corrected_only && MCE_UNCORRECTED.is_match(m), message: m.trim().to_string() });
    }
    if let Some(c) = NETFS.captures(line) {
        if let Some(fs) = c.get(1) {
            let ok = &c[3] == "OK";
            let (server, fs) = (c[2].trim_end_matches(',').to_string(), fs.as_str().to_string());
            return Some(if ok { KmsgClass::NetFsOk { server, fs } } else { KmsgClass::NetFsDown { server, fs } });
        }
        if c.get(4).is_some() {
            if let Some(s) = c.get(6) {
                return Some(KmsgClass::NetFsOk { server: s.as_str().to_string(), fs: "lustre".into() });
            }
            let server = c.get(5).or(c.get(7)).map_or("?", |m| m.as_str()).to_string();
            return Some(KmsgClass::NetFsDown { server, fs: "lustre".into() });
        }
        if c.get(8).is_some() {
            return Some(KmsgClass::NetFsOk { server: c.get(10).map_or("?", |m| m.as_str()).to_string(), fs: "lustre".into() });
        }
        if c.get(11).is_some() {
            return Some(KmsgClass::NetFsDown { server: c.get(12).map_or("?", |m| m.as_str()).to_string(), fs: "gpfs".into() });
        }
    }
    if let Some(c) = STALE.captures(line) {
        return Some(KmsgClass::StaleHandle { message: c[1].trim().to_string() });
    }
    if let Some(c) = BLOCK.captures(line) {
        let pick = |i: &[usize]| i.iter().find_map(|&i| c.get(i)).map(|m| m.as_str().to_string());
        let dev = pick(&[2, 4, 5, 15, 17, 19]).unwrap_or_default();
        let kind = pick(&[1, 3, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18]).unwrap_or_default();
        let kind = match kind.as_str() {
            "I/O error" | "Buffer I/O error" => "io_error",
            k if k.ends_with("Error") => "io_error",
            "timeout" => "nvme_timeout",
            "EXT4-fs error" | "EXT4-fs warning" | "XFS" | "Aborting journal" => "fs_error",
            _ => "nvme_reset",
        };
        return Some(KmsgClass::BlockError { dev, kind: kind.to_string() });
    }
    if let Some(c) = NIC_ERR.captures(line) {
        return Some(KmsgClass::NicError { device: c[1].trim().to_string(), message: c[2].trim().chars().take(160).collect() });
    }
    if let Some(c) = LINK.captures(line) {
        let iface = c.get(1).or(c.get(3)).map_or("", |m| m.as_str()).trim_end_matches(':').to_string();
        let state = c.get(2).or(c.get(4)).or(c.get(5)).or(c.get(6)).map_or("", |m| m.as_str()).to_ascii_lowercase();
        return Some(if matches!(state.as_str(), "down" | "init") { KmsgClass::LinkDown { iface } } else { KmsgClass::LinkUp { iface } });
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
    fn old_driver_mig_and_chained_xids() {
        let (x, pci, pid, _, _) = xid("NVRM: Xid (0000:01:00): 31, Ch 00000010, engmask 00000101, intr 10000000");
        assert_eq!((x, pci.as_str(), pid), (31, "0000:01:00.0", None));
        match classify("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 31, pid=1234, name=python, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2d_1a000000.") {
            Some(KmsgClass::Xid { xid, gpu_instance, implicates, .. }) => assert_eq!((xid, gpu_instance, implicates), (31, Some(5), "hardware_or_application")),
            other => panic!("{other:?}"),
        }
        match classify("NVRM: Xid (PCI:0000:41:00): 45, pid=911, name=python, Ch 00000010, caused by previous Xid 79") {
            Some(KmsgClass::Xid { previous_xid, action, .. }) => assert_eq!((previous_xid, action), (Some(79), "none")),
            other => panic!("{other:?}"),
        }
        match classify("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.") {
            Some(KmsgClass::Xid { action, .. }) => assert_eq!(action_text(action), "reboot the node"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_catalog_covers_every_documented_code() {
        for x in 1..=172 {
            assert!(xid_entry(x).is_some() || [].contains(&x), "Xid {x} missing from data/xid-catalog.tsv");
        }
        assert!(xid_maybe_application(13) && xid_maybe_application(31) && xid_maybe_application(43));
        assert!(!xid_maybe_application(48) && !xid_maybe_application(79) && !xid_maybe_application(95));
        assert!(sxid_entry(12028).is_some());
    }

    #[test]
    fn older_oom_wording() {
        assert!(matches!(classify("Out of memory: Kill process 3021 (python) score 912 or sacrifice child"), Some(KmsgClass::OomKill { victim_pid: 3021, memcg: false, .. })));
        assert!(matches!(classify("Killed process 3021 (python) total-vm:71234552kB, anon-rss:61234000kB, file-rss:0kB, shmem-rss:0kB"), Some(KmsgClass::OomKill { victim_pid: 3021, .. })));
        assert!(matches!(classify("Memory cgroup out of memory: Kill process 77 (pt_main_thread) score 1000 or sacrifice child"), Some(KmsgClass::OomKill { victim_pid: 77, memcg: true, .. })));
    }

    #[test]
    fn new_kernel_classes() {
        let c = |l: &str| classify(l).unwrap_or_else(|| panic!("unclassified: {l}"));
        assert_eq!(c("nfs: server storage01 not responding, still trying"), KmsgClass::NetFsDown { server: "storage01".into(), fs: "nfs".into() });
        assert_eq!(c("nfs: server storage01 OK"), KmsgClass::NetFsOk { server: "storage01".into(), fs: "nfs".into() });
        assert!(matches!(c("watchdog: BUG: soft lockup - CPU#3 stuck for 22s! [python:1234]"), KmsgClass::SoftLockup { cpu: 3, seconds: 22 }));
        assert_eq!(c("rcu: INFO: rcu_sched detected stalls on CPUs/tasks:"), KmsgClass::RcuStall);
        assert!(matches!(c("python[8812]: segfault at 10 ip 00007f3a1c2b4d5e sp 00007ffd1a2b3c40 error 4 in libcuda.so.535.104.05[7f3a1b000000+1e00000]"), KmsgClass::Segfault { crashed_pid: 8812, gpu_library: true, .. }));
        assert!(matches!(c("python3[77]: segfault at 0 ip 0000000000401000 sp 00007ffc0 error 6 in python3.10[400000+1000]"), KmsgClass::Segfault { gpu_library: false, .. }));
        assert!(matches!(c("CPU3: Core temperature above threshold, cpu clock throttled (total events = 1)"), KmsgClass::CpuThermal { cpu: 3, .. }));
        assert!(matches!(c("mce: CPU7: Package temperature above threshold, cpu clock throttled (total events = 12)"), KmsgClass::CpuThermal { cpu: 7, .. }));
        assert!(matches!(c("mlx5_core 0000:3b:00.0: mlx5_cmd_out_err:838:(pid 0): health compromised - reached miss count"), KmsgClass::NicError { .. }));
        assert!(matches!(c("infiniband mlx5_0: dump_cqe:272:(pid 0): dump error cqe"), KmsgClass::NicError { .. }));
        assert_eq!(c("blk_update_request: I/O error, dev sdb, sector 123456 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0"), KmsgClass::BlockError { dev: "sdb".into(), kind: "io_error".into() });
        assert_eq!(c("I/O error, dev nvme0n1, sector 98765 op 0x1:(WRITE) flags 0x8800 phys_seg 1 prio class 2"), KmsgClass::BlockError { dev: "nvme0n1".into(), kind: "io_error".into() });
        assert_eq!(c("nvme nvme0: I/O 123 QID 4 timeout, aborting"), KmsgClass::BlockError { dev: "nvme0".into(), kind: "nvme_timeout".into() });
        assert_eq!(c("nvme nvme1: controller is down; will reset: CSTS=0x3, PCI_STATUS=0x10"), KmsgClass::BlockError { dev: "nvme1".into(), kind: "nvme_reset".into() });
        assert!(matches!(c("Buffer I/O error on dev sda1, logical block 0, async page read"), KmsgClass::BlockError { .. }));
        assert!(matches!(c("CMCI storm detected: switching to poll mode"), KmsgClass::MachineCheck { uncorrected: false, .. }));
        assert!(matches!(c("EDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"), KmsgClass::MachineCheck { uncorrected: true, .. }));
        assert!(matches!(c("EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"), KmsgClass::MachineCheck { uncorrected: false, .. }));
        assert!(matches!(c("[ 1234.567890] mce: [Hardware Error]: Machine check events logged"), KmsgClass::MachineCheck { .. }));
        assert!(matches!(c("NFS: Stale file handle on server storage01"), KmsgClass::StaleHandle { .. }));
    }

    #[test]
    fn process_names_are_never_evidence() {
        // Redteam 3.5: comm is the process's own text; the kernel puts it first.
        for l in [
            "EDAC MC0: 1 UE[20803]: segfault at 0 ip 000055d0c0a0113d sp 00007ffd3b1c0a20 error 6 in spoof[55d0c0a01000+1000]",
            "x Link is Down[777]: segfault at 0 ip 0000000000401000 sp 00007ffc00000000 error 4 in spoof[401000+1000]",
            "NVRM: Xid (PCI:0[42]: segfault at 0 ip 0000000000401000 sp 00007ffc00000000 error 4",
            "traps: mce: [Hardwar[99] general protection fault ip:401000 sp:7ffc0 error:0 in spoof[401000+1000]",
        ] {
            assert!(matches!(classify(l), Some(KmsgClass::Segfault { .. }) | None), "{l}: {:?}", classify(l));
        }
        // A name holding a forged `[pid] trap` does not choose the crashed pid.
        assert!(matches!(classify("traps: a[21615] trap x[21624] trap invalid opcode ip:401000 sp:7ffc error:0"), Some(KmsgClass::Segfault { crashed_pid: 21624, .. })));
        // A hung task named like an Xid is a hung task.
        assert!(matches!(classify("INFO: task NVRM: Xid (PCI:0:42 blocked for more than 120 seconds."), Some(KmsgClass::HungTask { .. })));
        // Unanchored text later in a line is not a kernel subsystem's message.
        assert_eq!(classify("audit: comm=\"EDAC MC0: 1 UE\" exe=/tmp/spoof"), None);
        assert_eq!(classify("some driver said: NVRM: Xid (PCI:0000:3b:00): 79, fake"), None);
    }

    #[test]
    fn pci_normalisation() {
        assert_eq!(normalize_pci("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_pci("0000:3b:00"), "0000:3b:00.0");
        assert_eq!(normalize_pci("3b:00.1"), "0000:3b:00.1");
    }
}
