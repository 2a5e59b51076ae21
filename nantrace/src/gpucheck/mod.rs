//! `nantrace gpucheck`: is a GPU silently computing wrong results? The same deterministic
//! computation on every GPU, repeated, compared bit for bit across repetitions and across GPUs
//! of the same model; a memory test with write/read-back patterns; NVML before and after.
//!
//! Compute: each thread iterates the logistic map a <- 3.9·a·(1−a) with fused multiply-adds
//! (FP32, FP16, BF16; kernels in `data/gpucheck.ll`, compiled to PTX that the driver JITs), from
//! a seeded start. The map is chaotic: one wrong bit anywhere changes the final value, and with
//! no reductions or atomics the result is bit-exact run to run. Memory: address-in-address,
//! walking ones and seeded random patterns over a share of free memory, checked on the GPU.
//! Schema `nantrace.gpucheck/1`, in docs/gpu-check.md.
pub mod bench;
pub mod cuda;

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::time::Instant;

use serde_json::{json, Value};

use crate::report::gpucheck::findings;

pub use crate::bundle::GPUCHECK_SCHEMA as SCHEMA;
const PTX: &str = include_str!("../../data/gpucheck.ptx");
const KERNELS: [&str; 5] = ["fma_f32", "fma_f16", "fma_bf16", "mem_fill", "mem_check"];
/// Threads (and result elements) per compute run.
const N: u32 = 1 << 20;
const BLOCK: u32 = 256;

#[derive(Clone, Debug)]
pub struct Opts {
    /// CUDA ordinals to test (None: all visible).
    pub gpus: Option<Vec<u32>>,
    /// Repetitions per precision.
    pub reps: u32,
    /// Map iterations per thread per repetition.
    pub iters: u32,
    /// Share of free GPU memory the memory test covers.
    pub mem_fraction: f64,
    /// Test-only: flip one bit of this GPU's FP32 result of repetition 1 after the kernel ran
    /// (proves a disagreement is detected and named).
    pub corrupt: Option<u32>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            gpus: None,
            reps: 10,
            iters: 2_000_000,
            mem_fraction: 0.25,
            corrupt: None,
        }
    }
}

/// Where two result buffers first differ.
#[derive(Clone, Debug, PartialEq)]
pub struct Diff {
    pub first_index: usize,
    pub differing: usize,
    pub want_bits: u32,
    pub got_bits: u32,
}

/// Compare two result buffers of `width`-byte elements bit for bit.
pub fn diff(want: &[u8], got: &[u8], width: usize) -> Option<Diff> {
    let mut out: Option<Diff> = None;
    for (i, (a, b)) in want.chunks(width).zip(got.chunks(width)).enumerate() {
        if a != b {
            let bits = |x: &[u8]| {
                x.iter()
                    .rev()
                    .fold(0u32, |acc, v| (acc << 8) | u32::from(*v))
            };
            match &mut out {
                Some(d) => d.differing += 1,
                None => {
                    out = Some(Diff {
                        first_index: i,
                        differing: 1,
                        want_bits: bits(a),
                        got_bits: bits(b),
                    })
                }
            }
        }
    }
    if want.len() != got.len() && out.is_none() {
        out = Some(Diff {
            first_index: want.len().min(got.len()) / width,
            differing: 1,
            want_bits: 0,
            got_bits: 0,
        });
    }
    out
}

