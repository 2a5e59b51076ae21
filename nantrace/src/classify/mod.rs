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
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

mod catalog;
pub use catalog::{
    action_text, sxid_entry, xid_entry, xid_info, xid_maybe_application, CatalogEntry,
};

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
            KmsgClass::OomKill { .. }
            | KmsgClass::HungTask { .. }
            | KmsgClass::SoftLockup { .. }
            | KmsgClass::NicError { .. }
            | KmsgClass::BlockError { .. }
            | KmsgClass::NetFsDown { .. } => Severity::Error,
            KmsgClass::MachineCheck { uncorrected, .. } => {
                if *uncorrected {
                    Severity::Critical
                } else {
                    Severity::Warning
                }
            }
            KmsgClass::LinkDown { .. }
            | KmsgClass::RcuStall
            | KmsgClass::CpuThermal { .. }
            | KmsgClass::StaleHandle { .. }
            | KmsgClass::Segfault { .. } => Severity::Warning,
            KmsgClass::LinkUp { .. } | KmsgClass::NetFsOk { .. } | KmsgClass::OomInvoked => {
                Severity::Info
            }
        }
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

/// A network device's rename, as the kernel logs it (`<new>: renamed from <old>`, newer
/// kernels add ` (while UP)`), after any driver and bus prefix.
static RENAMED: LazyLock<Regex> =
    LazyLock::new(|| re(r".*: renamed from \S+(?: \(while UP\))?\s*$"));
/// A record led by a process's name (up to 16 bytes, any characters) and its pid: `NAME[pid]`
/// or `NAME (pid):`.
static COMM_LED: LazyLock<Regex> = LazyLock::new(|| re(r"(?s).{1,16}?(?:\[\d+\][: ]|\s\(\d+\): )"));
/// A line the kernel starts with a process name: `comm[pid]: segfault at ...`,
/// `traps: comm[pid] general protection fault ...`. comm is at most 15 bytes and may be anything.
static PROC_MSG: LazyLock<Regex> = LazyLock::new(|| {
    // Greedy: the kernel's `[pid]` is the last one within the 16 bytes a comm can take, so a
    // name that holds a forged `[pid] trap` does not choose the pid.
    re(
        r"(?:traps: )?(?s)(.{1,16})\[(\d+)\]:? (?:segfault at|trap |general protection|potentially unexpected fatal signal|bad frame|invalid opcode)(?-s)(?:.*? in ([^\[\s]+)\[)?",
    )
});
static XID: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{2,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)(?: GPU-I:(\d+))?(?: GPU-C:\d+)?\): (\d+)(?:, pid=(?:'?<unknown>'?|(\d+)))?(?:, name=([^,]*))?,?\s*(.*)",
    )
});
static PREVIOUS_XID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:caused by|due to|following) (?:a )?previous Xid:? ?(\d+)").unwrap()
});
static SXID: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:nvidia-nvswitch\d*: )?SXid \(PCI:([0-9A-Fa-f:.]+)\): (\d+), (?:(Non-fatal|Fatal)[^,]*, )?(.*)",
    )
});
static OFF_BUS: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"NVRM: (?s:.*?)(?:GPU (?:at (?:PCI:)?)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?)(?s:.*))?(?:fallen off the bus|GPU lost from the bus|NV_ERR_GPU_IS_LOST)",
    )
});
static AER_DEV: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(\S+) ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d): (?:AER: )?(.*)$")
});
/// The lines of an AER report after its severity line: status/mask, one per error bit, and
/// what recovery did.
static AER_DETAIL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:\s*device \[[0-9a-f]{4}:[0-9a-f]{4}\] error status/mask=|\s*\[\s*\d+\] ([A-Za-z][A-Za-z /-]+?)\s*(?:\(First\))?\s*$|(?:AER: )?(?:can't recover|Root Port link has been reset|device recovery (?:successful|failed)|TLP Header:)|device has no AER-aware driver)").unwrap()
});
static AER_SEV: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:\[[^\]]*\] )?PCIe Bus Error: severity=([^,]+), type=([^,(]+)").unwrap()
});
static AER_RECV: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)^(Multiple )?(Corrected|Correctable|Uncorrected \(Non-Fatal\)|Uncorrected \(Fatal\)|Uncorrectable \(Non-Fatal\)|Uncorrectable \(Fatal\)) error (?:message )?received(?: from ([0-9a-fA-F:.]+))?").unwrap()
});
static OOM: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): |oom_reaper: reaped process )?(?:Kill(?:ed)? process )?(\d+)(?:, UID \d+,)? \((.{0,16}?)\)(?:[ ,]|$)",
    )
});
static OOM_CONSTRAINT: LazyLock<Regex> =
    LazyLock::new(|| re(r"oom-kill:constraint=[^\n]*?,task=(.{0,16}?),pid=(\d+),"));
