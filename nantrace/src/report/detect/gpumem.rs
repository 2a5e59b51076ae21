//! Whether a GPU out-of-memory line is a memory limit (issue 24): judged by the numbers the
//! message itself gives (PyTorch's caching allocator says what it tried, the capacity and
//! what the driver had free at the failure) and by what NVML read of that GPU's memory just
//! before. A 20 MiB allocation that fails with 70 GiB free is not the job asking for too much:
//! a GPU or driver fault, memory held by another process or MIG slice, or fragmentation.
use std::sync::LazyLock;

use regex::Regex;

use super::Ctx;
use crate::source::Source;

/// What the line and NVML say: `limit = false` when the memory was there.
pub(super) struct Judgement {
    pub limit: bool,
    pub note: String,
}

/// An NVML reading this close before the line can clear it (a job's memory can grow from a
/// quarter to all of a GPU within one step; closer than that, the message's own numbers are
/// needed).
const NVML_CLEAR_S: f64 = 5.0;
/// A reading this close before can confirm a limit.
const NVML_CONFIRM_S: f64 = 30.0;

static TRIED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)Tried to allocate ([\d.]+) ?([KMGT]i?B|bytes)").unwrap());
static TOTAL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)([\d.]+) ?([KMGT]i?B|bytes) total capacity|total capacity of ([\d.]+) ?([KMGT]i?B|bytes)").unwrap()
});
static ALLOWED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)[\d.]+ ?[KMGT]i?B allowed").unwrap());
static FREE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)([\d.]+) ?([KMGT]i?B|bytes) free\b|of which ([\d.]+) ?([KMGT]i?B|bytes) is free",
    )
    .unwrap()
});

fn mib(c: &regex::Captures<'_>) -> Option<f64> {
    let (n, u) = match (c.get(1), c.get(2), c.get(3), c.get(4)) {
        (Some(n), Some(u), _, _) | (_, _, Some(n), Some(u)) => (n.as_str(), u.as_str()),
        _ => return None,
    };
    let n: f64 = n.parse().ok()?;
    let scale = match u.as_bytes().first().map(u8::to_ascii_uppercase) {
        Some(b'K') => 1.0 / 1024.0,
        Some(b'M') => 1.0,
        Some(b'G') => 1024.0,
        Some(b'T') => 1024.0 * 1024.0,
        _ => 1.0 / (1024.0 * 1024.0),
    };
    Some(n * scale).filter(|v| v.is_finite())
}

fn size(v: f64) -> String {
    if v >= 1024.0 {
        format!("{:.1} GiB", v / 1024.0)
    } else {
        format!("{v:.0} MiB")
    }
}

/// (tried, total, free) in MiB, as far as the message says them.
fn from_message(line: &str) -> (Option<f64>, Option<f64>, Option<f64>) {
    let get = |re: &Regex| re.captures(line).and_then(|c| mib(&c));
    (get(&TRIED), get(&TOTAL), get(&FREE))
}

/// NVML's readings of the job's GPUs in the `NVML_CONFIRM_S` before `rel`: the fullest one
/// (seconds before, PCI address, used MiB, total MiB) and how long before `rel` the latest
/// reading was. None when the job's GPUs are not known (a node's other GPUs say nothing).
fn nvml_before(ctx: &Ctx<'_>, rel: f64) -> Option<((f64, String, f64, f64), f64)> {
    if ctx.job_gpus.is_empty() {
        return None;
    }
    let readings: Vec<(f64, String, f64, f64)> = ctx
        .all(Source::Gpu)
        .filter(|(r, _)| *r <= rel && rel - *r <= NVML_CONFIRM_S)
        .filter_map(|(r, e)| {
            let pci = e["pci"].as_str().filter(|p| ctx.job_gpus.contains(*p))?;
            let used = e["mem_used_mib"].as_f64()?;
            let total = e["mem_total_mib"]
                .as_f64()
                .or_else(|| ctx.gpu_total_mib.get(pci).copied())?;
            Some((rel - *r, pci.to_string(), used, total))
        })
        .filter(|x| x.3 > 0.0 && x.2.is_finite())
        .collect();
    let latest = readings.iter().map(|x| x.0).min_by(f64::total_cmp)?;
    let fullest = readings
        .into_iter()
        .max_by(|a, b| (a.2 / a.3).total_cmp(&(b.2 / b.3)))?;
    Some((fullest, latest))
}

