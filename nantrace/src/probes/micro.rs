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
    (
        "mc_raw_empty",
        "nothing, raw tracepoint (sys_enter, every syscall)",
    ),
    (
        "mc_btf_empty",
        "nothing, BTF tracepoint (sys_enter, every syscall)",
    ),
    ("mc_pidtgid", "bpf_get_current_pid_tgid"),
    ("mc_ktime", "bpf_ktime_get_ns"),
    ("mc_comm", "bpf_get_current_comm"),
    (
        "mc_pread8",
        "read 8 bytes of the tracepoint record (probe_read)",
    ),
    ("mc_hash_miss", "hash lookup, key absent"),
    ("mc_hash_hit", "hash lookup, key present"),
    ("mc_hash_insdel", "hash insert + delete"),
    (
        "mc_array",
        "array lookup + increment (inlined by the verifier)",
    ),
    (
        "mc_jobmap",
        "job membership test (a byte of JOB_MAP, inlined array lookup)",
    ),
    ("mc_pcpu", "per-CPU array lookup + increment"),
    ("mc_rb_discard", "ring buffer reserve 48 B + discard"),
    ("mc_rb_query", "ring buffer query (bytes waiting)"),
];

/// The whole object with no tracepoint offsets (the benchmark programs read none), `keys`
/// inserted into the hash map `map`; nothing attached.
fn load_seeded(
    map: &'static str,
    keys: &mut dyn Iterator<Item = u32>,
) -> Result<aya::Ebpf, ProbeError> {
    if BPF_OBJ.is_empty() {
        return Err(ProbeError::NotBuilt);
    }
    let cfg = Config {
        slow_io_ns: u64::MAX,
        wake_bytes: u64::MAX,
        whole_machine: 0,
        self_pid: std::process::id(),
        off: TpOffsets::missing(),
        btf: BtfOffsets::missing(),
    };
    let mut ebpf = EbpfLoader::new()
        .override_global("NANTRACE_CONFIG", &cfg, true)
        .load(BPF_OBJ)?;
    let m = ebpf
        .map_mut(map)
        .ok_or_else(|| ProbeError::Map(map, "missing from the object".into()))?;
    let mut h: BpfHashMap<&mut MapData, u32, u32> =
        BpfHashMap::try_from(m).map_err(|e| ProbeError::Map(map, e.to_string()))?;
    for k in keys {
        h.insert(k, 1, 0)
            .map_err(|e| ProbeError::Map(map, e.to_string()))?;
    }
    Ok(ebpf)
}

