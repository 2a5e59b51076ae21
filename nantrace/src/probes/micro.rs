//! `bench-internal microcost`: the building blocks of a probe, each alone in a program.
use aya::maps::{HashMap as BpfHashMap, MapData};
use aya::programs::{BtfTracePoint, RawTracePoint, TracePoint};
use aya::EbpfLoader;
use nantrace_common::{BtfOffsets, Config, TpOffsets};

use super::{verifier_msg, ProbeError, BPF_OBJ};

/// The building blocks measured by `bench-internal microcost` (`mc_*` in the eBPF crate's
/// `bench.rs`): (program, what it does once).
pub const MICRO: &[(&str, &str)] = &[
    ("mc_empty", "nothing (classic tracepoint floor)"),
    ("mc_raw_empty", "nothing, raw tracepoint (sys_enter, every syscall)"),
    ("mc_btf_empty", "nothing, BTF tracepoint (sys_enter, every syscall)"),
    ("mc_pidtgid", "bpf_get_current_pid_tgid"),
    ("mc_ktime", "bpf_ktime_get_ns"),
    ("mc_comm", "bpf_get_current_comm"),
    ("mc_pread8", "read 8 bytes of the tracepoint record (probe_read)"),
    ("mc_hash_miss", "hash lookup, key absent"),
    ("mc_hash_hit", "hash lookup, key present"),
    ("mc_hash_insdel", "hash insert + delete"),
    ("mc_array", "array lookup + increment (inlined by the verifier)"),
    ("mc_jobmap", "job membership test (a byte of JOB_MAP, inlined array lookup)"),
    ("mc_pcpu", "per-CPU array lookup + increment"),
    ("mc_rb_discard", "ring buffer reserve 48 B + discard"),
    ("mc_rb_query", "ring buffer query (bytes waiting)"),
];

/// Each of [`MICRO`] alone while `work` runs: (program, runs, ns per run) from the kernel's
/// run statistics (the caller enables `kernel.bpf_stats_enabled`).
pub fn microcost(work: &mut dyn FnMut()) -> Result<Vec<(&'static str, u64, f64)>, ProbeError> {
    if BPF_OBJ.is_empty() {
        return Err(ProbeError::NotBuilt);
    }
    let cfg = Config { slow_io_ns: u64::MAX, whole_machine: 0, self_pid: std::process::id(), off: TpOffsets::missing(), btf: BtfOffsets::missing() };
    let mut ebpf = EbpfLoader::new().override_global("NANTRACE_CONFIG", &cfg, true).load(BPF_OBJ)?;
    {
        let m = ebpf.map_mut("MC_HASH").ok_or_else(|| ProbeError::Map("MC_HASH", "missing from the object".into()))?;
        let mut h: BpfHashMap<&mut MapData, u32, u32> = BpfHashMap::try_from(m).map_err(|e| ProbeError::Map("MC_HASH", e.to_string()))?;
        h.insert(1, 1, 0).map_err(|e| ProbeError::Map("MC_HASH", e.to_string()))?;
    }
    let btf = aya::Btf::from_sys_fs().ok();
    let mut out = Vec::new();
    for &(name, _) in MICRO {
        let Some(prog) = ebpf.program_mut(name) else { continue };
        let info = match name {
            "mc_raw_empty" => {
                let p: &mut RawTracePoint = prog.try_into().map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                p.load().map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
                let l = p.attach("sys_enter").map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                work();
                let i = p.info().map_err(|e| ProbeError::Map("program", e.to_string()))?;
                p.detach(l).ok();
                i
            }
            "mc_btf_empty" => {
                let Some(btf) = &btf else { continue };
                let p: &mut BtfTracePoint = prog.try_into().map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                p.load("sys_enter", btf).map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
                let l = p.attach().map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                work();
                let i = p.info().map_err(|e| ProbeError::Map("program", e.to_string()))?;
                p.detach(l).ok();
                i
            }
            _ => {
                let p: &mut TracePoint = prog.try_into().map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                p.load().map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
                let l = p.attach("syscalls", "sys_enter_getppid").map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                work();
                let i = p.info().map_err(|e| ProbeError::Map("program", e.to_string()))?;
                p.detach(l).ok();
                i
            }
        };
        let runs = info.run_count();
        let ns = info.run_time().as_nanos() as f64 / runs.max(1) as f64;
        out.push((name, runs, ns));
    }
    Ok(out)
}
