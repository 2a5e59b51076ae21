//! GPU health through NVML (nvml-wrapper): periodic readings, changes as events (throttling
//! started, ECC counts up, PCIe replays), NVML's own Xid events, and a snapshot with what
//! `nvidia-smi -q -d ECC,POWER,TEMPERATURE,UTILIZATION` and the retired-pages query show.
//!
//! NVML calls take a driver lock: readings are never taken faster than once a second, and the
//! process list (milliseconds per call) only at the snapshot. Without NVML everything else
//! works and the bundle says "NVML unavailable: <reason>".
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, TemperatureSensor, TemperatureThreshold,
};
use nvml_wrapper::{Device, Nvml};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::classify::normalize_pci;

/// One reading of one GPU, in the units NVML returns (mW, MHz, %, bytes, counts).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuReading {
    pub index: u32,
    pub pci: String,
    pub temp_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub enforced_limit_mw: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    /// nvmlClocksThrottleReasons bitmask.
    pub throttle_mask: Option<u64>,
    pub util_gpu_pct: Option<u32>,
    pub util_mem_pct: Option<u32>,
    pub mem_used_bytes: Option<u64>,
    pub mem_total_bytes: Option<u64>,
    pub ecc_corrected_volatile: Option<u64>,
    pub ecc_uncorrected_volatile: Option<u64>,
    pub pcie_replay: Option<u32>,
    pub slowdown_temp_c: Option<u32>,
    /// Row remapping (A100/H100/H200): rows remapped for correctable and uncorrectable errors,
    /// a remap pending a GPU reset, a remap that failed.
    pub remap: Option<Remap>,
    /// NVLink errors summed over the active links: CRC (flit + data), replay, recovery.
    pub nvlink: Option<[u64; 3]>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remap {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: bool,
    pub failed: bool,
}

/// Names of the bits of nvmlClocksThrottleReasons.
pub fn throttle_names(mask: u64) -> Vec<&'static str> {
    const BITS: &[(u64, &str)] = &[
        (0x1, "gpu_idle"),
        (0x2, "applications_clocks_setting"),
        (0x4, "sw_power_cap"),
        (0x8, "hw_slowdown"),
        (0x10, "sync_boost"),
        (0x20, "sw_thermal_slowdown"),
        (0x40, "hw_thermal_slowdown"),
        (0x80, "hw_power_brake_slowdown"),
        (0x100, "display_clock_setting"),
    ];
    BITS.iter()
        .filter(|(b, _)| mask & b != 0)
        .map(|(_, n)| *n)
        .collect()
}

/// The fields of a `gpu` sample event.
pub fn sample_fields(r: &GpuReading) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("gpu".into(), json!(r.index));
    m.insert("pci".into(), json!(r.pci));
    let mut put = |k: &str, v: Value| {
        if !v.is_null() {
            m.insert(k.into(), v);
        }
    };
    put("temp_c", json!(r.temp_c));
    put("power_w", json!(r.power_mw.map(|p| f64::from(p) / 1000.0)));
    put(
        "power_limit_w",
        json!(r.enforced_limit_mw.map(|p| f64::from(p) / 1000.0)),
    );
    put("sm_clock_mhz", json!(r.sm_clock_mhz));
    put("mem_clock_mhz", json!(r.mem_clock_mhz));
    put(
        "throttle",
        json!(r.throttle_mask.map(|t| throttle_names(t)
            .into_iter()
            .filter(|n| *n != "gpu_idle")
            .collect::<Vec<_>>())),
    );
    put("util_gpu_pct", json!(r.util_gpu_pct));
    put("util_mem_pct", json!(r.util_mem_pct));
    put("mem_used_mib", json!(r.mem_used_bytes.map(|b| b >> 20)));
    put("mem_total_mib", json!(r.mem_total_bytes.map(|b| b >> 20)));
    put("ecc_corrected_volatile", json!(r.ecc_corrected_volatile));
    put(
        "ecc_uncorrected_volatile",
        json!(r.ecc_uncorrected_volatile),
    );
    put("pcie_replay", json!(r.pcie_replay));
    m
}

