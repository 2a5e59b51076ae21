//! System evidence from /proc through the `procfs` crate: memory and swap (`free`), swap-in/out
//! rates, CPU busy and iowait, load, PSI, per-disk I/O like `iostat -x`, and the job's
//! processes (RSS, CPU). Samples are deltas between two reads; the first read only primes.
use std::collections::{BTreeMap, HashMap};

use procfs::{Current as _, CurrentSI as _};
use serde_json::{json, Map, Value};

use crate::clock::monotonic_ns;
use crate::event::{Detail, Event};

fn ticks_per_s() -> f64 {
    procfs::ticks_per_second() as f64
}

fn page_kb() -> u64 {
    procfs::page_size() / 1024
}

#[derive(Clone, Default)]
struct Prev {
    mono_ns: u64,
    cpu: Option<(u64, u64, u64)>, // (busy, iowait, total) ticks
    swap: Option<(i64, i64)>,     // pswpin, pswpout pages
    disks: HashMap<String, procfs::DiskStat>,
    procs: HashMap<u32, u64>, // pid -> utime+stime ticks
}

pub struct Sampler {
    root_pid: Option<u32>,
    prev: Prev,
}

/// `iostat -x`-like figures for one disk between two reads.
pub fn disk_delta(a: &procfs::DiskStat, b: &procfs::DiskStat, dt_s: f64) -> Value {
    let d = |x: u64, y: u64| y.saturating_sub(x);
    let reads = d(a.reads, b.reads);
    let writes = d(a.writes, b.writes);
    let r_await = if reads > 0 {
        d(a.time_reading, b.time_reading) as f64 / reads as f64
    } else {
        0.0
    };
    let w_await = if writes > 0 {
        d(a.time_writing, b.time_writing) as f64 / writes as f64
    } else {
        0.0
    };
    json!({
        "r_s": reads as f64 / dt_s,
        "w_s": writes as f64 / dt_s,
        "rkb_s": d(a.sectors_read, b.sectors_read) as f64 / 2.0 / dt_s,
        "wkb_s": d(a.sectors_written, b.sectors_written) as f64 / 2.0 / dt_s,
        "r_await_ms": r_await,
        "w_await_ms": w_await,
        "util_pct": (d(a.time_in_progress, b.time_in_progress) as f64 / (dt_s * 1000.0) * 100.0).min(100.0),
    })
}

fn cpu_ticks() -> Option<(u64, u64, u64)> {
    let k = procfs::KernelStats::current().ok()?;
    let c = k.total;
    let iowait = c.iowait.unwrap_or(0);
    let total = c.user
        + c.nice
        + c.system
        + c.idle
        + iowait
        + c.irq.unwrap_or(0)
        + c.softirq.unwrap_or(0)
        + c.steal.unwrap_or(0);
    let busy = total - c.idle - iowait;
    Some((busy, iowait, total))
}

fn psi() -> Value {
    let rec = |r: &procfs::PressureRecord| json!({ "avg10": r.avg10, "avg60": r.avg60, "total_us": r.total });
    json!({
        "cpu_some": procfs::CpuPressure::current().ok().map(|p| rec(&p.some)),
        "memory_some": procfs::MemoryPressure::current().ok().map(|p| rec(&p.some)),
        "memory_full": procfs::MemoryPressure::current().ok().map(|p| rec(&p.full)),
        "io_some": procfs::IoPressure::current().ok().map(|p| rec(&p.some)),
        "io_full": procfs::IoPressure::current().ok().map(|p| rec(&p.full)),
    })
}

/// `free -k`.
pub fn free() -> Value {
    match procfs::Meminfo::current() {
        Ok(m) => {
            let avail = m.mem_available.unwrap_or(m.mem_free);
            let cache = m.cached + m.buffers + m.s_reclaimable.unwrap_or(0);
            json!({
                "mem_total_kb": m.mem_total / 1024,
                "mem_used_kb": (m.mem_total - m.mem_free - cache.min(m.mem_total - m.mem_free)) / 1024,
                "mem_free_kb": m.mem_free / 1024,
                "mem_shared_kb": m.shmem.unwrap_or(0) / 1024,
                "mem_buff_cache_kb": cache / 1024,
                "mem_available_kb": avail / 1024,
                "swap_total_kb": m.swap_total / 1024,
                "swap_used_kb": (m.swap_total - m.swap_free) / 1024,
                "swap_free_kb": m.swap_free / 1024,
            })
        }
        Err(e) => json!({ "error": format!("/proc/meminfo: {e}") }),
    }
}

