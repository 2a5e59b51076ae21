//! GPU: Xids from the kernel log and NVML (one suspect when both saw it, with NVIDIA's action), fallen off the bus, NVSwitch SXids, NVML changes (ECC, throttling, PCIe replays), crashes inside the GPU libraries.

use serde_json::Value;

use super::{kernel_events, Acc, Ctx};
use crate::report::rules::signal;
use crate::source::Source;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    let nvml_xids: Vec<(f64, &Value)> = ctx.src(Source::NvmlXid).map(|(r, e)| (*r, *e)).collect();
    kernel_lines(ctx, acc, &nvml_xids);
    nvml_events(ctx, acc, &nvml_xids);
    nvml_changes(ctx, acc);
}

/// Whether the GPU at `pci` (or the process an Xid names) is the job's.
fn gpu_of_job(ctx: &Ctx<'_>, pci: &str, pid: Option<u64>) -> bool {
    ctx.job_gpus.contains(pci) || pid.is_some_and(|p| ctx.job_pids.contains(&p))
}

/// The kernel log's Xids (with NVIDIA's action, and NVML's witness when it saw the same),
/// fallen-off-the-bus lines, NVSwitch SXids, crashes of job processes in the GPU libraries.
fn kernel_lines(ctx: &Ctx<'_>, acc: &mut Acc, nvml_xids: &[(f64, &Value)]) {
    for (rel, e) in &kernel_events(ctx) {
        match e["class"].as_str().unwrap_or("") {
            "xid" => {
                let xid = e["xid"].as_u64().unwrap_or(0);
                let pci = e["pci"].as_str().unwrap_or("?");
                let touches = gpu_of_job(ctx, pci, e["xid_pid"].as_u64());
                let maybe_app =
                    crate::classify::xid_maybe_application(u32::try_from(xid).unwrap_or(0));
                let sig = match (xid, e["severity"].as_str().unwrap_or("")) {
                    (79, _) => signal("gpu_fallen_off_bus"),
                    (_, "critical") => signal("xid_critical"),
                    (_, "error" | "warning") if maybe_app => signal("xid_app_possible"),
                    (_, "error") => signal("xid_error"),
                    (_, "warning") => signal("xid_warning"),
                    _ => continue,
                };
                let witnessed = nvml_xids.iter().any(|(r, n)| {
                    n["xid"].as_u64() == Some(xid) && n["pci"] == pci && (r - rel).abs() < 5.0
                });
                acc.add(sig, &format!("{xid}/{pci}"), *rel, touches, || {
                    format!(
                        "Xid {xid} ({}) on {pci}{}{}",
                        e["meaning"].as_str().unwrap_or(""),
                        if touches { ", a GPU of this job" } else { "" },
                        if witnessed {
                            " [two witnesses: kernel log and NVML]"
                        } else {
                            ""
                        }
                    )
                });
                acc.set_action(
                    sig,
                    &format!("{xid}/{pci}"),
                    e["action"].as_str().unwrap_or(""),
                );
                acc.witness(sig, &format!("{xid}/{pci}"), e);
                if let Some((_, n)) = nvml_xids.iter().find(|(r, n)| {
                    n["xid"].as_u64() == Some(xid) && n["pci"] == pci && (r - rel).abs() < 5.0
                }) {
                    acc.witness(sig, &format!("{xid}/{pci}"), n);
                }
            }
            "gpu_fallen_off_bus" => {
                let pci = e["pci"].as_str().unwrap_or("?");
                acc.add(
                    signal("gpu_fallen_off_bus"),
                    &format!("79/{pci}"),
                    *rel,
                    gpu_of_job(ctx, pci, None),
                    || format!("GPU {pci} has fallen off the bus (NVRM, no Xid)"),
                );
                acc.witness(signal("gpu_fallen_off_bus"), &format!("79/{pci}"), e);
            }
            "sxid" => {
                let sx = e["sxid"].as_u64().unwrap_or(0);
                acc.add(signal("sxid"), &sx.to_string(), *rel, false, || {
                    format!("NVSwitch SXid {sx} on {}", e["pci"].as_str().unwrap_or("?"))
                });
                acc.witness(signal("sxid"), &sx.to_string(), e);
            }
            "segfault" => {
                // Only a crash of a job process inside the GPU libraries is worth a line; the
                // comm in these lines is the process's own text and is never matched.
                let victim = e["crashed_pid"].as_u64();
                if e["gpu_library"] == true && victim.is_some_and(|v| ctx.job_pids.contains(&v)) {
                    acc.add(
                        signal("segfault_gpu_library"),
                        e["library"].as_str().unwrap_or("?"),
                        *rel,
                        true,
                        || {
                            format!(
                                "job process {} crashed inside {}",
                                victim.unwrap_or(0),
                                e["library"].as_str().unwrap_or("?")
                            )
                        },
                    );
                }
            }
            _ => {}
        }
    }
}

/// NVML's Xid events: one suspect with the kernel's line when both saw it.
fn nvml_events(ctx: &Ctx<'_>, acc: &mut Acc, nvml_xids: &[(f64, &Value)]) {
    for (rel, n) in nvml_xids {
        let xid = n["xid"].as_u64().unwrap_or(0);
        let pci = n["pci"].as_str().unwrap_or("?");
        let (meaning, sev) = crate::classify::xid_info(xid as u32);
        let key = format!("{xid}/{pci}");
        let seen = acc.out.keys().any(|k| k.ends_with(&key));
        // Informational Xids (43 "GPU stopped processing", 45...) are context, as in the kernel log.
        if !seen && sev != crate::classify::Severity::Info {
            let sig = if xid == 79 {
                signal("gpu_fallen_off_bus")
            } else if sev == crate::classify::Severity::Critical {
                signal("xid_critical")
            } else if crate::classify::xid_maybe_application(xid as u32) {
                signal("xid_app_possible")
            } else {
                signal("xid_error")
            };
            acc.add(sig, &key, *rel, gpu_of_job(ctx, pci, None), || {
                format!("Xid {xid} ({meaning}) on {pci} (NVML event)")
            });
            acc.witness(sig, &key, n);
        }
    }
}

/// NVML's changes between samples: ECC, row remapping, NVLink, PCIe replays, throttling.
fn nvml_changes(ctx: &Ctx<'_>, acc: &mut Acc) {
    for (rel, e) in ctx.src(Source::GpuChange) {
        let c = e["change"].as_str().unwrap_or("");
        let pci = e["pci"].as_str().unwrap_or("?");
        let touches = ctx.job_gpus.contains(pci);
        let sig = if c.contains("row remapping FAILED") {
            signal("gpu_remap_failure")
        } else if c.contains("row remap pending") {
            signal("gpu_remap_pending")
        } else if c.contains("uncorrected ECC") || c.contains("remapped for uncorrectable") {
            signal("ecc_uncorrected")
        } else if c.contains("remapped for correctable") {
            signal("ecc_corrected")
        } else if c.starts_with("NVLink") {
            signal("nvlink_errors")
        } else if c.contains("corrected ECC") {
            signal("ecc_corrected")
        } else if c.contains("PCIe replay") {
            signal("pcie_replay")
        } else if c.contains("started") && (c.starts_with("HW")) {
            signal("gpu_hw_slowdown")
        } else if c.contains("started") || c.contains("temperature") {
            signal("gpu_power_cap")
        } else {
            continue;
        };
        acc.add(sig, c, *rel, touches, || c.to_string());
        acc.witness(sig, c, e);
    }
}