/// FNV-1a, 64 bits: a short fingerprint of a result buffer.
pub fn fingerprint(b: &[u8]) -> String {
    let h = b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(*x)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// One GPU's check, run on its own thread with its own context.
fn check_gpu(cu: &cuda::Cuda, ordinal: u32, o: &Opts) -> Value {
    let t0 = Instant::now();
    let (dev, name, pci) = match cu.device(i32::try_from(ordinal).unwrap_or(i32::MAX)) {
        Ok(d) => d,
        Err(e) => return json!({ "index": ordinal, "error": e }),
    };
    let mut g =
        json!({ "index": ordinal, "name": name, "pci": crate::classify::normalize_pci(&pci) });
    if let Err(e) = cu.enter(dev) {
        g["error"] = json!(e);
        return g;
    }
    let r = (|| -> Result<(), String> {
        let k = cu.load_ptx(PTX, &KERNELS)?;
        let mut compute = serde_json::Map::new();
        for (pi, (prec, width)) in [("fp32", 4usize), ("fp16", 2), ("bf16", 2)]
            .into_iter()
            .enumerate()
        {
            let t = Instant::now();
            let bytes = N as usize * width;
            let out = cu.alloc(bytes)?;
            let mut reference: Option<Vec<u8>> = None;
            let mut mismatches = Vec::new();
            let mut host = vec![0u8; bytes];
            for rep in 0..o.reps.max(1) {
                cu.to_device(out, &vec![0u8; bytes])?;
                let (mut p_out, mut p_n, mut p_it, mut p_seed) = (out, N, o.iters, 0x5eed_u32);
                let mut params: [*mut c_void; 4] = [
                    (&mut p_out as *mut u64).cast(),
                    (&mut p_n as *mut u32).cast(),
                    (&mut p_it as *mut u32).cast(),
                    (&mut p_seed as *mut u32).cast(),
                ];
                // SAFETY: fma_* take (ptr, u32 n, u32 iters, u32 seed): params point to those.
                unsafe { cu.launch(k[pi], N / BLOCK, BLOCK, &mut params)? };
                cu.sync()?;
                cu.to_host(&mut host, out)?;
                if o.corrupt == Some(ordinal) && prec == "fp32" && rep == 1 {
                    // Test-only: one flipped bit in one element after the kernel ran.
                    host[4 * 12_345] ^= 0x01;
                }
                match &reference {
                    None => reference = Some(host.clone()),
                    Some(want) => {
                        if let Some(d) = diff(want, &host, width) {
                            mismatches.push(json!({ "rep": rep, "first_index": d.first_index, "differing_elements": d.differing, "want_bits": format!("{:#x}", d.want_bits), "got_bits": format!("{:#x}", d.got_bits) }));
                        }
                    }
                }
            }
            cu.free(out);
            let reference = reference.unwrap_or_default();
            compute.insert(
                prec.to_string(),
                json!({ "reps": o.reps.max(1), "elements": N, "iterations": o.iters, "fingerprint": fingerprint(&reference), "mismatching_reps": mismatches, "seconds": t.elapsed().as_secs_f64(), "reference_sample_bits": reference.chunks(width).take(4).map(|c| c.iter().rev().fold(0u32, |a, v| (a << 8) | u32::from(*v))).collect::<Vec<_>>() }),
            );
        }
        g["compute"] = Value::Object(compute);
        // Memory: a share of free memory, three patterns, checked on the GPU.
        let t = Instant::now();
        let (free, total) = cu.mem_info()?;
        let words = ((free as f64 * o.mem_fraction.clamp(0.0, 0.9)) as usize / 4).max(1 << 20);
        let buf = cu.alloc(words * 4)?;
        let counters = cu.alloc(16)?;
        let mut patterns = Vec::new();
        for kind in 0u32..3 {
            let (mut p_buf, mut p_n, mut p_kind, mut p_seed) =
                (buf, words as u64, kind, 0x1234_5678u32 ^ kind);
            let mut fill: [*mut c_void; 4] = [
                (&mut p_buf as *mut u64).cast(),
                (&mut p_n as *mut u64).cast(),
                (&mut p_kind as *mut u32).cast(),
                (&mut p_seed as *mut u32).cast(),
            ];
            // SAFETY: mem_fill takes (ptr, u64 n, u32 kind, u32 seed): params point to those.
            unsafe { cu.launch(k[3], 4096, BLOCK, &mut fill)? };
            cu.sync()?;
            let init: [u64; 2] = [0, u64::MAX];
            cu.to_device(
                counters,
                &init
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            )?;
            let (mut p_errs, mut p_first) = (counters, counters + 8);
            let mut check: [*mut c_void; 6] = [
                (&mut p_buf as *mut u64).cast(),
                (&mut p_n as *mut u64).cast(),
                (&mut p_kind as *mut u32).cast(),
                (&mut p_seed as *mut u32).cast(),
                (&mut p_errs as *mut u64).cast(),
                (&mut p_first as *mut u64).cast(),
            ];
            // SAFETY: mem_check takes (ptr, u64, u32, u32, ptr errs, ptr first): params point to those.
            unsafe { cu.launch(k[4], 4096, BLOCK, &mut check)? };
            cu.sync()?;
            let mut c = [0u8; 16];
            cu.to_host(&mut c, counters)?;
            let errs = u64::from_le_bytes(c[..8].try_into().unwrap_or_default());
            let first = u64::from_le_bytes(c[8..].try_into().unwrap_or_default());
            let pname = ["address", "walking_ones", "random"][kind as usize];
            patterns.push(json!({ "pattern": pname, "errors": errs, "first_bad_word": if errs > 0 { json!(first) } else { Value::Null } }));
        }
        cu.free(counters);
        cu.free(buf);
        g["memory"] = json!({ "bytes_tested": words * 4, "free_bytes": free, "total_bytes": total, "patterns": patterns, "seconds": t.elapsed().as_secs_f64() });
        Ok(())
    })();
    if let Err(e) = r {
        g["error"] = json!(e);
    }
    cu.leave(dev);
    g["seconds"] = json!(t0.elapsed().as_secs_f64());
    g
}

/// What NVML says of a GPU before the check: MIG mode, and the processes computing on it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuState {
    pub mig: bool,
    /// (pid, name) of each process with a compute context on the GPU.
    pub holders: Vec<(u32, String)>,
}

