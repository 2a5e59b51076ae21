//! Userspace collectors: periodic samples into the flight recorder, snapshots at the trigger.
pub mod env;
pub mod flight;
pub mod gpu;
pub mod host;
pub mod nccl_ras;
pub mod net;
pub mod ranks;
pub mod redact;
pub mod scheduler;
pub mod stacks;
pub mod system;

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::event::Event;
use system::sample_event;

pub const SNAPSHOT_SCHEMA: &str = "nantrace.snapshot/1";

/// Start the periodic samplers on their own thread (NVML and /proc reads block). `sink`
/// returns false when the sample could not be queued; such gaps are counted in `gaps`.
pub fn spawn_samplers(
    interval_s: f64,
    root_pid: Option<u32>,
    sink: impl Fn(Vec<Event>) -> bool + Send + Sync + 'static,
) {
    let sink = std::sync::Arc::new(sink);
    if interval_s <= 0.0 {
        return;
    }
    // NVML takes a driver lock: never poll it faster than once a second.
    let gpu_every = interval_s.max(1.0);
    std::thread::Builder::new()
        .name("nantrace-sampler".into())
        .spawn(move || {
            let mut sys = system::Sampler::new(root_pid);
            let mut netw = net::Sampler::new(Path::new("/sys"));
            let nvml = gpu::init();
            let mut prev_gpu: Vec<Option<gpu::GpuReading>> = Vec::new();
            let mut last_gpu = 0u64;
            let mut gaps = 0u64;
            if nvml.is_ok() {
                let s2 = sink.clone();
                spawn_xid_listener(move |b| s2(b));
            }
            loop {
                let mut batch = sys.sample();
                batch.extend(netw.sample(interval_s));
                let now = crate::clock::monotonic_ns();
                if let Ok(n) = &nvml {
                    if now - last_gpu >= (gpu_every * 1e9) as u64 {
                        last_gpu = now;
                        let count = n.device_count().unwrap_or(0) as usize;
                        prev_gpu.resize(count, None);
                        #[expect(
                            clippy::needless_range_loop,
                            reason = "i is also the NVML device index"
                        )]
                        for i in 0..count {
                            let Ok(d) = n.device_by_index(i as u32) else {
                                continue;
                            };
                            let r = gpu::read(&d, i as u32);
                            batch.push(sample_event(
                                now,
                                crate::source::Source::Gpu,
                                gpu::sample_fields(&r),
                            ));
                            if let Some(p) = &prev_gpu[i] {
                                for c in gpu::changes(p, &r) {
                                    let mut f = Map::new();
                                    f.insert("gpu".into(), json!(i));
                                    f.insert("pci".into(), json!(r.pci));
                                    f.insert("change".into(), json!(c));
                                    batch.push(sample_event(
                                        now,
                                        crate::source::Source::GpuChange,
                                        f,
                                    ));
                                }
                            }
                            prev_gpu[i] = Some(r);
                        }
                    }
                }
                if gaps > 0 {
                    let mut f = Map::new();
                    f.insert("dropped_sample_batches".into(), json!(gaps));
                    batch.push(sample_event(now, crate::source::Source::CollectorGap, f));
                }
                if !batch.is_empty() {
                    if sink(batch) {
                        gaps = 0;
                    } else {
                        gaps += 1;
                    }
                }
                std::thread::sleep(Duration::from_secs_f64(interval_s));
            }
        })
        .ok();
}

/// NVML's own Xid events (nvmlEventTypeXidCriticalError), as `nvml_xid` events: a second
/// witness next to the kernel log's NVRM line (the report merges the two).
fn spawn_xid_listener(sink: impl Fn(Vec<Event>) -> bool + Send + 'static) {
    std::thread::Builder::new()
        .name("nantrace-nvml-xid".into())
        .spawn(move || {
            let Ok(n) = gpu::init() else { return };
            let Ok(mut set) = n.create_event_set() else {
                return;
            };
            let count = n.device_count().unwrap_or(0);
            for i in 0..count {
                let Ok(d) = n.device_by_index(i) else {
                    continue;
                };
                match d.register_events(
                    nvml_wrapper::bitmasks::event::EventTypes::CRITICAL_XID_ERROR,
                    set,
                ) {
                    Ok(s) => set = s,
                    Err(e) => {
                        crate::say!(
                            "nantrace: NVML Xid events unavailable on GPU {i}: {:?}",
                            e.error
                        );
                        return;
                    }
                }
            }
            loop {
                match set.wait(1000) {
                    Ok(ev) => {
                        let xid = match ev.event_data {
                            Some(nvml_wrapper::enums::event::XidError::Value(v)) => json!(v),
                            _ => Value::Null,
                        };
                        let mut f = Map::new();
                        f.insert("xid".into(), xid);
                        f.insert(
                            "pci".into(),
                            json!(ev
                                .device
                                .pci_info()
                                .map(|p| crate::classify::normalize_pci(&p.bus_id))
                                .unwrap_or_default()),
                        );
                        f.insert(
                            "gpu_uuid".into(),
                            json!(ev.device.uuid().unwrap_or_default()),
                        );
                        f.insert("witness".into(), json!("nvml"));
                        if !sink(vec![sample_event(
                            crate::clock::monotonic_ns(),
                            crate::source::Source::NvmlXid,
                            f,
                        )]) {
                            // queue full: the kernel-log witness of the same Xid still arrives
                        }
                    }
                    Err(nvml_wrapper::error::NvmlError::Timeout) => {}
                    Err(e) => {
                        crate::say!(
                            "nantrace: NVML Xid event wait failed, stopping that listener: {e}"
                        );
                        return;
                    }
                }
            }
        })
        .ok();
}

