//! `nantrace demo`: a tiny training job that ships with nantrace and really diverges.
//!
//! The job fits y = 3x + 1 by SGD in f32 with a learning-rate schedule that keeps growing (the
//! classic warmup bug). Past lr ≈ 2/E[x²] the weights blow up, the loss overflows to inf and
//! then becomes NaN (inf − inf): the NaN comes from the arithmetic, not from a print statement.
//! It logs like a real loop (step, loss, lr, a simulated fp16 loss scale with overflow
//! messages), forks a data-loader worker, and exits 1 when the loss is NaN.
use std::io::Write as _;
use std::time::Duration;

pub mod multinode;

/// Scenarios: what fault (if any) is injected through real kernel mechanisms before the NaN.
pub const SCENARIOS: &[&str] = &["numeric", "xid", "oom", "net", "io", "ecc"];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32) / ((1u64 << 24) as f32)
    }
}

/// The training loop (runs as the child `nantrace demo-train`).
pub fn train(scenario: &str, step_ms: u64) -> i32 {
    let me = std::env::current_exe().unwrap_or_else(|_| "nantrace".into());
    // A data-loader worker, as PyTorch's DataLoader forks them.
    let mut worker = std::process::Command::new(&me)
        .arg("demo-worker")
        .spawn()
        .ok();
    let (mut w, mut b) = (0.0f32, 0.0f32);
    let mut lr = 0.01f32;
    let mut scale = 2048.0f32;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let out = std::io::stdout();
    let mut nan_steps = 0;
    let mut injected: Option<inject::Cleanup> = None;
    println!(
        "demo: fitting y = 3x + 1 with SGD (f32), lr warmup without a cap; scenario={scenario}"
    );
    for step in 1..=400u32 {
        if step > 30 {
            lr *= 1.08;
        }
        let (mut gw, mut gb, mut loss) = (0.0f32, 0.0f32, 0.0f32);
        for _ in 0..32 {
            let x = rng.next() * 20.0 - 10.0;
            let y = 3.0 * x + 1.0 + (rng.next() - 0.5) * 0.1;
            let err = w * x + b - y;
            loss += err * err / 32.0;
            gw += 2.0 * err * x / 32.0;
            gb += 2.0 * err / 32.0;
        }
        // Simulated fp16 dynamic loss scaling: the scaled loss must fit in fp16.
        if (loss * scale).is_finite() && loss * scale > 65504.0 && scale > 1.0 {
            scale /= 2.0;
            println!(
                "gradient overflow detected, ignoring gradient, setting loss scale to: {scale:.1}"
            );
        }
        w -= lr * gw;
        b -= lr * gb;
        let mut l = out.lock();
        let _ = writeln!(
            l,
            "step {step} | loss {loss:.4} | lr {lr:.3e} | loss_scale {scale:.1} | grad_norm {:.3}",
            (gw * gw + gb * gb).sqrt()
        );
        let _ = l.flush();
        drop(l);
        if Some(step) == inject::step(scenario) {
            match inject::run(scenario, &me) {
                Ok((what, cleanup)) => {
                    eprintln!("demo: INJECTED {what}");
                    injected = cleanup;
                    if scenario == "ecc" {
                        // What PyTorch prints when the next CUDA call meets the ECC error.
                        std::thread::sleep(Duration::from_millis(300));
                        eprintln!("Traceback (most recent call last):");
                        eprintln!("  File \"train.py\", line 212, in <module>");
                        eprintln!("    loss.backward()");
                        eprintln!("RuntimeError: CUDA error: uncorrectable ECC error encountered");
                        eprintln!("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.");
                        eprintln!("For debugging consider passing CUDA_LAUNCH_BLOCKING=1.");
                        if let Some(wk) = worker.as_mut() {
                            let _ = wk.kill();
                            let _ = wk.wait();
                        }
                        return 1;
                    }
                }
                Err(e) => eprintln!("demo: could not inject the {scenario} fault ({e}); running as plain numeric divergence"),
            }
        }
        if loss.is_nan() {
            nan_steps += 1;
            if nan_steps >= 3 {
                eprintln!("RuntimeError: loss is NaN at step {step}, stopping training");
                drop(injected.take());
                if let Some(wk) = worker.as_mut() {
                    let _ = wk.kill();
                    let _ = wk.wait();
                }
                return 1;
            }
        }
        std::thread::sleep(Duration::from_millis(step_ms));
    }
    if let Some(wk) = worker.as_mut() {
        let _ = wk.kill();
        let _ = wk.wait();
    }
    0
}

