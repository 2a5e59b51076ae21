//! `nantrace doctor`: what this machine supports, probe by probe.
use std::path::Path;

use serde::Serialize;

use crate::probes::{Options, ProbePath, ProbeStatus, Probes, PROBES};

#[derive(Debug, Serialize)]
pub struct Report {
    pub kernel: String,
    pub euid: u32,
    pub tracefs: Option<String>,
    pub btf: bool,
    /// How the probes read the kernel's data: "btf", "tracefs" or "mixed" (per probe below).
    pub probe_path: String,
    pub probes_built: bool,
    pub load_error: Option<String>,
    pub probes: Vec<ProbeStatus>,
    /// Where the kernel log lines come from and why (`crate::klog`).
    pub kernel_log: Option<crate::klog::KlogSource>,
    pub nvml: String,
    pub notes: Vec<String>,
}

/// One line for the probes' paths: which run as `tp_btf` programs, which on tracefs records.
pub fn probe_path(probes: &[ProbeStatus]) -> String {
    let names = |p: ProbePath| {
        probes
            .iter()
            .filter(|s| s.attached && s.path == p)
            .map(|s| s.tracepoint.as_str())
            .collect::<Vec<_>>()
    };
    let btf = names(ProbePath::Btf);
    let fallback: Vec<String> = probes
        .iter()
        .filter_map(|s| {
            s.btf_fallback
                .as_ref()
                .map(|w| format!("{}: {w}", s.tracepoint))
        })
        .collect();
    let mut line = if btf.is_empty() {
        "tracefs: every probe reads its tracepoint record at offsets from the format files"
            .to_string()
    } else {
        format!("BTF for {} (kernel structs at offsets from /sys/kernel/btf/vmlinux); tracefs records for the rest", btf.join(", "))
    };
    if !fallback.is_empty() {
        line.push_str(&format!(
            "; on the tracefs fallback: {}",
            fallback.join("; ")
        ));
    }
    line
}

/// Whole-disk block devices whose queue keeps no I/O statistics.
fn iostats_off() -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out: Vec<String> = rd
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("queue/iostats")).is_ok_and(|v| v.trim() == "0")
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

pub fn nvml_status() -> String {
    match nvml_wrapper::Nvml::init() {
        Ok(n) => match (n.sys_driver_version(), n.device_count()) {
            (Ok(v), Ok(c)) => format!("available: driver {v}, {c} GPU(s)"),
            (v, c) => format!("initialised but incomplete: driver {v:?}, devices {c:?}"),
        },
        Err(e) => format!("NVML unavailable: {e}"),
    }
}

pub fn run() -> Report {
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let tracefs = crate::tracefs::root().map(|p| p.display().to_string());
    let mut notes = Vec::new();
    let (probes, load_error, kernel_log) = if !Probes::is_built() {
        (
            Vec::new(),
            Some("eBPF object not built into this binary: run `cargo xtask build`".to_string()),
            None,
        )
    } else {
        match Probes::load(&Options::default()) {
            Ok(p) => (p.status.clone(), None, p.klog.clone()),
            Err(e) => (Vec::new(), Some(format!("{e:#}")), None),
        }
    };
    let probes = if probes.is_empty() {
        PROBES
            .iter()
            .map(|s| ProbeStatus {
                program: s.program,
                tracepoint: format!("{}:{}", s.group, s.name),
                path: ProbePath::Tracefs,
                btf_fallback: None,
                attached: false,
                reason: Some(load_error.clone().unwrap_or_else(|| "not loaded".into())),
                what: s.what,
            })
            .collect()
    } else {
        probes
    };
    if probes
        .iter()
        .any(|p| p.tracepoint == "ras:aer_event" && !p.attached)
    {
        notes.push("ras:aer_event is absent (kernel without CONFIG_PCIEAER or the ras events): AER is still caught from the kernel log text by the printk:console probe".into());
    }
    if probes.iter().any(|p| {
        p.tracepoint == "sched:sched_process_fork" && p.attached && p.path == ProbePath::Btf
    }) {
        notes.push("task:task_newtask is not attached: not needed, the BTF fork program tells threads from processes by the child's tgid".into());
    }
    if probes.iter().any(|p| {
        p.tracepoint == "sched:sched_process_exit" && p.attached && p.path == ProbePath::Btf
    }) {
        notes.push("syscalls:sys_enter_exit_group is not attached: not needed, the BTF exit program reads the exit status from the kernel's record of the group".into());
    }
    if probes.iter().any(|p| {
        p.tracepoint == "block:block_rq_complete" && p.attached && p.path == ProbePath::Btf
    }) {
        let off = iostats_off();
        if !off.is_empty() {
            notes.push(format!("block devices with I/O statistics off (queue/iostats = 0): {}. On the BTF path their requests outside watched jobs have no start time and are not in the latency histograms", off.join(", ")));
        }
    }
    if let Err(e) = crate::klog::readable() {
        notes.push(format!("/dev/kmsg cannot be read ({e}): who wrote a kernel log line cannot be checked, so no kernel log line drains this node, marks a GPU in the history or fires a node-wide trigger (fail-closed; NVML's and tracepoints' records still can). Give the agent /dev/kmsg (a container: mount it; dmesg_restrict: CAP_SYSLOG)"));
    }
    if euid != 0 {
        notes.push(
            "not root: loading probes needs root (or CAP_BPF + CAP_PERFMON + tracefs access)"
                .into(),
        );
    }
    Report {
        kernel,
        euid,
        tracefs,
        btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
        probe_path: match &load_error {
            Some(e) => format!("not loaded: {e}"),
            None => probe_path(&probes),
        },
        probes_built: Probes::is_built(),
        load_error,
        probes,
        kernel_log,
        nvml: nvml_status(),
        notes,
    }
}

pub fn print_human(r: &Report) {
    crate::sayout!("kernel        {}", r.kernel);
    crate::sayout!(
        "privileges    euid={}{}",
        r.euid,
        if r.euid == 0 {
            " (root)"
        } else {
            " (not root)"
        }
    );
    crate::sayout!(
        "tracefs       {}",
        r.tracefs
            .clone()
            .unwrap_or_else(crate::tracefs::why_unavailable)
    );
    crate::sayout!(
        "BTF           {}",
        if r.btf {
            "/sys/kernel/btf/vmlinux"
        } else {
            "absent"
        }
    );
    crate::sayout!("probe path    {}", r.probe_path);
    crate::sayout!(
        "probes built  {}",
        if r.probes_built { "yes" } else { "no" }
    );
    if let Some(e) = &r.load_error {
        crate::sayout!("load          FAILED: {e}");
    }
    if let Some(k) = &r.kernel_log {
        crate::sayout!("kernel log    {} ({})", k.source, k.why);
    }
    crate::sayout!("NVML          {}", r.nvml);
    crate::sayout!("probes:");
    for p in &r.probes {
        crate::sayout!(
            "  {:<34} {:<12} {:<8} {}",
            p.tracepoint,
            if p.attached {
                "attached"
            } else {
                "NOT ATTACHED"
            },
            if p.attached {
                match p.path {
                    ProbePath::Btf => "btf",
                    ProbePath::Tracefs => "tracefs",
                    ProbePath::Kmsg => "kmsg",
                }
            } else {
                ""
            },
            p.reason.as_deref().unwrap_or(p.what)
        );
    }
    for n in &r.notes {
        crate::sayout!("note: {n}");
    }
}