/// One process row for the `top`-like table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProcRow {
    pub pid: u32,
    pub ppid: u32,
    pub comm: String,
    pub state: String,
    pub rss_kb: u64,
    pub cpu_time_s: f64,
    pub cpu_pct_since_start: f64,
    pub job: bool,
}

/// `top -b -n 1`-like: the top processes by CPU and by memory, job processes marked.
pub fn top(job: &std::collections::BTreeSet<u32>, n: usize) -> Value {
    let tps = ticks_per_s();
    let uptime = procfs::Uptime::current().map(|u| u.uptime).unwrap_or(0.0);
    let boot_ticks_now = uptime * tps;
    let mut rows = Vec::new();
    if let Ok(all) = procfs::process::all_processes() {
        for p in all.flatten() {
            let Ok(st) = p.stat() else { continue };
            let cpu_ticks = (st.utime + st.stime) as f64;
            let age = (boot_ticks_now - st.starttime as f64).max(1.0);
            rows.push(ProcRow {
                pid: st.pid as u32,
                ppid: st.ppid as u32,
                comm: st.comm.clone(),
                state: st.state.to_string(),
                rss_kb: st.rss * page_kb(),
                cpu_time_s: cpu_ticks / tps,
                cpu_pct_since_start: cpu_ticks / age * 100.0,
                job: job.contains(&(st.pid as u32)),
            });
        }
    }
    let mut by_cpu = rows.clone();
    by_cpu.sort_by(|a, b| b.cpu_pct_since_start.total_cmp(&a.cpu_pct_since_start));
    by_cpu.truncate(n);
    let mut by_mem = rows.clone();
    by_mem.sort_by_key(|r| std::cmp::Reverse(r.rss_kb));
    by_mem.truncate(n);
    let job_rows: Vec<&ProcRow> = rows.iter().filter(|r| r.job).collect();
    json!({
        "processes": rows.len(),
        "by_cpu": by_cpu,
        "by_memory": by_mem,
        "job_processes": job_rows,
        "loadavg": procfs::LoadAverage::current().ok().map(|l| json!([l.one, l.five, l.fifteen])),
    })
}

impl Sampler {
    pub fn new(root_pid: Option<u32>) -> Self {
        Self {
            root_pid,
            prev: Prev::default(),
        }
    }