/// `comm invoked oom-killer: gfp_mask=...`: the kernel's own text after the allocating task.
static OOM_INVOKED: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?s:.{1,16}?) invoked oom-killer: gfp_mask=0x[0-9a-f]+"));
static LINK: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:IPv6: ADDRCONF\(NETDEV_(?:CHANGE|UP)\): (\S+?): link becomes (ready)|(?:\S+ \S+?: |\S+ [0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d )?(?:\S+: )?(\S+?):? (?:NIC )?(?:[Ll]ink is (Down|Up)|[Ll]ink ([Dd]own|[Uu]p)\b|Port: \d+ Link (ACTIVE|DOWN)))",
    )
});
static NIC_ERR: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"((?:mlx5_core|mlx5_ib|infiniband|mlx5_\d+)[ :]\s*\S*?):? ?(.*(?:CQE error|dump error cqe|dump_cqe|health compromised|[Ff]atal error|FW_FATAL|internal error|syndrome 0x|cmd_work_handler.*timeout|synd 0x[0-9a-f]+:|irisc not responding|command timeout|wait_func.*(?:timeout|No done completion)|pci_channel_offline|device is in error state|Unrecoverable error|error cqe|\w+ failed(?: with error)?).*)",
    )
});
static HUNG: LazyLock<Regex> =
    LazyLock::new(|| re(r"INFO: task (.{1,16}?):(\d+) blocked for more than (\d+) seconds"));
/// The hung-task report's other lines: its hint, and the D-state task dump.
static HUNG_DETAIL: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r#"(?:"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message|task:(.{1,16}?)\s+state:D stack:\s*\d+ pid:\s*(\d+))"#,
    )
});
static SOFT_LOCKUP: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?:(?:NMI )?watchdog: )?BUG: soft lockup - CPU#(\d+) stuck for (\d+)s"));
static RCU: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:rcu: )?(?:INFO: rcu_\w+ (?:self-)?detected (?:expedited )?stalls?|\s*rcu_\w+ kthread (?:starved|timer wakeup didn't happen)|\s*Unless rcu_\w+ kthread gets sufficient CPU time)",
    )
});
static THERMAL: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:mce: )?(?:\[Hardware Error\]: )?CPU(\d+): (Core|Package) temperature above threshold")
});
static MCE: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:EDAC [^:]*:.*(?:\bCE\b|\bUE\b|[Cc]orrected|[Uu]ncorrected|Machine Check|\bMCE\b|[Ee]rror)|mce: \[Hardware Error\]|mce: CPU\d+: Machine Check|Machine check events logged|\{\d+\}\[Hardware Error\]|\[Hardware Error\]|EDAC \S+: ?\d+ (?:CE|UE)|EDAC \S+ (?:MC\d+|[^:]*): .*(?:CE|UE|[Cc]orrected|[Uu]ncorrected)|EDAC MC\d+: .*error|mce: \[Hardware Error\]|CMCI storm detected|Memory failure: 0x[0-9a-f]+|HANDLING MCE MEMORY ERROR)(.*)",
    )
});
static MCE_UNCORRECTED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\bUE\b|uncorrect|fatal|Memory failure|Kernel panic|\bPCC\b|recoverable action|severity: (?:fatal|recoverable)").unwrap()
});
static NETFS: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:(nfs): server (\S+) (not responding|OK)|(Lustre): .*?(?:Connection to (\S+) \(at [^)]*\) was lost|(\S+)-\S+: Connection restored|(\S+)-\S+: Connection to \S+ \(at [^)]*\) was lost)|(Lustre): .*?Connection (restored) to (\S+)|(mmfs|GPFS)\S*:? .*?(?:[Ee]xpel|lost connection|not responding)[^\d]*?(\S+)?$)",
    )
});
static STALE: LazyLock<Regex> = LazyLock::new(|| {
    re(r"((?:NFS|nfs|Lustre|LustreError)\S*:? .*[Ss]tale (?:NFS )?file handle.*)")
});
static BLOCK: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:(?:blk_update_request|print_req_error|critical (?:medium|target|space allocation) error|critical|\S+): )?(?:(I/O error), dev (\w+)|(Buffer I/O error) on (?:dev(?:ice)? )?(\w+)|(?:nvme )?(nvme\d+)(?:n\d+)?: (?:I/O \d+ (?:\([^)]*\) )?QID \d+ (timeout)|(controller is down)|(Device not ready)|(Removing after probe failure)|(\w+\(0x[0-9a-f]+\) @ LBA \d+, \d+ blocks, [^(]*Error)|.*?(reset controller)|(resetting controller))|(EXT4-fs (?:error|warning)) \(device ([\w-]+)\)|(XFS) \((\w+)\): (?:metadata I/O error|Corruption|log I/O error)|(Aborting journal) on device (\w+))",
    )
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
/// A live kernel record (the probe's, or /dev/kmsg's), classified only when it is a line of
/// its own: a continuation (`KERN_CONT`, e.g. the ` in <file name>[...]` the kernel appends
/// to a segfault report, where the file name is the user's and may hold newlines and a whole
/// fake `NVRM: Xid` line) belongs to the record it continues and is never evidence. The
/// kernel's own lines start with a subsystem or driver name, never with a blank.
/// `cont`: the record says it is a continuation (/dev/kmsg's `c` flag, older kernels).
pub fn classify_record(text: &str, cont: bool) -> Option<KmsgClass> {
    if cont || is_continuation(text) {
        return None;
    }
    classify(text)
}

