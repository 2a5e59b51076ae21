//! Loading the object and attaching its programs: the BTF path where the kernel's BTF has
//! what a program needs and its verifier accepts it, else the tracefs path, per probe; what
//! did not attach is said in the status and the rest run.
use aya::maps::{MapData, PerCpuArray};
use aya::programs::{BtfTracePoint, TracePoint};
use aya::{Ebpf, EbpfLoader};
use nantrace_common::{BtfOffsets, Config};

use super::offsets::{all_needs, btf_offsets, offsets, NeedResult};
use super::{
    btf, jobmap, verifier_msg, wake_bytes, BenchPrograms, BtfNeeds, Options, ProbeError, ProbePath,
    ProbeSpec, ProbeStatus, Probes, BPF_OBJ, PROBES,
};
use crate::tracefs;

impl Probes {
    pub fn load(opts: &Options) -> Result<Self, ProbeError> {
        if BPF_OBJ.is_empty() {
            return Err(ProbeError::NotBuilt);
        }
        let root =
            tracefs::root().ok_or_else(|| ProbeError::NoTracefs(tracefs::why_unavailable()))?;
        // The kernel's own answer (a probe map is created), not its version: distributions
        // backport the ring buffer. An error of the probe itself (no permission) is left to
        // the load below, which says it.
        if let Ok(false) = aya::sys::is_map_supported(aya::maps::MapType::RingBuf) {
            return Err(ProbeError::NoRingBuf(
                std::fs::read_to_string("/proc/sys/kernel/osrelease")
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            ));
        }
        let (off, missing) = offsets(&root);
        let (btf_off, btf_ok, kernel_btf) = btf_plan(opts.btf);
        let exit_live = btf_off.exit_group_dead_arg != 1;
        let cfg = Config {
            slow_io_ns: opts.slow_io_ns,
            wake_bytes: wake_bytes(opts.ring_bytes),
            whole_machine: u32::from(opts.whole_machine),
            self_pid: std::process::id(),
            off,
            btf: btf_off,
        };
        // RLIMIT_MEMLOCK: not needed on 6.x (memcg accounting); raising it may fail unprivileged.
        let rl = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: plain setrlimit call with a valid pointer; failure is harmless here.
        let _ = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) };
        let ebpf = EbpfLoader::new()
            .override_global("NANTRACE_CONFIG", &cfg, true)
            .map_max_entries("EVENTS", opts.ring_bytes.next_power_of_two())
            // The benchmark's own hashes (`bench-internal` loads the object separately, at
            // full size): preallocated, they would take megabytes of kernel memory for nothing.
            .map_max_entries("AB_HASH", 1)
            .map_max_entries("MC_HASH", 1)
            .load(BPF_OBJ)?;
        let mut a = Attacher {
            ebpf,
            status: Vec::new(),
            btf_ok,
            kernel_btf,
            missing,
            exit_live,
            floors: opts.bench == BenchPrograms::FloorOnly,
            fork_on_btf: false,
            exit_on_btf: false,
        };
        a.load_block_pair();
        for spec in PROBES {
            a.attach(spec)?;
        }
        if opts.bench == BenchPrograms::Synthetic {
            let res = attach_tracefs(&mut a.ebpf, "bench_emit", "syscalls", "sys_enter_getppid");
            a.status.push(ProbeStatus {
                program: "bench_emit",
                tracepoint: "syscalls:sys_enter_getppid".into(),
                path: ProbePath::Tracefs,
                btf_fallback: None,
                attached: res.is_ok(),
                reason: res.err(),
                what: "benchmark: synthetic records",
            });
        }
        let mut p = Self::with_maps(a.ebpf, a.status, root)?;
        if opts.bench == BenchPrograms::None {
            p.choose_klog();
        }
        Ok(p)
    }

    /// The loaded object with the maps userspace keeps, taken out of it.
    fn with_maps(
        mut ebpf: Ebpf,
        status: Vec<ProbeStatus>,
        tracefs: std::path::PathBuf,
    ) -> Result<Self, ProbeError> {
        let take = |ebpf: &mut Ebpf, name: &'static str| {
            ebpf.take_map(name)
                .ok_or_else(|| ProbeError::Map(name, "missing from the object".into()))
        };
        let job_map = match take(&mut ebpf, "JOB_MAP")? {
            aya::maps::Map::Array(m) => std::sync::Arc::new(jobmap::JobMap::new(m)?),
            _ => return Err(ProbeError::Map("JOB_MAP", "not an array".into())),
        };
        let drops = PerCpuArray::try_from(take(&mut ebpf, "DROPS")?)
            .map_err(|e| ProbeError::Map("DROPS", e.to_string()))?;
        let bio_hist = PerCpuArray::try_from(take(&mut ebpf, "BIO_HIST")?)
            .map_err(|e| ProbeError::Map("BIO_HIST", e.to_string()))?;
        let block_stats = PerCpuArray::try_from(take(&mut ebpf, "BLOCK_STATS_MAP")?)
            .map_err(|e| ProbeError::Map("BLOCK_STATS_MAP", e.to_string()))?;
        Ok(Self {
            ebpf,
            status,
            job_map,
            drops,
            bio_hist,
            block_stats,
            tracefs,
            klog: None,
            kmsg: None,
            pending: Vec::new(),
            queued_swept: Default::default(),
            mark_state: Default::default(),
        })
    }
}