/// Why GPU `s` is not checked, if it is not: MIG mode is on (the check tests whole GPUs), or
/// another process computes on it (a job that still runs: nantrace does not compete with it,
/// and the comparison would measure the contention). `me`: our own pid, not a holder.
/// `instances`: CUDA_VISIBLE_DEVICES names MIG instances, so CUDA's devices are those
/// instances, isolated from the others: a MIG GPU is checked, whoever computes on its other
/// instances (NVML's process list of a MIG GPU covers all of them).
pub fn skip_reason(s: &GpuState, me: u32, instances: bool) -> Option<String> {
    if s.mig {
        return (!instances).then(|| "MIG mode is on: the check tests whole GPUs; check each instance with CUDA_VISIBLE_DEVICES=MIG-<uuid> nantrace gpucheck".into());
    }
    let others: Vec<String> = s
        .holders
        .iter()
        .filter(|(pid, _)| *pid != me)
        .map(|(pid, name)| format!("{name} {pid}"))
        .collect();
    if others.is_empty() {
        return None;
    }
    Some(format!(
        "busy: {} compute(s) on it; not checked while another process uses the GPU",
        others.join(", ")
    ))
}

/// Each GPU's state from NVML, by normalized PCI address; empty without NVML (the check then
/// runs on every GPU CUDA shows, as before).
fn nvml_states() -> BTreeMap<String, GpuState> {
    let mut out = BTreeMap::new();
    let Ok(nvml) = crate::collect::gpu::init() else {
        return out;
    };
    for i in 0..nvml.device_count().unwrap_or(0) {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let Ok(pci) = d.pci_info() else { continue };
        // NotSupported (a GPU without MIG) reads as off.
        let mig = d.mig_mode().is_ok_and(|m| m.current == 1);
        let holders = d
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                (
                    p.pid,
                    std::fs::read_to_string(format!("/proc/{}/comm", p.pid))
                        .map_or_else(|_| "?".to_string(), |c| c.trim().to_string()),
                )
            })
            .collect();
        out.insert(
            crate::classify::normalize_pci(&pci.bus_id),
            GpuState { mig, holders },
        );
    }
    out
}

/// The exit code of `nantrace gpucheck`: 1 when a GPU disagreed or had memory errors; else 2
/// when the check could not run or left a GPU out (busy, MIG, an error); else 0.
pub fn exit_code(v: &Value) -> i32 {
    let f = findings(v);
    let unchecked = |x: &String| {
        x.contains(" not checked: ")
            || x.contains("did not complete")
            || x.starts_with("the check could not run")
    };
    if f.iter().any(|x| !unchecked(x)) {
        1
    } else if v["error"].is_string() || !f.is_empty() {
        2
    } else {
        0
    }
}

/// Run the check on every selected GPU in parallel; gpucheck.json's value.
pub fn run(o: &Opts) -> Value {
    let started = crate::clock::rfc3339(
        crate::clock::ClockMap::sample().to_wall(crate::clock::monotonic_ns()),
    );
    let cu = match cuda::Cuda::load() {
        Ok(c) => c,
        Err(e) => return json!({ "schema": SCHEMA, "started": started, "error": e, "gpus": [] }),
    };
    let count = match cu.device_count() {
        Ok(n) => u32::try_from(n).unwrap_or(0),
        Err(e) => return json!({ "schema": SCHEMA, "started": started, "error": e, "gpus": [] }),
    };
    if count == 0 {
        return json!({ "schema": SCHEMA, "started": started, "error": "no CUDA device visible", "gpus": [] });
    }
    let ordinals: Vec<u32> = o
        .gpus
        .clone()
        .unwrap_or_else(|| (0..count).collect())
        .into_iter()
        .filter(|g| *g < count)
        .collect();
    let nvml_before = crate::collect::gpu::snapshot();
    // Busy GPUs and MIG are said, not checked (matched to CUDA's devices by PCI address).
    let states = nvml_states();
    let me = std::process::id();
    let instances = std::env::var("CUDA_VISIBLE_DEVICES").is_ok_and(|v| v.contains("MIG-"));
    let skipped: BTreeMap<u32, Value> = ordinals
        .iter()
        .filter_map(|&g| {
            let (_, name, pci) = cu.device(i32::try_from(g).ok()?).ok()?;
            let pci = crate::classify::normalize_pci(&pci);
            let why = skip_reason(states.get(&pci)?, me, instances)?;
            Some((
                g,
                json!({ "index": g, "name": name, "pci": pci, "skipped": why }),
            ))
        })
        .collect();
    let mut gpus: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = ordinals
            .iter()
            .filter(|g| !skipped.contains_key(g))
            .map(|&g| {
                s.spawn({
                    let cu = &cu;
                    move || check_gpu(cu, g, o)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| json!({ "error": "the check's thread panicked" }))
            })
            .collect()
    });
    gpus.extend(skipped.into_values());
    gpus.sort_by_key(|g| g["index"].as_u64().unwrap_or(u64::MAX));
    let nvml_after = crate::collect::gpu::snapshot();
    let mut v = json!({ "schema": SCHEMA, "started": started, "options": { "reps": o.reps, "iterations": o.iters, "mem_fraction": o.mem_fraction, "corrupt_test": o.corrupt }, "gpus": gpus, "nvml_before": nvml_before, "nvml_after": nvml_after });
    v["findings"] = json!(findings(&v));
    v
}