    /// One sample: a `system` event (and `disk` when disks moved, `job_procs` for the job).
    pub fn sample(&mut self) -> Vec<Event> {
        let now = monotonic_ns();
        let dt = (now.saturating_sub(self.prev.mono_ns)) as f64 / 1e9;
        let primed = self.prev.mono_ns != 0 && dt > 0.0;
        let mut out = Vec::new();
        let mut f = Map::new();
        if let Value::Object(m) = free() {
            for (k, v) in m {
                if matches!(
                    k.as_str(),
                    "mem_available_kb" | "mem_used_kb" | "swap_used_kb" | "mem_total_kb"
                ) {
                    f.insert(k, v);
                }
            }
        }
        if let Some(c) = cpu_ticks() {
            if let (true, Some(p)) = (primed, self.prev.cpu) {
                let tot = (c.2 - p.2).max(1) as f64;
                f.insert(
                    "cpu_busy_pct".into(),
                    json!(((c.0 - p.0) as f64 / tot * 100.0)),
                );
                f.insert(
                    "iowait_pct".into(),
                    json!(((c.1 - p.1) as f64 / tot * 100.0)),
                );
            }
            self.prev.cpu = Some(c);
        }
        if let Ok(l) = procfs::LoadAverage::current() {
            f.insert("load1".into(), json!(l.one));
        }
        if let Ok(vm) = procfs::vmstat() {
            let s = (
                vm.get("pswpin").copied().unwrap_or(0),
                vm.get("pswpout").copied().unwrap_or(0),
            );
            if let (true, Some(p)) = (primed, self.prev.swap) {
                f.insert(
                    "swap_in_kb_s".into(),
                    json!(((s.0 - p.0) as f64 * page_kb() as f64 / dt)),
                );
                f.insert(
                    "swap_out_kb_s".into(),
                    json!(((s.1 - p.1) as f64 * page_kb() as f64 / dt)),
                );
            }
            self.prev.swap = Some(s);
        }
        if let Ok(p) = procfs::MemoryPressure::current() {
            f.insert("psi_memory_some_avg10".into(), json!(p.some.avg10));
        }
        if let Ok(p) = procfs::IoPressure::current() {
            f.insert("psi_io_some_avg10".into(), json!(p.some.avg10));
        }
        if let Ok(p) = procfs::CpuPressure::current() {
            f.insert("psi_cpu_some_avg10".into(), json!(p.some.avg10));
        }
        if !f.is_empty() {
            out.push(sample_event(now, crate::source::Source::System, f));
        }
        if let Ok(disks) = procfs::diskstats() {
            let mut d = Map::new();
            let mut next = HashMap::new();
            for s in disks {
                if s.name.starts_with("ram") {
                    continue;
                }
                if let (true, Some(p)) = (primed, self.prev.disks.get(&s.name)) {
                    if s.reads != p.reads || s.writes != p.writes {
                        d.insert(s.name.clone(), disk_delta(p, &s, dt));
                    }
                }
                next.insert(s.name.clone(), s);
            }
            self.prev.disks = next;
            if !d.is_empty() {
                let mut f = Map::new();
                f.insert("disks".into(), Value::Object(d));
                out.push(sample_event(now, crate::source::Source::Disk, f));
            }
        }
        if let Some(root) = self.root_pid {
            let pids = crate::correlate::descendants(&[root]);
            let (mut rss, mut cpu, mut n) = (0u64, 0.0f64, 0);
            let mut next = HashMap::new();
            for pid in &pids {
                let Ok(p) = procfs::process::Process::new(*pid as i32) else {
                    continue;
                };
                let Ok(st) = p.stat() else { continue };
                n += 1;
                rss += st.rss * page_kb();
                let t = st.utime + st.stime;
                if let (true, Some(pt)) = (primed, self.prev.procs.get(pid)) {
                    cpu += (t.saturating_sub(*pt)) as f64 / ticks_per_s() / dt * 100.0;
                }
                next.insert(*pid, t);
            }
            self.prev.procs = next;
            if n > 0 {
                let mut f = Map::new();
                f.insert("job_processes".into(), json!(n));
                f.insert("job_rss_kb".into(), json!(rss));
                if primed {
                    f.insert("job_cpu_pct".into(), json!(cpu));
                }
                out.push(sample_event(now, crate::source::Source::JobProcs, f));
            }
        }
        self.prev.mono_ns = now;
        out
    }
}

pub fn sample_event(
    mono_ns: u64,
    source: crate::source::Source,
    fields: Map<String, Value>,
) -> Event {
    Event::new(
        mono_ns,
        0,
        0,
        crate::event::Comm::NONE,
        false,
        Detail::Sample {
            source,
            fields: Box::new(fields),
        },
    )
}

/// All-CPU time counters from /proc/stat, in top's order: us, sy, ni, id, wa, hi, si, st.
fn cpu_split() -> Option<[u64; 8]> {
    let c = procfs::KernelStats::current().ok()?.total;
    Some([
        c.user,
        c.system,
        c.nice,
        c.idle,
        c.iowait.unwrap_or(0),
        c.irq.unwrap_or(0),
        c.softirq.unwrap_or(0),
        c.steal.unwrap_or(0),
    ])
}

/// What `top` shows in its `%Cpu(s)` header, over `interval`: the share of CPU time per state.
pub fn cpu_breakdown(interval: std::time::Duration) -> Value {
    let Some(a) = cpu_split() else {
        return json!({ "error": "/proc/stat unreadable" });
    };
    std::thread::sleep(interval);
    let Some(b) = cpu_split() else {
        return json!({ "error": "/proc/stat unreadable" });
    };
    cpu_breakdown_from(a, b, interval.as_secs_f64())
}

fn cpu_breakdown_from(a: [u64; 8], b: [u64; 8], interval_s: f64) -> Value {
    let d: Vec<u64> = a.iter().zip(b).map(|(x, y)| y.saturating_sub(*x)).collect();
    let total: u64 = d.iter().sum();
    let pct = |i: usize| {
        if total == 0 {
            0.0
        } else {
            (d[i] as f64 / total as f64 * 1000.0).round() / 10.0
        }
    };
    json!({
        "interval_s": interval_s,
        "us": pct(0), "sy": pct(1), "ni": pct(2), "id": pct(3), "wa": pct(4), "hi": pct(5), "si": pct(6), "st": pct(7),
        "iowait_pct": pct(4),
    })
}