/// Changes worth an event between two readings of the same GPU.
pub fn changes(prev: &GpuReading, cur: &GpuReading) -> Vec<String> {
    let mut out = Vec::new();
    let g = format!("GPU {} ({})", cur.index, cur.pci);
    if let (Some(a), Some(b)) = (prev.throttle_mask, cur.throttle_mask) {
        for (bit, what) in [
            (0x8u64, "HW slowdown"),
            (0x40, "HW thermal slowdown"),
            (0x20, "SW thermal slowdown"),
            (0x80, "HW power brake slowdown"),
            (0x4, "SW power cap throttling"),
        ] {
            if a & bit == 0 && b & bit != 0 {
                out.push(format!("{what} started on {g}"));
            } else if a & bit != 0 && b & bit == 0 {
                out.push(format!("{what} ended on {g}"));
            }
        }
    }
    let up = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) if b > a => Some(b - a),
        _ => None,
    };
    if let Some(d) = up(prev.ecc_uncorrected_volatile, cur.ecc_uncorrected_volatile) {
        out.push(format!("uncorrected ECC +{d} on {g}"));
    }
    if let Some(d) = up(prev.ecc_corrected_volatile, cur.ecc_corrected_volatile) {
        out.push(format!("corrected ECC +{d} on {g}"));
    }
    if let Some(d) = up(
        prev.pcie_replay.map(u64::from),
        cur.pcie_replay.map(u64::from),
    ) {
        out.push(format!("PCIe replay counter +{d} on {g}"));
    }
    // Row remapping and NVLink counters, sampled with the rest (review of issue 13: the
    // snapshot alone saw them only at the trigger).
    if let (Some(a), Some(b)) = (prev.remap, cur.remap) {
        if b.uncorrectable > a.uncorrectable {
            out.push(format!(
                "row remapping: {} more row(s) remapped for uncorrectable errors on {g}",
                b.uncorrectable - a.uncorrectable
            ));
        }
        if b.correctable > a.correctable {
            out.push(format!(
                "row remapping: {} more row(s) remapped for correctable errors on {g}",
                b.correctable - a.correctable
            ));
        }
        if b.pending && !a.pending {
            out.push(format!("row remap pending (needs a GPU reset) on {g}"));
        }
        if b.failed && !a.failed {
            out.push(format!("row remapping FAILED on {g}"));
        }
    }
    if let (Some(a), Some(b)) = (prev.nvlink, cur.nvlink) {
        for (i, what) in ["NVLink CRC errors", "NVLink replays", "NVLink recoveries"]
            .iter()
            .enumerate()
        {
            if b[i] > a[i] {
                out.push(format!("{what} +{} on {g}", b[i] - a[i]));
            }
        }
    }
    if let (Some(t0), Some(t1), Some(slow)) = (prev.temp_c, cur.temp_c, cur.slowdown_temp_c) {
        if t0 + 5 < slow && t1 + 5 >= slow {
            out.push(format!(
                "temperature {t1} C within 5 C of the slowdown threshold {slow} C on {g}"
            ));
        }
    }
    out
}

pub fn read(dev: &Device, index: u32) -> GpuReading {
    GpuReading {
        index,
        pci: dev
            .pci_info()
            .map(|p| normalize_pci(&p.bus_id))
            .unwrap_or_default(),
        temp_c: dev.temperature(TemperatureSensor::Gpu).ok(),
        power_mw: dev.power_usage().ok(),
        enforced_limit_mw: dev.enforced_power_limit().ok(),
        sm_clock_mhz: dev.clock_info(Clock::SM).ok(),
        mem_clock_mhz: dev.clock_info(Clock::Memory).ok(),
        throttle_mask: dev.current_throttle_reasons().ok().map(|t| t.bits()),
        util_gpu_pct: dev.utilization_rates().ok().map(|u| u.gpu),
        util_mem_pct: dev.utilization_rates().ok().map(|u| u.memory),
        mem_used_bytes: dev.memory_info().ok().map(|m| m.used),
        mem_total_bytes: dev.memory_info().ok().map(|m| m.total),
        ecc_corrected_volatile: dev
            .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
            .ok(),
        ecc_uncorrected_volatile: dev
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok(),
        pcie_replay: dev.pcie_replay_counter().ok(),
        slowdown_temp_c: dev
            .temperature_threshold(TemperatureThreshold::Slowdown)
            .ok(),
        remap: remap_of(&remapped_rows(dev)),
        nvlink: nvlink_totals(&nvlink_errors(dev)),
    }
}