/// Write gpucheck.json into a bundle (a directory that is ours alone, replaced by rename) and
/// render the bundle's report again so its verdict reads the check.
pub fn into_bundle(dir: &std::path::Path, v: &Value) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let d = crate::safefs::Dir::open_private(dir).with_context(|| format!("{}", dir.display()))?;
    d.replace("gpucheck.json", &serde_json::to_vec_pretty(v)?)
        .context("writing gpucheck.json")?;
    let (a, t, snap) = crate::report::for_bundle(dir)?;
    for (name, data) in crate::export::derived(&t, &snap).run().1 {
        d.replace(name, &data)
            .with_context(|| format!("writing {name}"))?;
    }
    let _ = a;
    Ok(())
}

/// The human summary.
pub fn summary(v: &Value) -> String {
    let mut s = String::new();
    for g in v["gpus"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "GPU {} {} ({}): ",
            g["index"],
            g["name"].as_str().unwrap_or("?"),
            g["pci"].as_str().unwrap_or("?")
        ));
        let c = &g["compute"];
        for p in ["fp32", "fp16", "bf16"] {
            if c[p].is_object() {
                s.push_str(&format!(
                    "{p} {} runs {} ({:.1} s), ",
                    c[p]["reps"],
                    if c[p]["mismatching_reps"]
                        .as_array()
                        .is_some_and(Vec::is_empty)
                    {
                        "identical"
                    } else {
                        "DIFFER"
                    },
                    c[p]["seconds"].as_f64().unwrap_or(0.0)
                ));
            }
        }
        if let Some(m) = g["memory"].as_object() {
            let errs: u64 = m["patterns"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["errors"].as_u64())
                .sum();
            s.push_str(&format!(
                "memory {:.1} GiB x 3 patterns: {errs} errors ({:.1} s)",
                m["bytes_tested"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 30),
                m["seconds"].as_f64().unwrap_or(0.0)
            ));
        }
        s.push('\n');
    }
    let f = findings(v);
    if f.is_empty() {
        s.push_str("gpucheck: every GPU computed bit-identical results run to run (and to its peers), no memory errors\n");
    } else {
        for x in f {
            s.push_str(&format!("gpucheck: {x}\n"));
        }
    }
    s
}

/// After a job has exited (its GPUs free): each NaN bundle without hardware evidence gets a
/// silent-data-corruption check of the GPUs (run once for all), added to it as gpucheck.json.
/// Used by `run --gpucheck` and by the agent.
pub fn after_nan(bundles: &[std::path::PathBuf]) {
    if bundles.is_empty() {
        return;
    }
    // No driver, nothing to check: said once, and no bundle is read again (reading a full
    // window's bundle to decide costs a dump's memory: the agent's flood test saw its peak
    // depend on whether this ran before it was measured).
    if let Err(e) = cuda::Cuda::load() {
        crate::say!("nantrace: no GPU check after the NaN: {e}");
        return;
    }
    let mut result: Option<serde_json::Value> = None;
    for b in bundles {
        let Ok((a, t, _)) = crate::report::for_bundle(b) else {
            continue;
        };
        if t["first_nan"].is_null() || a.machine {
            continue;
        }
        let v = result.get_or_insert_with(|| {
            crate::say!("nantrace: NaN without hardware evidence: checking the GPUs for silent data corruption (nantrace gpucheck)");
            run(&Opts::default())
        });
        crate::say!("{}", crate::term::clean_lines(summary(v).trim_end()));
        match into_bundle(b, v) {
            Ok(()) => crate::say!("nantrace: gpucheck.json added to {}", b.display()),
            Err(e) => crate::say!(
                "nantrace: WARNING: could not add gpucheck.json to {}: {e:#}",
                b.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests;