/// The demo's data-loader worker: idles like a worker waiting for work, until killed.
pub fn worker() -> i32 {
    set_comm(c"pt_data_worker");
    for _ in 0..600 {
        std::thread::sleep(Duration::from_millis(100));
    }
    0
}

/// Faults caused through real kernel mechanisms for the demo scenarios (root only).
mod inject {
    use std::io::Write as _;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd as _;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// The step at which a scenario injects its fault.
    pub fn step(scenario: &str) -> Option<u32> {
        match scenario {
            "net" => Some(10),
            "io" => Some(15),
            "oom" | "xid" | "ecc" => Some(25),
            _ => None,
        }
    }

    /// Inject the scenario's fault; returns what was done and what undoes it.
    pub fn run(scenario: &str, me: &Path) -> Result<(&'static str, Option<Cleanup>), String> {
        Ok(match scenario {
            "xid" => {
                let line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=nantrace-demo, GPU has fallen off the bus. [INJECTED by nantrace demo --scenario xid]";
                std::fs::write("/dev/kmsg", format!("{line}\n")).map_err(|e| format!("/dev/kmsg: {e}"))?;
                ("a fake NVRM Xid 79 line into the kernel log (/dev/kmsg)", None)
            }
            "ecc" => {
                let line = "NVRM: Xid (PCI:0000:3b:00): 48, pid=0, name=nantrace-demo, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0. [INJECTED by nantrace demo --scenario ecc]";
                std::fs::write("/dev/kmsg", format!("{line}\n")).map_err(|e| format!("/dev/kmsg: {e}"))?;
                ("a fake NVRM Xid 48 line into the kernel log; the job then fails like PyTorch does and exits 1", None)
            }
            "oom" => ("memory pressure: a data-loader worker in a 64 MiB cgroup will be OOM-killed", Some(oom(me)?)),
            "net" => ("packet loss: 12 TCP connections across a veth pair, all packets dropped by nftables", Some(net()?)),
            "io" => ("a disk stall: a worker writes through a loop device whose backing disk is throttled to 64 KiB/s for its cgroup", Some(io(me)?)),
            other => return Err(format!("no fault for scenario {other}")),
        })
    }