/// The job's software and scheduler context, captured while it is alive (its environment,
/// libraries and cgroup are gone once it has exited).
pub fn job_context(root_pid: u32) -> Option<Value> {
    if !crate::correlate::alive(root_pid) {
        return None;
    }
    let software = env::snapshot(Some(root_pid), None);
    let env_map = env_map(&software);
    let pids = crate::correlate::descendants(&[root_pid]);
    Some(json!({
        "captured_at": crate::clock::rfc3339(crate::clock::realtime_ns()),
        "job_sockets": net::job_sockets(&pids),
        "software": software,
        "scheduler": scheduler::snapshot(Some(root_pid), &env_map),
    }))
}

fn env_map(software: &Value) -> std::collections::BTreeMap<String, String> {
    software["env"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// snapshot.json, with the job's context from `cached` when the job is already gone.
pub fn snapshot_with(root_pid: Option<u32>, cached: Option<Value>) -> Value {
    let mut s = snapshot(root_pid);
    if let (Some(pid), Some(c)) = (root_pid, cached) {
        if !crate::correlate::alive(pid) {
            let drv = s["software"]["nvml_driver_version"].clone();
            let cuda = s["software"]["cuda_driver_version"].clone();
            s["software"] = c["software"].clone();
            s["software"]["nvml_driver_version"] = drv;
            s["software"]["cuda_driver_version"] = cuda;
            s["software"]["note"] = json!(format!(
                "job {pid} had exited at the trigger; its context was captured at {}",
                c["captured_at"].as_str().unwrap_or("?")
            ));
            s["scheduler"] = c["scheduler"].clone();
            s["scheduler"]["note"] = s["software"]["note"].clone();
            s["network"]["job_sockets"] = c["job_sockets"].clone();
        }
    }
    s
}

/// snapshot.json: one section per evidence family, each filled or saying why not.
pub fn snapshot(root_pid: Option<u32>) -> Value {
    let job = root_pid
        .map(|p| crate::correlate::descendants(&[p]))
        .unwrap_or_default();
    // NCCL's RAS is asked while the rest is read (it waits on the job's other processes).
    let ras = {
        let job = job.clone();
        std::thread::Builder::new()
            .name("nantrace-ras-wait".into())
            .spawn(move || nccl_ras::snapshot(&job))
    };
    let gpu = gpu::snapshot();
    let drv = if gpu["available"] == true {
        gpu::driver_versions()
    } else {
        None
    };
    let software = env::snapshot(root_pid, drv);
    let env_map = env_map(&software);
    let mut network = net::snapshot();
    network["job_sockets"] = json!(net::job_sockets(&job));
    // Where each rank's Flight Recorder dump will go, read while the ranks live (before
    // the stacks' samples and py-spy, which take seconds).
    let flight = flight::sources(&job);
    json!({
        "schema": SNAPSHOT_SCHEMA,
        "time": crate::clock::rfc3339(crate::clock::realtime_ns()),
        "host": host::Host::read(),
        "gpu": gpu,
        "system": system::snapshot(&job),
        "network": network,
        "software": software,
        "scheduler": scheduler::snapshot(root_pid, &env_map),
        "stacks": stacks::snapshot(&job),
        "nccl_ras": ras_of(ras),
        "flight_recorder": flight,
    })
}

/// The RAS query's section, from its thread (bounded by `nccl_ras::DEADLINE` itself).
fn ras_of(t: std::io::Result<std::thread::JoinHandle<Value>>) -> Value {
    t.map_err(|e| e.to_string())
        .and_then(|h| h.join().map_err(|_| "its thread panicked".to_string()))
        .unwrap_or_else(|e| json!({ "error": format!("no NCCL RAS query: {e}") }))
}

/// A process's command line, redacted (empty when it is gone or a kernel thread).
pub fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            redact::argv(
                &b.split(|&c| c == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect::<Vec<_>>(),
            )
        })
        .unwrap_or_default()
}