/// The BTF path: struct offsets for the `tp_btf` programs, per need, or why not; and the
/// kernel's BTF for the loader.
fn btf_plan(use_btf: bool) -> (BtfOffsets, NeedResult, Option<aya::Btf>) {
    if use_btf {
        return match (btf::Btf::from_sys_fs(), aya::Btf::from_sys_fs()) {
            (Ok(Ok(b)), Ok(kb)) => {
                let (o, ok) = btf_offsets(&b);
                (o, ok, Some(kb))
            }
            (Err(e), _) => (
                BtfOffsets::missing(),
                all_needs(&format!("no kernel BTF: /sys/kernel/btf/vmlinux: {e}")),
                None,
            ),
            (Ok(Err(e)), _) => (
                BtfOffsets::missing(),
                all_needs(&format!("kernel BTF unreadable: {e}")),
                None,
            ),
            (_, Err(e)) => (
                BtfOffsets::missing(),
                all_needs(&format!("kernel BTF unreadable by the loader: {e}")),
                None,
            ),
        };
    }
    // The tracefs programs still read the group's live count at BTF offsets where the exit
    // record has no `group_dead` (before 6.x); no BTF program is used.
    let o = match btf::Btf::from_sys_fs() {
        Ok(Ok(b)) => {
            let (full, _) = btf_offsets(&b);
            BtfOffsets {
                task_signal: full.task_signal,
                signal_live: full.signal_live,
                ..BtfOffsets::missing()
            }
        }
        _ => BtfOffsets::missing(),
    };
    (o, all_needs("NANTRACE_PROBE_PATH=tracefs"), None)
}

/// Load and attach a tracefs program.
fn attach_tracefs(ebpf: &mut Ebpf, program: &str, group: &str, name: &str) -> Result<(), String> {
    let prog: &mut TracePoint = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("program {program} not in the object"))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    prog.load().map_err(|e| verifier_msg(&e))?;
    prog.attach(group, name)
        .map_err(|e| format!("attach: {e}"))?;
    Ok(())
}

/// Load a `tp_btf` program (once).
fn load_btf(ebpf: &mut Ebpf, program: &str, name: &str, kb: &aya::Btf) -> Result<(), String> {
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("program {program} not in the object"))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    if prog.fd().is_err() {
        prog.load(name, kb).map_err(|e| verifier_msg(&e))?;
    }
    Ok(())
}

/// Load and attach a `tp_btf` program.
fn attach_btf(ebpf: &mut Ebpf, program: &str, name: &str, kb: &aya::Btf) -> Result<(), String> {
    load_btf(ebpf, program, name, kb)?;
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(program)
        .ok_or("gone")?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    prog.attach().map_err(|e| format!("attach: {e}"))?;
    Ok(())
}

/// The object being attached, probe by probe, and what each probe did.
struct Attacher {
    ebpf: Ebpf,
    status: Vec<ProbeStatus>,
    btf_ok: NeedResult,
    kernel_btf: Option<aya::Btf>,
    /// Tracepoints the kernel does not have, with why.
    missing: std::collections::BTreeMap<String, String>,
    /// Before 6.x sched_process_exit passes no `group_dead`.
    exit_live: bool,
    /// The benchmark's floor run: the do-nothing programs.
    floors: bool,
    fork_on_btf: bool,
    exit_on_btf: bool,
}