    /// Undoes an injection when dropped.
    pub struct Cleanup {
        cgroup: Option<PathBuf>,
        child: Option<std::process::Child>,
        netns: Vec<String>,
        _conns: Vec<TcpStream>,
        loopdev: Option<(String, PathBuf)>,
    }

    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Some(c) = self.child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            if let Some(cg) = &self.cgroup {
                for _ in 0..20 {
                    if std::fs::remove_dir(cg).is_ok() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
            }
            for ns in &self.netns {
                let _ = Command::new("ip").args(["netns", "del", ns]).status();
            }
            if let Some((dev, img)) = &self.loopdev {
                let _ = Command::new("losetup").args(["-d", dev]).status();
                let _ = std::fs::remove_file(img);
            }
        }
    }

    fn sh(args: &[&str]) -> Result<(), String> {
        let o = Command::new(args[0])
            .args(&args[1..])
            .output()
            .map_err(|e| format!("{}: {e}", args[0]))?;
        if o.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{:?}: {}",
                args,
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
    }

    /// A worker whose O_DIRECT writes to a loop device (direct-io backing file) are throttled
    /// at the backing disk by its blkio cgroup: each loop request waits for the throttle.
    pub fn io(me: &Path) -> Result<Cleanup, String> {
        use std::os::unix::fs::MetadataExt as _;
        let pid = std::process::id();
        let img = PathBuf::from(format!("/var/tmp/nantrace-demo-io-{pid}.img"));
        let f = std::fs::File::create(&img).map_err(|e| format!("{}: {e}", img.display()))?;
        f.set_len(64 << 20).map_err(|e| e.to_string())?;
        let dev = std::fs::metadata(&img).map_err(|e| e.to_string())?.dev();
        let (maj, min) = (libc::major(dev), libc::minor(dev));
        let o = Command::new("losetup")
            .args(["--find", "--show", "--direct-io=on"])
            .arg(&img)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !o.status.success() {
            let _ = std::fs::remove_file(&img);
            return Err(format!(
                "losetup: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        let loopdev = String::from_utf8_lossy(&o.stdout).trim().to_string();
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "io"));
        let name = format!("nantrace-demo-io-{pid}");
        let cg = if v2 {
            PathBuf::from("/sys/fs/cgroup").join(&name)
        } else {
            PathBuf::from("/sys/fs/cgroup/blkio").join(&name)
        };
        let mut c = Cleanup {
            cgroup: None,
            child: None,
            netns: Vec::new(),
            _conns: Vec::new(),
            loopdev: Some((loopdev.clone(), img)),
        };
        if v2 {
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+io");
        }
        std::fs::create_dir_all(&cg).map_err(|e| format!("{}: {e}", cg.display()))?;
        c.cgroup = Some(cg.clone());
        let (file, rule) = if v2 {
            ("io.max", format!("{maj}:{min} wbps=65536"))
        } else {
            (
                "blkio.throttle.write_bps_device",
                format!("{maj}:{min} 65536"),
            )
        };
        std::fs::write(cg.join(file), &rule).map_err(|e| format!("{file} {rule}: {e}"))?;
        c.child = Some(
            Command::new(me)
                .arg("demo-io-writer")
                .arg(&loopdev)
                .arg(cg.join("cgroup.procs"))
                .spawn()
                .map_err(|e| e.to_string())?,
        );
        Ok(c)
    }

    /// A worker in a 64 MiB memory cgroup that allocates until the OOM killer takes it.
    pub fn oom(me: &Path) -> Result<Cleanup, String> {
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
        let name = format!("nantrace-demo-{}", std::process::id());
        let cg = if v2 {
            PathBuf::from("/sys/fs/cgroup").join(&name)
        } else {
            PathBuf::from("/sys/fs/cgroup/memory").join(&name)
        };
        if v2 {
            // Children only get the controller when the parent delegates it.
            let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory");
        }
        std::fs::create_dir_all(&cg).map_err(|e| format!("{}: {e}", cg.display()))?;
        let limit = (64u64 << 20).to_string();
        if v2 {
            std::fs::write(cg.join("memory.max"), &limit).map_err(|e| e.to_string())?;
            let _ = std::fs::write(cg.join("memory.swap.max"), "0");
        } else {
            std::fs::write(cg.join("memory.limit_in_bytes"), &limit).map_err(|e| e.to_string())?;
            let _ = std::fs::write(cg.join("memory.memsw.limit_in_bytes"), &limit);
        }
        let child = Command::new(me)
            .arg("demo-hog")
            .arg(cg.join("cgroup.procs"))
            .spawn()
            .map_err(|e| e.to_string())?;
        Ok(Cleanup {
            cgroup: Some(cg),
            child: Some(child),
            netns: Vec::new(),
            _conns: Vec::new(),
            loopdev: None,
        })
    }

    fn in_ns<T: Send + 'static>(
        ns: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        let path = format!("/var/run/netns/{ns}");
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
            // SAFETY: setns on this thread only, with a valid namespace fd.
            if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!("setns {path}: {}", std::io::Error::last_os_error()));
            }
            Ok(f())
        })
        .join()
        .map_err(|_| "namespace thread panicked".to_string())?
    }

    /// 12 TCP connections across a veth pair whose far end then drops every packet.
    pub fn net() -> Result<Cleanup, String> {
        let tag = std::process::id() % 100_000;
        let (a, b) = (format!("ntdemo-a{tag}"), format!("ntdemo-b{tag}"));
        let mut c = Cleanup {
            cgroup: None,
            child: None,
            netns: vec![a.clone(), b.clone()],
            _conns: Vec::new(),
            loopdev: None,
        };
        sh(&["ip", "netns", "add", &a])?;
        sh(&["ip", "netns", "add", &b])?;
        sh(&[
            "ip",
            "link",
            "add",
            &format!("nda{tag}"),
            "netns",
            &a,
            "type",
            "veth",
            "peer",
            "name",
            &format!("ndb{tag}"),
            "netns",
            &b,
        ])?;
        sh(&[
            "ip",
            "-n",
            &a,
            "addr",
            "add",
            "10.214.0.1/24",
            "dev",
            &format!("nda{tag}"),
        ])?;
        sh(&[
            "ip",
            "-n",
            &b,
            "addr",
            "add",
            "10.214.0.2/24",
            "dev",
            &format!("ndb{tag}"),
        ])?;
        sh(&["ip", "-n", &a, "link", "set", &format!("nda{tag}"), "up"])?;
        sh(&["ip", "-n", &b, "link", "set", &format!("ndb{tag}"), "up"])?;
        let listener =
            in_ns(&b, || TcpListener::bind(("10.214.0.2", 29500)))?.map_err(|e| e.to_string())?;
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in listener.incoming().flatten() {
                held.push(s);
            }
        });
        let conns = in_ns(&a, || {
            (0..12)
                .map(|_| TcpStream::connect(("10.214.0.2", 29500)))
                .collect::<Result<Vec<_>, _>>()
        })?
        .map_err(|e| e.to_string())?;
        sh(&[
            "ip", "netns", "exec", &b, "nft", "add", "table", "inet", "ntdemo",
        ])?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &b,
            "nft",
            "add",
            "chain",
            "inet",
            "ntdemo",
            "in",
            "{ type filter hook input priority 0; }",
        ])?;
        sh(&[
            "ip", "netns", "exec", &b, "nft", "add", "rule", "inet", "ntdemo", "in", "tcp",
            "dport", "29500", "drop",
        ])?;
        for mut s in conns {
            let _ = s.write_all(&[0u8; 512]);
            c._conns.push(s);
        }
        Ok(c)
    }
}