/// Each of [`MICRO`] alone while `work` runs: (program, runs, ns per run) from the kernel's
/// run statistics (the caller enables `kernel.bpf_stats_enabled`).
pub fn microcost(work: &mut dyn FnMut()) -> Result<Vec<(&'static str, u64, f64)>, ProbeError> {
    let mut ebpf = load_seeded("MC_HASH", &mut std::iter::once(1))?;
    let btf = aya::Btf::from_sys_fs().ok();
    let mut out = Vec::new();
    for &(name, _) in MICRO {
        let Some(prog) = ebpf.program_mut(name) else {
            continue;
        };
        let info = match name {
            "mc_raw_empty" => {
                let p: &mut RawTracePoint = prog
                    .try_into()
                    .map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                p.load()
                    .map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
                let l = p
                    .attach("sys_enter")
                    .map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                work();
                let i = p
                    .info()
                    .map_err(|e| ProbeError::Map("program", e.to_string()))?;
                p.detach(l).ok();
                i
            }
            "mc_btf_empty" => {
                let Some(btf) = &btf else { continue };
                let p: &mut BtfTracePoint = prog
                    .try_into()
                    .map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                p.load("sys_enter", btf)
                    .map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
                let l = p
                    .attach()
                    .map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                work();
                let i = p
                    .info()
                    .map_err(|e| ProbeError::Map("program", e.to_string()))?;
                p.detach(l).ok();
                i
            }
            _ => {
                let p: &mut TracePoint = prog
                    .try_into()
                    .map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                p.load()
                    .map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
                let l = p
                    .attach("syscalls", "sys_enter_getppid")
                    .map_err(|e| ProbeError::Map("program", format!("{name}: {e}")))?;
                work();
                let i = p
                    .info()
                    .map_err(|e| ProbeError::Map("program", e.to_string()))?;
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

/// `bench-internal membership` (`ab_*` in the eBPF crate's `bench.rs`): (tracepoint, the old
/// hash test's program, the `JOB_MAP` byte test's program).
pub const MEMBERSHIP_AB: &[(&str, &str, &str)] = &[
    ("sched:sched_process_exec", "ab_hash_exec", "ab_byte_exec"),
    (
        "syscalls:sys_enter_exit_group",
        "ab_hash_exitg",
        "ab_byte_exitg",
    ),
    (
        "block:block_rq_issue (BTF)",
        "ab_hash_issue",
        "ab_byte_issue",
    ),
];

/// The membership test of a process outside every job, hash vs byte, side by side on the same
/// tracepoints while `work` runs (twice: each order of the pair once, so neither always runs
/// second with the other's cache lines warm). The hash is seeded with `seed` pids that are not
/// the workload's. Returns (program, runs, ns per run).
pub fn membership_ab(
    seed: u32,
    work: &mut dyn FnMut(),
) -> Result<Vec<(&'static str, u64, f64)>, ProbeError> {
    // Pids far above any the workload gets.
    let mut ebpf = load_seeded("AB_HASH", &mut (0..seed).map(|p| 4_000_000 + p))?;
    let btf = aya::Btf::from_sys_fs()
        .map_err(|e| ProbeError::Map("program", format!("kernel BTF: {e}")))?;
    let prog_err =
        |name: &str, e: &dyn std::fmt::Display| ProbeError::Map("program", format!("{name}: {e}"));
    for &(_, h, b) in MEMBERSHIP_AB {
        for name in [h, b] {
            let prog = ebpf
                .program_mut(name)
                .ok_or_else(|| prog_err(name, &"missing from the object"))?;
            if name.ends_with("_issue") {
                let p: &mut BtfTracePoint = prog.try_into().map_err(|e| prog_err(name, &e))?;
                p.load("block_rq_issue", &btf)
                    .map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
            } else {
                let p: &mut TracePoint = prog.try_into().map_err(|e| prog_err(name, &e))?;
                p.load()
                    .map_err(|e| ProbeError::Map("program", verifier_msg(&e)))?;
            }
        }
    }
    for hash_first in [true, false] {
        let mut tp_links = Vec::new();
        let mut btf_links = Vec::new();
        for &(tp, h, b) in MEMBERSHIP_AB {
            for name in if hash_first { [h, b] } else { [b, h] } {
                let prog = ebpf
                    .program_mut(name)
                    .ok_or_else(|| prog_err(name, &"missing from the object"))?;
                if name.ends_with("_issue") {
                    let p: &mut BtfTracePoint = prog.try_into().map_err(|e| prog_err(name, &e))?;
                    btf_links.push((name, p.attach().map_err(|e| prog_err(name, &e))?));
                } else {
                    let (group, tpname) = tp.split_once(':').unwrap_or((tp, tp));
                    let p: &mut TracePoint = prog.try_into().map_err(|e| prog_err(name, &e))?;
                    tp_links.push((
                        name,
                        p.attach(group, tpname).map_err(|e| prog_err(name, &e))?,
                    ));
                }
            }
        }
        work();
        for (name, l) in tp_links {
            if let Some(p) = ebpf
                .program_mut(name)
                .and_then(|p| <&mut TracePoint>::try_from(p).ok())
            {
                p.detach(l).ok();
            }
        }
        for (name, l) in btf_links {
            if let Some(p) = ebpf
                .program_mut(name)
                .and_then(|p| <&mut BtfTracePoint>::try_from(p).ok())
            {
                p.detach(l).ok();
            }
        }
    }
    let mut out = Vec::new();
    for &(_, h, b) in MEMBERSHIP_AB {
        for name in [h, b] {
            let prog = ebpf
                .program(name)
                .ok_or_else(|| prog_err(name, &"missing from the object"))?;
            let info = prog.info().map_err(|e| prog_err(name, &e))?;
            let runs = info.run_count();
            out.push((
                name,
                runs,
                info.run_time().as_nanos() as f64 / runs.max(1) as f64,
            ));
        }
    }
    Ok(out)
}