/// The system part of snapshot.json.
pub fn snapshot(job: &std::collections::BTreeSet<u32>) -> Value {
    let disks: BTreeMap<String, Value> = procfs::diskstats()
        .map(|v| v.into_iter().filter(|d| !d.name.starts_with("ram") && (d.reads + d.writes) > 0).map(|d| (d.name.clone(), json!({ "reads": d.reads, "writes": d.writes, "in_progress": d.in_progress, "time_in_progress_ms": d.time_in_progress }))).collect())
        .unwrap_or_default();
    json!({
        "free": free(),
        "top": top(job, 15),
        "psi": psi(),
        "disks_since_boot": disks,
        "cpus": procfs::CpuInfo::current().map(|c| c.num_cores()).ok(),
        "cpu_breakdown": cpu_breakdown(std::time::Duration::from_millis(250)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_breakdown_like_tops_header() {
        let v = cpu_breakdown_from(
            [100, 50, 0, 800, 50, 0, 0, 0],
            [160, 70, 0, 880, 90, 0, 0, 0],
            0.25,
        );
        assert_eq!(
            (
                v["us"].as_f64(),
                v["sy"].as_f64(),
                v["id"].as_f64(),
                v["wa"].as_f64(),
                v["st"].as_f64()
            ),
            (Some(30.0), Some(10.0), Some(40.0), Some(20.0), Some(0.0))
        );
        let live = cpu_breakdown(std::time::Duration::from_millis(50));
        let sum: f64 = ["us", "sy", "ni", "id", "wa", "hi", "si", "st"]
            .iter()
            .map(|k| live[k].as_f64().unwrap())
            .sum();
        assert!(sum == 0.0 || (sum - 100.0).abs() < 1.0, "{live}");
    }

    #[test]
    fn iostat_figures_from_two_reads() {
        let line_a = "   8       0 sda 100 0 800 50 200 0 1600 400 0 300 450 0 0 0 0";
        let line_b = "   8       0 sda 110 0 880 70 240 0 1920 480 0 800 550 0 0 0 0";
        let a = procfs::DiskStat::from_line(line_a).unwrap();
        let b = procfs::DiskStat::from_line(line_b).unwrap();
        let d = disk_delta(&a, &b, 1.0);
        assert_eq!(d["r_s"], 10.0);
        assert_eq!(d["w_s"], 40.0);
        assert_eq!(d["rkb_s"], 40.0);
        assert_eq!(d["r_await_ms"], 2.0);
        assert_eq!(d["w_await_ms"], 2.0);
        assert_eq!(d["util_pct"], 50.0);
    }

    #[test]
    fn a_child_process_appears_with_its_rss_in_the_job_table() {
        let child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let mut job = std::collections::BTreeSet::new();
        job.insert(child.id());
        let t = top(&job, 5);
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
        let rows = t["job_processes"].as_array().unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["comm"], "sleep");
        assert!(rows[0]["rss_kb"].as_u64().unwrap() > 100, "{}", rows[0]);
        assert_eq!(rows[0]["job"], true);
        assert!(t["by_memory"].as_array().unwrap().len() == 5);
        let f = free();
        assert!(f["mem_total_kb"].as_u64().unwrap() > 0);
    }

    #[test]
    fn sampler_primes_then_reports_rates() {
        let mut s = Sampler::new(Some(std::process::id()));
        let first = s.sample();
        assert!(first.iter().any(|e| e.source() == "system"));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let second = s.sample();
        let sys = second.iter().find(|e| e.source() == "system").unwrap();
        let j = sys.to_json(&crate::clock::ClockMap::sample());
        assert!(j["cpu_busy_pct"].as_f64().is_some());
        assert!(j.get("swap_in_kb_s").is_some());
        let jp = second
            .iter()
            .find(|e| e.source() == "job_procs")
            .unwrap()
            .to_json(&crate::clock::ClockMap::sample());
        assert!(jp["job_rss_kb"].as_u64().unwrap() > 1000);
    }
}