/// The OOM scenario's victim: joins the cgroup named by `procs`, then allocates until killed.
fn set_comm(name: &std::ffi::CStr) {
    // SAFETY: PR_SET_NAME with a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
}

pub fn hog(procs: &str) -> i32 {
    set_comm(c"pt_data_worker");
    if let Err(e) = std::fs::write(procs, std::process::id().to_string()) {
        eprintln!("demo-hog: {procs}: {e}");
        return 1;
    }
    let mut held: Vec<Vec<u8>> = Vec::new();
    loop {
        held.push(vec![1u8; 4 << 20]);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The io scenario's worker: joins the throttled cgroup, then writes 64 KiB O_DIRECT blocks
/// to the loop device until killed.
pub fn io_writer(dev: &str, procs: &str) -> i32 {
    use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
    set_comm(c"pt_data_worker");
    if let Err(e) = std::fs::write(procs, std::process::id().to_string()) {
        eprintln!("demo-io-writer: {procs}: {e}");
        return 1;
    }
    let f = match std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
        .open(dev)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("demo-io-writer: {dev}: {e}");
            return 1;
        }
    };
    let layout = std::alloc::Layout::from_size_align(64 << 10, 4096).unwrap();
    // SAFETY: aligned allocation for O_DIRECT; lives until the process is killed.
    let buf = unsafe { std::slice::from_raw_parts(std::alloc::alloc_zeroed(layout), 64 << 10) };
    let mut off = 0u64;
    loop {
        let _ = f.write_all_at(buf, off);
        off = (off + (64 << 10)) % (32 << 20);
    }
}