/// A record that starts with a blank, after a console timestamp (`[   15.330000] `, the
/// shape of 5.10's printk:console records).
fn is_continuation(text: &str) -> bool {
    let t = text
        .strip_prefix('[')
        .and_then(|r| r.split_once("] "))
        .filter(|(ts, _)| ts.trim().parse::<f64>().is_ok())
        .map_or(text, |(_, rest)| rest);
    t.starts_with([' ', '\t', '\n'])
}

pub fn classify(text: &str) -> Option<KmsgClass> {
    let text = strip_prefixes(text);
    // Records that start with a process name: only what the kernel says after the name counts.
    if let Some(c) = PROC_MSG.captures(text) {
        let library = c.get(3).map(|m| m.as_str().to_string());
        let gpu_library = library.as_deref().is_some_and(|l| {
            let base = l.rsplit('/').next().unwrap_or(l);
            [
                "libcuda",
                "libnvidia",
                "libnccl",
                "libcudnn",
                "libcublas",
                "libnvrtc",
                "libnvJitLink",
                "libcudart",
            ]
            .iter()
            .any(|p| base.starts_with(p))
        });
        return Some(KmsgClass::Segfault {
            crashed_comm: c[1].to_string(),
            crashed_pid: c[2].parse().ok()?,
            library,
            gpu_library,
        });
    }
    // Records that start with a name a user chooses are never evidence (redteam4 D-1): a
    // network device renamed in the user's own namespace (`mce_notify_irq: renamed from
    // fatal`, `mlx5_0: renamed from failed`), and a process's name before its pid in the
    // kernel's remarks about it (`EDAC 0: UE[1719] misaligned vsyscall`, `EDAC 0: UE (2003):
    // /proc/2003/oom_adj is deprecated`).
    if RENAMED.is_match(text.lines().next().unwrap_or("")) || COMM_LED.is_match(text) {
        return None;
    }
    // NVRM's two-line "fallen off the bus" message: one record, several lines (an Xid 79
    // line says it too, and is an Xid).
    if let Some(c) = OFF_BUS
        .captures(text)
        .filter(|_| text.starts_with("NVRM:") && !XID.is_match(text))
    {
        return Some(KmsgClass::GpuFallenOffBus {
            pci: c
                .get(1)
                .map_or_else(|| "unknown".to_string(), |m| normalize_pci(m.as_str())),
            severity: Severity::Critical,
        });
    }
    // One printk call can hold newlines, and in `printk:console` mode they arrive unescaped:
    // a line after the first is the kernel's only when it carries the first line's producer
    // (an AER report's lines all name the port, NVRM's all say NVRM:). Anything else is the
    // text a message quoted (a mount option `x\nNVRM: Xid ... 79` made a tmpfs error a
    // kernel Xid 79: redteam4 D-2).
    let producer = producer_of(text);
    text.lines()
        .map(strip_prefixes)
        .enumerate()
        .filter(|(i, l)| *i == 0 || (!producer.is_empty() && producer_of(l) == producer))
        .find_map(|(_, l)| classify_line(l))
}

/// The word a kernel line starts with, its producer (`NVRM`, `pcieport`, `mce`, `EDAC`,
/// `tmpfs`), without its colon.
fn producer_of(line: &str) -> &str {
    let w = line.split_whitespace().next().unwrap_or("");
    w.strip_suffix(':').unwrap_or(w)
}

fn classify_line(line: &str) -> Option<KmsgClass> {
    for f in &FORMATS {
        if let Some(c) = f.re.captures(line) {
            let class = (f.read)(&c, line);
            if class.is_some() || f.last {
                return class;
            }
        }
    }
    None
}

mod formats;
use formats::FORMATS;

#[cfg(test)]
mod tests;