/// The row-remapping counters of [`remapped_rows`]' answer, when it had them.
pub fn remap_of(v: &Value) -> Option<Remap> {
    Some(Remap {
        correctable: u32::try_from(v["correctable"].as_u64()?).ok()?,
        uncorrectable: u32::try_from(v["uncorrectable"].as_u64()?).ok()?,
        pending: v["pending"].as_bool()?,
        failed: v["failure_occurred"].as_bool()?,
    })
}

/// CRC, replay and recovery errors summed over the links of [`nvlink_errors`]' answer (None
/// without NVLink).
pub fn nvlink_totals(v: &Value) -> Option<[u64; 3]> {
    let links = v.as_object().filter(|m| !m.contains_key("active_links"))?;
    let mut t = [0u64; 3];
    for l in links.values() {
        let n = |k: &str| l[k].as_u64().unwrap_or(0);
        t[0] += n("crc_flit") + n("crc_data");
        t[1] += n("replay");
        t[2] += n("recovery");
    }
    Some(t)
}

fn res<T: Serialize, E: std::fmt::Display>(r: Result<T, E>) -> Value {
    match r {
        Ok(v) => json!(v),
        Err(e) => json!({ "unavailable": e.to_string() }),
    }
}

type RemapFn =
    unsafe extern "C" fn(*mut std::ffi::c_void, *mut u32, *mut u32, *mut u32, *mut u32) -> u32;

/// `nvmlDeviceGetRemappedRows` (row remapping, the memory-health record of A100/H100/H200;
/// Xid 63/64 are its log side). nvml-wrapper 0.11 does not wrap it: the driver's library,
/// already loaded and initialised by nvml-wrapper, is asked directly.
fn remapped_rows(dev: &Device) -> Value {
    static REMAP: std::sync::LazyLock<Option<(libloading::Library, RemapFn)>> =
        std::sync::LazyLock::new(|| {
            // SAFETY: the same NVML library nvml-wrapper loaded (a refcounted handle to it).
            let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }.ok()?;
            // SAFETY: the NVML function of this name has this signature (NVML API reference).
            let f: RemapFn = *unsafe { lib.get::<RemapFn>(b"nvmlDeviceGetRemappedRows\0") }.ok()?;
            Some((lib, f))
        });
    let Some((_, f)) = REMAP.as_ref() else {
        return json!({ "unavailable": "nvmlDeviceGetRemappedRows not in this driver's NVML" });
    };
    let (mut corr, mut unc, mut pending, mut failed) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: a valid device handle of the initialised NVML and four out-parameters.
    let r = unsafe {
        f(
            dev.handle().cast(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failed,
        )
    };
    match r {
        0 => {
            json!({ "correctable": corr, "uncorrectable": unc, "pending": pending != 0, "failure_occurred": failed != 0 })
        }
        3 => json!({ "unavailable": "not supported on this GPU" }),
        e => json!({ "unavailable": format!("NVML error {e}") }),
    }
}

/// NVLink error counters per active link (CRC, replay, recovery), where the GPU has NVLink.
fn nvlink_errors(dev: &Device) -> Value {
    use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
    let mut links = Map::new();
    for l in 0..18u32 {
        let link = dev.link_wrapper_for(l);
        if !matches!(link.is_active(), Ok(true)) {
            continue;
        }
        let c = |k| link.error_counter(k).ok();
        links.insert(l.to_string(), json!({ "crc_flit": c(ErrorCounter::DlCrcFlit), "crc_data": c(ErrorCounter::DlCrcData), "replay": c(ErrorCounter::DlReplay), "recovery": c(ErrorCounter::DlRecovery) }));
    }
    if links.is_empty() {
        json!({ "active_links": 0 })
    } else {
        Value::Object(links)
    }
}

