//! Pieces of `cargo xtask bench` that must run inside the nantrace binary: the fixed workload,
//! in-process measurements of the recorder and the dump, and the kernel's per-program stats.
use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::time::Instant;

use serde_json::{json, Value};

use crate::clock::{monotonic_ns, ClockMap};
use crate::event::{comm_from, Detail, Event, Kmsg, LogLine};
use crate::recorder::Recorder;

mod jobs;
mod synth;
pub use jobs::test_job;
pub use synth::{synth, synth_gen};

/// The fixed workload: O_DIRECT 4 KiB writes + fsync, fork/exec/exit of /bin/true, TCP
/// round trips over loopback, and a kernel log line every `kmsg_every` iterations.
pub fn workload(
    iters: u32,
    kmsg_every: u32,
    dir: &std::path::Path,
    go_file: Option<&std::path::Path>,
) -> Value {
    if let Some(g) = go_file {
        while !g.exists() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    // SAFETY: PR_SET_NAME with a NUL-terminated name.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"nt-bench-work".as_ptr()) };
    let path = dir.join(format!("nt-bench-{}.dat", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .expect("O_DIRECT file (needs a real filesystem, not tmpfs)");
    let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
    // SAFETY: aligned allocation for O_DIRECT, freed below.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    // SAFETY: buf is valid for 4096 bytes.
    let block = unsafe { std::slice::from_raw_parts(buf, 4096) };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 64];
        while let Ok(n) = s.read(&mut b) {
            if n == 0 || s.write_all(&b[..n]).is_err() {
                break;
            }
        }
    });
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut kmsg = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .ok();
    let t0 = Instant::now();
    let mut b = [0u8; 64];
    for i in 0..iters {
        use std::os::unix::fs::FileExt as _;
        f.write_all_at(block, u64::from(i % 256) * 4096).unwrap();
        f.sync_data().unwrap();
        let _ = std::process::Command::new("/bin/true").status();
        c.write_all(&b[..32]).unwrap();
        c.read_exact(&mut b[..32]).unwrap();
        if kmsg_every > 0 && i % kmsg_every == 0 {
            if let Some(k) = kmsg.as_mut() {
                let _ = k.write_all(format!("nantrace-bench: iteration {i}\n").as_bytes());
            }
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    drop(c);
    let _ = server.join();
    // SAFETY: allocated above with the same layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    let _ = std::fs::remove_file(&path);
    json!({ "iterations": iters, "elapsed_s": elapsed, "pid": std::process::id() })
}

/// `n` fork + immediate _exit, as fast as one thread can: a burst of process events.
pub fn forkstorm(n: u64, go_file: Option<&std::path::Path>) -> Value {
    if let Some(g) = go_file {
        while !g.exists() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: the child only calls _exit; the parent reaps it.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                libc::_exit(0);
            }
            if pid > 0 {
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
    }
    let s = t.elapsed().as_secs_f64();
    json!({ "forks": n, "seconds": s, "forks_per_s": n as f64 / s })
}

fn rss_kb() -> u64 {
    procfs::process::Process::myself()
        .and_then(|p| p.stat())
        .map(|s| s.rss * (procfs::page_size() / 1024))
        .unwrap_or(0)
}

/// A typical mix of kernel events as they reach the recorder.
fn synthetic(i: u64, t: u64) -> Event {
    let comm = comm_from(if i.is_multiple_of(3) {
        "python3"
    } else {
        "pt_data_worker"
    });
    let detail = match i % 10 {
        0..=3 => Detail::Block {
            dev: 259 << 20,
            error: 0,
            sector: i * 8,
            latency_us: 60_000 + (i % 1000) as u32,
            nr_sector: 8,
            rwbs: *b"WS\0\0\0\0",
        },
        4..=5 => Detail::Fork {
            child_pid: (i % 60_000) as u32,
            child_comm: comm,
            tid: 0,
        },
        6..=7 => Detail::Exit {
            code: 0,
            signal: 0,
            tid: 0,
            core_dumped: false,
        },
        8 => Detail::Signal {
            sig: 9,
            code: 0,
            target_pid: 77,
            result: 0,
            target_comm: comm,
            tid: 0,
        },
        _ => Detail::Kmsg(Kmsg::new(
            "nvme nvme0: I/O 123 QID 4 timeout, completion polled",
            None,
            None,
        )),
    };
    Event::new(
        t,
        1000 + (i % 64) as u32,
        1000 + (i % 64) as u32,
        comm,
        i.is_multiple_of(2),
        detail,
    )
}

/// Recorder bytes per event and process RSS after `n` events (a 10-minute window at 1 k/s is
/// 600 000 events; the time window is simulated by the event timestamps).
pub fn memory(n: u64) -> Value {
    let rss0 = rss_kb();
    let mut r = Recorder::new(600 * 1_000_000_000, 256 << 20);
    let t0 = monotonic_ns();
    for i in 0..n {
        // 1 k events/s: event i is i ms after the start.
        r.push(synthetic(i, t0 + i * 1_000_000));
    }
    r.expire(t0 + n * 1_000_000);
    json!({
        "events": r.len(),
        "recorder_bytes": r.bytes(),
        "bytes_per_event": r.bytes() as f64 / r.len().max(1) as f64,
        "rss_kb_before": rss0,
        "rss_kb_after": rss_kb(),
        "event_struct_bytes": std::mem::size_of::<Event>(),
    })
}

/// Userspace drain rate: decode + recorder push of recorded ring-buffer records.
pub fn drain(n: u64) -> Value {
    use nantrace_common::*;
    let mut hdr = EventHeader {
        kind: EventKind::Exit as u32,
        flags: FLAG_JOB,
        ts_ns: 1,
        pid: 42,
        tid: 42,
        comm: [b'x'; 16],
    };
    let exit = ExitEvent {
        hdr,
        code: 0,
        signal: 0,
        core_dumped: 0,
        _pad: 0,
    };
    hdr.kind = EventKind::Block as u32;
    let block = BlockEvent {
        hdr,
        dev: 7 << 20,
        error: 0,
        sector: 8,
        latency_ns: 1000,
        nr_sector: 8,
        _pad: 0,
        rwbs: [b'W'; 16],
    };
    // SAFETY: padding-free #[repr(C)] structs viewed as bytes.
    let rec_exit = unsafe {
        std::slice::from_raw_parts(
            (&raw const exit).cast::<u8>(),
            std::mem::size_of::<ExitEvent>(),
        )
    }
    .to_vec();
    // SAFETY: as above.
    let rec_block = unsafe {
        std::slice::from_raw_parts(
            (&raw const block).cast::<u8>(),
            std::mem::size_of::<BlockEvent>(),
        )
    }
    .to_vec();
    let mut r = Recorder::new(u64::MAX, 1 << 30);
    let t = Instant::now();
    for i in 0..n {
        let rec = if i % 2 == 0 { &rec_exit } else { &rec_block };
        if let Ok(e) = crate::decode::decode(rec) {
            r.push(e);
        }
    }
    let s = t.elapsed().as_secs_f64();
    json!({ "events": n, "seconds": s, "events_per_s": n as f64 / s })
}

/// Trigger-to-bundle-on-disk time with `n` events in the window (timeline, logs, report,
/// trace, HTML; the snapshot is taken at the trigger, before this clock starts).
pub fn dump(n: u64, out: &std::path::Path) -> Value {
    let t0 = monotonic_ns();
    let mut r = Recorder::new(u64::MAX, 1 << 30);
    for i in 0..n {
        let e = if i % 50 == 0 {
            Event::new(
                t0 + i * 1000,
                1,
                1,
                comm_from("python3"),
                true,
                Detail::Log(Box::new(LogLine {
                    text: format!("step {i} | loss 2.{}", i % 1000).into(),
                    stream: 1,
                    nonfinite: false,
                    step: Some(i),
                    loss: Some(2.0),
                    loss_scale: None,
                    overflow: false,
                    fault: None,
                })),
            )
        } else {
            synthetic(i, t0 + i * 1000)
        };
        r.push(e);
    }
    let host = crate::bundle::Host::read();
    let clock = ClockMap::sample();
    let trig = vec![crate::trigger::Fired {
        kind: crate::trigger::TriggerKind::Manual,
        mono_ns: t0 + n * 1000,
        reason: "benchmark".into(),
    }];
    let job = crate::bundle::JobInfo::default();
    let snapshot = json!({ "gpu": { "available": false, "reason": "benchmark" } });
    // NANTRACE_BENCH_PROFILE=1: print the time of each stage (how the dump was profiled).
    if std::env::var_os("NANTRACE_BENCH_PROFILE").is_some() {
        let ev = r.sorted();
        let ev: Vec<&crate::event::Event> = ev.iter().collect();
        let inc = crate::bundle::Incident {
            host: &host,
            clock: &clock,
            triggers: &trig,
            job: &job,
            accounting: json!({}),
            events: &ev,
            window_pre_s: 600.0,
            post_s: 0.0,
            flight_copies: &[],
        };
        let t = Instant::now();
        let tl = crate::bundle::timeline(&inc);
        eprintln!("timeline {:?}", t.elapsed());
        let t = Instant::now();
        let a = crate::report::analyze(&tl, &snapshot);
        eprintln!("analyze {:?}", t.elapsed());
        let t = Instant::now();
        let _ = crate::report::markdown(&a, &tl);
        eprintln!("markdown {:?}", t.elapsed());
        let t = Instant::now();
        let tr = crate::export::perfetto::trace(&tl);
        eprintln!("trace {:?}", t.elapsed());
        let t = Instant::now();
        let _ = serde_json::to_vec(&tr);
        eprintln!("trace ser {:?}", t.elapsed());
        let t = Instant::now();
        let _ = crate::export::html::render(&a, &tl, &snapshot);
        eprintln!("html {:?}", t.elapsed());
        let t = Instant::now();
        let _ = crate::bundle::app_log(&inc);
        let _ = crate::bundle::kernel_log(&inc);
        eprintln!("logs {:?}", t.elapsed());
    }
    let start = Instant::now();
    let lanes = r.take_lanes();
    let events = Recorder::by_time(&lanes);
    let inc = crate::bundle::Incident {
        host: &host,
        clock: &clock,
        triggers: &trig,
        job: &job,
        accounting: json!({}),
        events: &events,
        window_pre_s: 600.0,
        post_s: 0.0,
        flight_copies: &[],
    };
    let w = crate::bundle::write(out, &inc, &snapshot, crate::export::derived);
    let s = start.elapsed().as_secs_f64();
    let size: u64 = w
        .as_ref()
        .ok()
        .and_then(|w| std::fs::read_dir(&w.dir).ok())
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    if let Ok(w) = &w {
        let _ = std::fs::remove_dir_all(&w.dir);
    }
    json!({ "events": n, "seconds": s, "bundle_bytes": size, "error": w.err().map(|e| e.to_string()) })
}

/// Every loaded BPF program with the kernel's run statistics (kernel.bpf_stats_enabled=1).
pub fn bpf_stats() -> Value {
    let progs: Vec<Value> = aya::programs::loaded_programs()
        .flatten()
        .map(|p| json!({ "id": p.id(), "name": p.name_as_str().unwrap_or(""), "run_time_ns": p.run_time().as_nanos() as u64, "run_cnt": p.run_count() }))
        .collect();
    json!(progs)
}

/// `bench-internal floor`: only the do-nothing programs, on every tracepoint nantrace uses,
/// until `go_file` disappears (or SIGTERM). The benchmark reads their run statistics.
pub fn floor(go_file: Option<&std::path::Path>) -> anyhow::Result<Value> {
    let opts = crate::probes::Options {
        bench: crate::probes::BenchPrograms::FloorOnly,
        ..crate::probes::Options::default()
    };
    let p = crate::probes::Probes::load(&opts)?;
    eprintln!("nantrace: floor programs attached: {}", p.attached());
    match go_file {
        Some(g) => {
            while g.exists() {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        None => std::thread::sleep(std::time::Duration::from_secs(3600)),
    }
    Ok(json!({ "floor_programs": p.attached() }))
}

/// `bench-internal microcost`: what each building block of a probe costs here (see
/// `probes::MICRO`), each alone on getppid while this process calls it `n` times.
pub fn microcost(n: u64) -> anyhow::Result<Value> {
    const STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let before = std::fs::read_to_string(STATS).unwrap_or_default();
    std::fs::write(STATS, "1")?;
    let mut work = || {
        for _ in 0..n {
            // SAFETY: getppid has no arguments and cannot fail.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
    };
    let r = crate::probes::microcost(&mut work);
    if before.trim() != "1" {
        let _ = std::fs::write(STATS, before.trim());
    }
    let rows: Vec<Value> = r?
        .into_iter()
        .map(|(p, runs, ns)| {
            let what = crate::probes::MICRO
                .iter()
                .find(|m| m.0 == p)
                .map_or("", |m| m.1);
            json!({ "program": p, "what": what, "runs": runs, "ns_per_run": ns })
        })
        .collect();
    Ok(json!(rows))
}

/// `bench-internal nvml-cost` (`--seconds`) and `cuda-steps` (`--seconds`, `--n`: FMA
/// iterations per element): see `gpucheck::bench`.
pub fn gpu(what: &str, seconds: f64, n: u64) -> Value {
    use crate::gpucheck::bench;
    match what {
        "nvml-cost" => bench::nvml_cost(seconds),
        _ => bench::cuda_steps(0, seconds, u32::try_from(n).unwrap_or(u32::MAX)),
    }
}

/// `bench-internal membership`: the membership test of a process outside every job, the old
/// hash (seeded with 4096 other pids) against the `JOB_MAP` byte, side by side on exec,
/// exit_group and block issue while this process runs the workload `n` iterations (twice).
pub fn membership(n: u64, dir: &std::path::Path) -> anyhow::Result<Value> {
    const STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let before = std::fs::read_to_string(STATS).unwrap_or_default();
    std::fs::write(STATS, "1")?;
    let mut work = || {
        workload(n as u32, 0, dir, None);
    };
    let r = crate::probes::membership_ab(4096, &mut work);
    if before.trim() != "1" {
        let _ = std::fs::write(STATS, before.trim());
    }
    let r = r?;
    let ns = |p: &str| r.iter().find(|x| x.0 == p).map(|x| (x.1, x.2));
    let rows: Vec<Value> = crate::probes::MEMBERSHIP_AB
        .iter()
        .map(|&(tp, h, b)| {
            let (hr, hn) = ns(h).unwrap_or((0, f64::NAN));
            let (br, bn) = ns(b).unwrap_or((0, f64::NAN));
            json!({ "tracepoint": tp, "hash_program": h, "byte_program": b, "runs": hr.min(br), "hash_ns_per_run": hn, "byte_ns_per_run": bn })
        })
        .collect();
    Ok(json!({ "iterations": n, "hash_seeded_pids": 4096, "rows": rows }))
}