impl Attacher {
    /// The block pair works as a pair: the BTF completion measures what the BTF issue
    /// remembered, and the tracefs one what the tracefs issue did. Both BTF programs must
    /// load before either is used, or both run on tracefs.
    fn load_block_pair(&mut self) {
        let (Some(Ok(())), Some(kb)) = (self.btf_ok.get(&BtfNeeds::Block), &self.kernel_btf) else {
            return;
        };
        let floors = self.floors;
        let pair: Vec<(&str, &str)> = PROBES
            .iter()
            .filter_map(|p| {
                p.btf
                    .filter(|b| b.needs == BtfNeeds::Block)
                    .map(|b| (if floors { b.floor } else { b.program }, p.name))
            })
            .collect();
        for (program, name) in pair {
            if let Err(e) = load_btf(&mut self.ebpf, program, name, kb) {
                self.btf_ok.insert(
                    BtfNeeds::Block,
                    Err(format!(
                        "BTF program {program} refused, so the block pair stays on tracefs: {e}"
                    )),
                );
                break;
            }
        }
    }

    /// One probe: on the BTF path where it can, else on tracefs; its status said.
    fn attach(&mut self, spec: &ProbeSpec) -> Result<(), ProbeError> {
        let floors = self.floors;
        // The BTF fork program tells threads from processes by itself, and the BTF exit
        // program reads the exit status from the task: their helpers are not attached.
        if (spec.program == "task_newtask" && self.fork_on_btf
            || spec.program == "exit_group" && self.exit_on_btf)
            && !floors
        {
            return Ok(());
        }
        let tp = format!("{}:{}", spec.group, spec.name);
        let (done, btf_fallback) = self.try_btf(spec);
        let (program, path, res) = done.unwrap_or_else(|| {
            let program = if floors { spec.floor } else { spec.program };
            let res = match self.missing.get(&tp) {
                Some(why) => Err(why.clone()),
                None => attach_tracefs(&mut self.ebpf, program, spec.group, spec.name),
            };
            (program, ProbePath::Tracefs, res)
        });
        if path == ProbePath::Btf {
            self.fork_on_btf |= spec.program == "sched_fork";
            self.exit_on_btf |= spec.program == "sched_exit";
        }
        // The BTF exit program reads exit statuses from the kernel: from now on the signal
        // programs stop remembering exit causes for the tracefs exit program (set before
        // they attach, so none is remembered and left behind).
        if spec.program == "sched_exit" && path == ProbePath::Btf && res.is_ok() && !floors {
            let m = self
                .ebpf
                .map_mut("SETTINGS")
                .ok_or_else(|| ProbeError::Map("SETTINGS", "missing from the object".into()))?;
            let mut a: aya::maps::Array<&mut MapData, u32> = aya::maps::Array::try_from(m)
                .map_err(|e| ProbeError::Map("SETTINGS", e.to_string()))?;
            a.set(0, 1, 0)
                .map_err(|e| ProbeError::Map("SETTINGS", e.to_string()))?;
        }
        // The benchmark's floor run measures both paths' floors.
        if floors && path == ProbePath::Btf {
            let res = attach_tracefs(&mut self.ebpf, spec.floor, spec.group, spec.name);
            self.status.push(ProbeStatus {
                program: spec.floor,
                tracepoint: tp.clone(),
                path: ProbePath::Tracefs,
                btf_fallback: None,
                attached: res.is_ok(),
                reason: res.err(),
                what: spec.what,
            });
        }
        self.status.push(ProbeStatus {
            program,
            tracepoint: tp,
            path,
            btf_fallback,
            attached: res.is_ok(),
            reason: res.err(),
            what: spec.what,
        });
        Ok(())
    }

    /// The probe's `tp_btf` program attached, or why it stays on tracefs.
    #[expect(clippy::type_complexity, reason = "what attached, or why not")]
    fn try_btf(
        &mut self,
        spec: &ProbeSpec,
    ) -> (
        Option<(&'static str, ProbePath, Result<(), String>)>,
        Option<String>,
    ) {
        let Some(b) = spec.btf else {
            return (None, None);
        };
        // Before 6.x sched_process_exit passes no `group_dead`: the program that reads the
        // group's live count instead.
        let program = if self.floors {
            b.floor
        } else if b.needs == BtfNeeds::Exit && self.exit_live {
            "exit_live_btf"
        } else {
            b.program
        };
        match (
            self.btf_ok
                .get(&b.needs)
                .cloned()
                .unwrap_or_else(|| Err("?".into())),
            &self.kernel_btf,
        ) {
            (Ok(()), Some(kb)) => match attach_btf(&mut self.ebpf, program, spec.name, kb) {
                Ok(()) => (Some((program, ProbePath::Btf, Ok(()))), None),
                Err(e) => (None, Some(format!("BTF program refused: {e}"))),
            },
            (Err(why), _) => (None, Some(why)),
            (Ok(()), None) => (None, Some("no kernel BTF".into())),
        }
    }
}