/// Per-GPU snapshot (nvidia-smi -q -d ECC,POWER,TEMPERATURE,UTILIZATION + retired pages).
pub fn device_snapshot(dev: &Device, index: u32) -> Value {
    use nvml_wrapper::enum_wrappers::device::RetirementCause;
    let r = read(dev, index);
    json!({
        "index": index,
        "name": res(dev.name()),
        "uuid": res(dev.uuid()),
        "pci_bus_id": res(dev.pci_info().map(|p| p.bus_id)),
        "pci": r.pci,
        "ecc_mode": res(dev.is_ecc_enabled().map(|e| json!({ "current": e.currently_enabled, "pending": e.pending_enabled }))),
        "ecc_volatile": { "corrected": res(dev.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)), "uncorrected": res(dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)) },
        "ecc_aggregate": { "corrected": res(dev.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)), "uncorrected": res(dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate)) },
        "retired_pages": {
            "single_bit": res(dev.retired_pages(RetirementCause::MultipleSingleBitEccErrors).map(|v| v.len())),
            "double_bit": res(dev.retired_pages(RetirementCause::DoubleBitEccError).map(|v| v.len())),
        },
        "remapped_rows": remapped_rows(dev),
        "nvlink_errors": nvlink_errors(dev),
        "temperature": { "gpu_c": r.temp_c, "slowdown_c": r.slowdown_temp_c, "shutdown_c": dev.temperature_threshold(TemperatureThreshold::Shutdown).ok() },
        "power": { "draw_w": r.power_mw.map(|p| f64::from(p) / 1000.0), "enforced_limit_w": r.enforced_limit_mw.map(|p| f64::from(p) / 1000.0), "management_limit_w": dev.power_management_limit().ok().map(|p| f64::from(p) / 1000.0) },
        "utilization": { "gpu_pct": r.util_gpu_pct, "memory_pct": r.util_mem_pct },
        "memory": { "used_bytes": r.mem_used_bytes, "total_bytes": r.mem_total_bytes },
        "clocks_mhz": { "sm": r.sm_clock_mhz, "memory": r.mem_clock_mhz },
        "throttle_reasons": r.throttle_mask.map(throttle_names),
        "pcie": { "gen_current": dev.current_pcie_link_gen().ok(), "gen_max": dev.max_pcie_link_gen().ok(), "width_current": dev.current_pcie_link_width().ok(), "width_max": dev.max_pcie_link_width().ok(), "replay_counter": r.pcie_replay },
        "compute_processes": res(dev.running_compute_processes().map(|v| v.iter().map(|p| json!({ "pid": p.pid })).collect::<Vec<_>>())),
    })
}

/// NVML, or the reason it is not there.
pub fn init() -> Result<Nvml, String> {
    Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))
}

pub fn snapshot() -> Value {
    match init() {
        Ok(n) => {
            let count = n.device_count().unwrap_or(0);
            let devices: Vec<Value> = (0..count)
                .map(|i| match n.device_by_index(i) {
                    Ok(d) => device_snapshot(&d, i),
                    Err(e) => json!({ "index": i, "error": e.to_string() }),
                })
                .collect();
            json!({
                "available": true,
                "driver_version": res(n.sys_driver_version()),
                "cuda_driver_version": n.sys_cuda_driver_version().ok().map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)),
                "device_count": count,
                "devices": devices,
            })
        }
        Err(reason) => json!({ "available": false, "reason": reason }),
    }
}

