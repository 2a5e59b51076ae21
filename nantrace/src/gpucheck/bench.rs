//! What nantrace's GPU sampling costs, for issue 12 on a GPU machine (scripts/gpu-perf.sh):
//! - `bench-internal nvml-cost`: the collector's per-tick NVML work (every query `gpu::read`
//!   makes, the sample's fields, the change detection), back to back, timed in wall and in
//!   this thread's CPU time (the driver's ioctls included);
//! - `bench-internal cuda-steps`: a compute-bound CUDA loop (the check's FP32 FMA-chain
//!   kernel over 1 Mi elements, as a training step's matmuls are compute-bound), timed step
//!   by step, so the same loop alone and under `nantrace run --sample 1` tells whether 1 Hz
//!   sampling slows a running job.
//!
//! Without a driver or a GPU each says so (`available: false` and the reason).
use std::ffi::c_void;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{cuda, BLOCK, KERNELS, N, PTX};

/// Step times of `iters`-long FMA chains on GPU `ordinal` for `seconds`; `available: false`
/// with the reason where there is no driver or GPU.
pub fn cuda_steps(ordinal: i32, seconds: f64, iters: u32) -> Value {
    match steps(ordinal, seconds, iters) {
        Ok(v) => v,
        Err(e) => json!({ "available": false, "error": e }),
    }
}

fn steps(ordinal: i32, seconds: f64, iters: u32) -> Result<Value, String> {
    let cu = cuda::Cuda::load()?;
    let (dev, name, pci) = cu.device(ordinal)?;
    cu.enter(dev)?;
    let r = (|| -> Result<Value, String> {
        let k = cu.load_ptx(PTX, &KERNELS)?;
        let out = cu.alloc(N as usize * 4)?;
        let mut ms = Vec::new();
        let deadline = Instant::now() + Duration::from_secs_f64(seconds.clamp(0.1, 600.0));
        while Instant::now() < deadline {
            let t = Instant::now();
            let (mut p_out, mut p_n, mut p_it, mut p_seed) = (out, N, iters, 0x5eed_u32);
            let mut params: [*mut c_void; 4] = [
                (&mut p_out as *mut u64).cast(),
                (&mut p_n as *mut u32).cast(),
                (&mut p_it as *mut u32).cast(),
                (&mut p_seed as *mut u32).cast(),
            ];
            // SAFETY: fma_f32 takes (ptr, u32 n, u32 iters, u32 seed): params point to those.
            unsafe { cu.launch(k[0], N / BLOCK, BLOCK, &mut params)? };
            cu.sync()?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        cu.free(out);
        Ok(
            json!({ "available": true, "gpu": ordinal, "name": name, "pci": crate::classify::normalize_pci(&pci), "iterations_per_element": iters, "elements": N, "steps": ms.len(), "step_ms": percentiles(&mut ms) }),
        )
    })();
    cu.leave(dev);
    r
}

/// Rounds of the sampler's GPU work over every GPU, back to back for `seconds`.
pub fn nvml_cost(seconds: f64) -> Value {
    use crate::collect::gpu;
    let nvml = match gpu::init() {
        Ok(n) => n,
        Err(e) => return json!({ "available": false, "error": e }),
    };
    let count = nvml.device_count().unwrap_or(0);
    if count == 0 {
        return json!({ "available": false, "error": "NVML found no GPU" });
    }
    let mut prev: Vec<Option<gpu::GpuReading>> = vec![None; count as usize];
    let (mut wall_us, mut cpu_us) = (Vec::new(), Vec::new());
    let mut changes = 0usize;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds.clamp(0.1, 600.0));
    while Instant::now() < deadline {
        let (w0, c0) = (Instant::now(), thread_cpu_ns());
        for i in 0..count {
            let Ok(d) = nvml.device_by_index(i) else {
                continue;
            };
            let r = gpu::read(&d, i);
            std::hint::black_box(gpu::sample_fields(&r));
            if let Some(p) = &prev[i as usize] {
                changes += gpu::changes(p, &r).len();
            }
            prev[i as usize] = Some(r);
        }
        cpu_us.push((thread_cpu_ns() - c0) as f64 / 1e3);
        wall_us.push(w0.elapsed().as_secs_f64() * 1e6);
    }
    let rounds = wall_us.len();
    let cpu = percentiles(&mut cpu_us);
    let per_gpu_cpu_us = cpu["median"].as_f64().unwrap_or(0.0) / f64::from(count);
    json!({
        "available": true, "gpus": count, "rounds": rounds, "changes_seen": changes,
        "round_wall_us": percentiles(&mut wall_us), "round_cpu_us": cpu,
        "cpu_us_per_gpu_per_sample": per_gpu_cpu_us,
        "cpu_s_per_s_per_gpu_at_1hz": per_gpu_cpu_us / 1e6,
    })
}

/// This thread's CPU time, ns.
fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Median, p10, p90, p99, mean and max of `v` (sorted in place); all 0 when empty.
pub fn percentiles(v: &mut [f64]) -> Value {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if v.is_empty() {
            0.0
        } else {
            v[((v.len() - 1) as f64 * q).round() as usize]
        }
    };
    let mean = if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    json!({ "median": at(0.5), "p10": at(0.1), "p90": at(0.9), "p99": at(0.99), "mean": mean, "max": at(1.0) })
}

#[cfg(test)]
mod tests {
    use super::percentiles;

    #[test]
    fn percentiles_of_a_known_series() {
        let mut v: Vec<f64> = (1..=101).rev().map(f64::from).collect();
        let p = percentiles(&mut v);
        assert_eq!(
            (
                p["median"].as_f64(),
                p["p10"].as_f64(),
                p["p99"].as_f64(),
                p["max"].as_f64(),
                p["mean"].as_f64()
            ),
            (Some(51.0), Some(11.0), Some(100.0), Some(101.0), Some(51.0))
        );
        assert_eq!(percentiles(&mut [])["median"].as_f64(), Some(0.0));
    }
}