pub(super) fn judge(ctx: &Ctx<'_>, rel: f64, line: &str, nvml_available: bool) -> Judgement {
    let (tried, total, free) = from_message(line);
    let nvml = nvml_before(ctx, rel);
    let witness = nvml.as_ref().map_or_else(
        || {
            if !nvml_available {
                "; no NVML to judge it by (the message alone)".to_string()
            } else if ctx.job_gpus.is_empty() {
                "; NVML does not say which GPUs are the job's".to_string()
            } else {
                "; NVML has no reading of the job's GPU memory in the 30 s before it".to_string()
            }
        },
        |((dt, pci, used, total), _)| {
            format!(
                "; NVML {dt:.1} s before: {} of {} used on {pci}",
                size(*used),
                size(*total)
            )
        },
    );
    // A per-process cap (`set_per_process_memory_fraction`: `... 39.50 GiB allowed; ...`) is
    // a limit the job set, whatever the GPU had free.
    if ALLOWED.is_match(line) {
        return Judgement { limit: true, note: format!("; the job capped its own share of the GPU (\"allowed\" in the message): a memory limit{witness}") };
    }
    if let (Some(tried), Some(free)) = (tried, free) {
        let of = total.map_or(String::new(), |t| format!(" of {}", size(t)));
        return if free >= (4.0 * tried).max(1024.0) {
            Judgement { limit: false, note: format!("; the message itself says {} free{of} for a {} request: not a memory limit (a GPU or driver fault, memory another process or MIG slice holds, or fragmentation){witness}", size(free), size(tried)) }
        } else {
            Judgement {
                limit: true,
                note: format!(
                    "; the message says {} free{of} for a {} request: a memory limit{witness}",
                    size(free),
                    size(tried)
                ),
            }
        };
    }
    // NCCL's own allocations (its buffers at a communicator's setup) are small and made
    // before the step's tensors: NVML's reading just before can clear them. A framework's
    // allocation without numbers cannot be cleared that way (a step can fill a GPU between
    // two readings).
    let nccl = line.contains("NCCL") || line.contains("nccl");
    match nvml {
        Some(((_, pci, used, total), latest)) if nccl && latest <= NVML_CLEAR_S && used < 0.25 * total => Judgement {
            limit: false,
            note: format!("; NVML {latest:.1} s before: the job's GPUs at most {} of {} used ({pci}), and NCCL's allocations are small: a memory limit is unlikely (a GPU or driver fault, or memory another process holds)", size(used), size(total)),
        },
        Some(((_, _, used, total), _)) if used >= 0.9 * total => Judgement { limit: true, note: format!("{witness}: a memory limit") },
        _ => Judgement { limit: true, note: witness },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_numbers_are_read_in_both_pytorch_shapes() {
        let old = "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total capacity; 1.02 GiB already allocated; 77.50 GiB free; 1.10 GiB reserved in total by PyTorch)";
        let (t, c, f) = from_message(old);
        assert_eq!(
            (t, c.map(|c| c.round()), f),
            (Some(20.0), Some(81050.0), Some(77.5 * 1024.0))
        );
        let new = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 512.00 KiB is free. Process 4242 has 79.14 GiB memory in use.";
        let (t, _, f) = from_message(new);
        assert_eq!((t, f), (Some(2048.0), Some(0.5)));
        assert_eq!(
            from_message("NCCL WARN Cuda failure 'out of memory'"),
            (None, None, None)
        );
    }

    use crate::report::tests::{job_line, Scenario};
    use serde_json::json;

    fn gpu(t: f64, used_mib: u64) -> serde_json::Value {
        json!({ "offset_s": t, "source": "gpu", "gpu": 0, "pci": "0000:3b:00.0", "mem_used_mib": used_mib, "mem_total_mib": 81_559 })
    }

    const NCCL_OOM: &str =
        "node7:311:402 [0] enqueue.cc:1180 NCCL WARN Cuda failure 'out of memory'";

    #[test]
    fn a_small_request_failing_with_most_of_the_gpu_free_is_not_a_memory_limit() {
        let a = Scenario::healthy().with(job_line(-3.0, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.65 GiB of which 71.20 GiB is free. Including non-PyTorch memory, this process has 8.44 GiB memory in use.")).analyze();
        assert!(
            a.verdict.starts_with(
                "POSSIBLY THE MACHINE (GPU, or the job's own code), in the job's own words only"
            ),
            "{}",
            a.verdict
        );
        assert!(a.verdict.contains("the message itself says 71.2 GiB free of 79.7 GiB for a 20 MiB request: not a memory limit"), "{}", a.verdict);
        assert!(
            a.verdict
                .contains("NVML has no reading of the job's GPU memory"),
            "{}",
            a.verdict
        );
        assert!(a.verdict.contains("job output: GPU memory allocation failed (cudaErrorMemoryAllocation (2)); the message itself") && !a.verdict.contains("a resource limit"), "{}", a.verdict);
    }

    #[test]
    fn the_message_saying_almost_nothing_is_free_is_a_memory_limit() {
        let a = Scenario::healthy().with(gpu(-4.0, 81_000)).with(job_line(-3.0, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.65 GiB of which 512.00 KiB is free.")).analyze();
        assert!(
            a.verdict.starts_with("NOT THE MACHINE (GPU memory limit)"),
            "{}",
            a.verdict
        );
        assert!(
            a.verdict.contains(
                "a memory limit; NVML 1.0 s before: 79.1 GiB of 79.6 GiB used on 0000:3b:00.0"
            ),
            "{}",
            a.verdict
        );
    }

    #[test]
    fn nccl_out_of_memory_on_an_empty_gpu_is_not_a_memory_limit_but_on_a_full_one_is() {
        // The first collective of a fresh process (NCCL's buffers), NVML read 1 s before.
        let a = Scenario::healthy()
            .with(gpu(-4.0, 900))
            .with(job_line(-3.0, NCCL_OOM))
            .analyze();
        assert!(
            a.verdict
                .starts_with("POSSIBLY THE MACHINE (GPU, or the job's own code)"),
            "{}",
            a.verdict
        );
        assert!(a.verdict.contains("NVML 1.0 s before: the job's GPUs at most 900 MiB of 79.6 GiB used (0000:3b:00.0), and NCCL's allocations are small: a memory limit is unlikely"), "{}", a.verdict);
        let b = Scenario::healthy()
            .with(gpu(-4.0, 80_100))
            .with(job_line(-3.0, NCCL_OOM))
            .analyze();
        assert!(
            b.verdict.starts_with("NOT THE MACHINE (GPU memory limit)"),
            "{}",
            b.verdict
        );
        assert!(
            b.verdict
                .contains("78.2 GiB of 79.6 GiB used on 0000:3b:00.0: a memory limit"),
            "{}",
            b.verdict
        );
        // A low reading long before says nothing: memory grows within a step.
        let c = Scenario::healthy()
            .with(gpu(-25.0, 900))
            .with(job_line(-3.0, NCCL_OOM))
            .analyze();
        assert!(
            c.verdict.starts_with("NOT THE MACHINE (GPU memory limit)"),
            "{}",
            c.verdict
        );
        // A framework's OOM without numbers is not cleared by a low reading (a step fills a
        // GPU between two readings), nor one that names a per-process cap.
        let e = Scenario::healthy()
            .with(gpu(-4.0, 900))
            .with(job_line(
                -3.0,
                "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
            ))
            .analyze();
        assert!(
            e.verdict.starts_with("NOT THE MACHINE (GPU memory limit)"),
            "{}",
            e.verdict
        );
        let f = Scenario::healthy().with(job_line(-3.0, "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 38.00 GiB already allocated; 40.10 GiB free; 39.50 GiB allowed; 38.20 GiB reserved in total by PyTorch)")).analyze();
        assert!(
            f.verdict.starts_with("NOT THE MACHINE (GPU memory limit)")
                && f.verdict.contains("capped its own share"),
            "{}",
            f.verdict
        );
        // Without NVML, it says so.
        let mut d = Scenario::healthy().with(job_line(-3.0, NCCL_OOM));
        d.snapshot =
            json!({ "gpu": { "available": false, "reason": "libnvidia-ml.so.1 not found" } });
        let d = d.analyze();
        assert!(
            d.verdict.starts_with("NOT THE MACHINE (GPU memory limit)")
                && d.verdict.contains("no NVML to judge it by"),
            "{}",
            d.verdict
        );
    }
}