/// Driver and CUDA driver versions, for the software section.
pub fn driver_versions() -> Option<(String, Option<i32>)> {
    let n = init().ok()?;
    Some((
        n.sys_driver_version().ok()?,
        n.sys_cuda_driver_version().ok(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recorded in the shapes NVML returns for an H100 (mW, MHz, bitmask, counts).
    fn recorded(throttle: u64, ecc_u: u64, ecc_c: u64, replay: u32, temp: u32) -> GpuReading {
        GpuReading {
            index: 2,
            pci: normalize_pci("00000000:3B:00.0"),
            temp_c: Some(temp),
            power_mw: Some(612_345),
            enforced_limit_mw: Some(700_000),
            sm_clock_mhz: Some(1980),
            mem_clock_mhz: Some(2619),
            throttle_mask: Some(throttle),
            util_gpu_pct: Some(98),
            util_mem_pct: Some(61),
            mem_used_bytes: Some(70 << 30),
            mem_total_bytes: Some(80 << 30),
            ecc_corrected_volatile: Some(ecc_c),
            ecc_uncorrected_volatile: Some(ecc_u),
            pcie_replay: Some(replay),
            slowdown_temp_c: Some(87),
            remap: None,
            nvlink: None,
        }
    }

    #[test]
    fn row_remaps_and_nvlink_errors_become_events() {
        // As remapped_rows() and nvlink_errors() answer on an H200 (docs/gpu-check.md: 0
        // remaps, 18 links) and after a remap and NVLink CRC errors.
        let before = json!({ "correctable": 0, "uncorrectable": 0, "pending": false, "failure_occurred": false });
        let after = json!({ "correctable": 0, "uncorrectable": 1, "pending": true, "failure_occurred": false });
        let links = |crc: u64| json!({ "0": { "crc_flit": crc, "crc_data": 0, "replay": 0, "recovery": 0 }, "1": { "crc_flit": 0, "crc_data": 0, "replay": 2, "recovery": 0 } });
        let mut a = recorded(0, 0, 0, 0, 60);
        let mut b = a.clone();
        a.remap = remap_of(&before);
        b.remap = remap_of(&after);
        a.nvlink = nvlink_totals(&links(10));
        b.nvlink = nvlink_totals(&links(17));
        assert_eq!(changes(&a, &b), vec![
            "row remapping: 1 more row(s) remapped for uncorrectable errors on GPU 2 (0000:3b:00.0)".to_string(),
            "row remap pending (needs a GPU reset) on GPU 2 (0000:3b:00.0)".to_string(),
            "NVLink CRC errors +7 on GPU 2 (0000:3b:00.0)".to_string(),
        ]);
        // Not supported / no NVLink: nothing to compare, no event.
        assert_eq!(
            remap_of(&json!({ "unavailable": "not supported on this GPU" })),
            None
        );
        assert_eq!(nvlink_totals(&json!({ "active_links": 0 })), None);
    }

    #[test]
    fn sample_fields_in_human_units() {
        let f = sample_fields(&recorded(0x8 | 0x1, 0, 3, 0, 71));
        assert_eq!(f["pci"], "0000:3b:00.0");
        assert_eq!(f["power_w"], 612.345);
        assert_eq!(f["power_limit_w"], 700.0);
        assert_eq!(f["throttle"], json!(["hw_slowdown"]));
        assert_eq!(f["mem_used_mib"], 70 * 1024);
        assert_eq!(f["ecc_corrected_volatile"], 3);
    }

    #[test]
    fn changes_become_events() {
        let a = recorded(0x0, 0, 3, 10, 70);
        let b = recorded(0x8, 1, 5, 14, 84);
        let c = changes(&a, &b);
        assert_eq!(c, vec![
            "HW slowdown started on GPU 2 (0000:3b:00.0)".to_string(),
            "uncorrected ECC +1 on GPU 2 (0000:3b:00.0)".to_string(),
            "corrected ECC +2 on GPU 2 (0000:3b:00.0)".to_string(),
            "PCIe replay counter +4 on GPU 2 (0000:3b:00.0)".to_string(),
            "temperature 84 C within 5 C of the slowdown threshold 87 C on GPU 2 (0000:3b:00.0)".to_string(),
        ]);
        assert_eq!(
            changes(&b, &a),
            vec!["HW slowdown ended on GPU 2 (0000:3b:00.0)".to_string()]
        );
        assert!(changes(&a, &a).is_empty());
    }

    #[test]
    fn throttle_bits() {
        assert_eq!(
            throttle_names(0x4 | 0x40),
            vec!["sw_power_cap", "hw_thermal_slowdown"]
        );
        assert!(throttle_names(0).is_empty());
    }

    #[test]
    fn without_nvml_the_reason_is_reported() {
        // On machines without libnvidia-ml (CI), this is the path taken; on a GPU node it lists devices.
        let s = snapshot();
        if s["available"] == false {
            assert!(
                s["reason"]
                    .as_str()
                    .unwrap()
                    .starts_with("NVML unavailable: "),
                "{s}"
            );
        } else {
            assert!(s["device_count"].as_u64().is_some());
        }
    }
}
