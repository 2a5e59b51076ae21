//! `cargo xtask vm-test`: the kernel matrix. Boots each kernel of [`KERNELS`] (Debian's own
//! packages, cached) in QEMU and runs inside it `nantrace doctor` and the kernel integration
//! tests (`kernel_log`, `kernel_membership`, `kernel_events`, `incident` on the BTF path;
//! `kernel_membership` and `kernel_events` again on the tracefs fallback), with the very binaries built here: the guest mounts the host's
//! root read-only over 9p (scripts/vm/). Prints a table per kernel and fails when a test
//! fails or a kernel differs from what [`KERNELS`] says it can do (which probes run on the
//! tracefs path and why, where the kernel log comes from).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{root, run};

mod console;
mod outcome;
mod table;

use outcome::Outcome;
use table::{now_utc, table};

/// One kernel of the matrix and what it is expected to do.
pub struct Kernel {
    pub label: &'static str,
    pub suite: &'static str,
    /// `linux-image-amd64` (what the suite's metapackage points at) or an anchored regex of
    /// package names (the highest version).
    pub spec: &'static str,
    /// Probes that must run on the tracefs path on this kernel, each with words of the reason
    /// `doctor` must give (a kernel feature, never a verifier refusal). Every other probe with
    /// a BTF program must be on BTF.
    pub tracefs: &'static [(&'static str, &'static str)],
    /// Where the kernel log must come from: `printk:console` or `/dev/kmsg`.
    pub klog: &'static str,
}

pub const KERNELS: &[Kernel] = &[
    Kernel {
        label: "5.10-bullseye",
        suite: "bullseye",
        spec: "linux-image-amd64",
        tracefs: &[
            ("block:block_rq_issue", "request_queue.disk"),
            ("block:block_rq_complete", "request_queue.disk"),
        ],
        klog: "/dev/kmsg",
    },
    Kernel {
        label: "6.1-bookworm",
        suite: "bookworm",
        spec: "linux-image-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
    Kernel {
        label: "6.12-trixie",
        suite: "trixie",
        spec: "linux-image-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
    Kernel {
        label: "6.18-trixie-bpo",
        suite: "trixie-backports",
        spec: r"linux-image-6\.18\.[0-9]+\+deb13-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
    Kernel {
        label: "7.x-trixie-bpo",
        suite: "trixie-backports",
        spec: "linux-image-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
];

/// Modules the guest loads (with their dependencies) where the kernel builds them as modules:
/// 9p for the host's root, loop for block I/O, veth and nf_tables for the TCP retransmit test.
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "loop",
    "veth",
    "crc32c_generic",
    "nf_tables",
];

/// Test suites run in the guest: (path, test target), every test of each (none is kept to the
/// host: the last three that were, for hangs and sleeps under TCG, were fixed at their cause;
/// docs/kernel-matrix.md).
const SUITES: &[(&str, &str)] = &[
    ("btf", "kernel_log"),
    ("btf", "kernel_membership"),
    ("btf", "kernel_events"),
    ("btf", "incident"),
    ("tracefs", "kernel_membership"),
    ("tracefs", "kernel_events"),
];

pub struct Args {
    pub kernels: Option<String>,
    pub docs: bool,
}

fn cache() -> PathBuf {
    std::env::var_os("NANTRACE_VM_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/nantrace-vm"), PathBuf::from)
}

/// The test executables cargo built for `targets`, by target name.
fn test_binaries(targets: &[&str]) -> Result<BTreeMap<String, PathBuf>> {
    let mut c = Command::new("cargo");
    c.current_dir(root()).args([
        "test",
        "--locked",
        "-p",
        "nantrace",
        "--no-run",
        "--message-format=json",
    ]);
    for t in targets {
        c.args(["--test", t]);
    }
    let o = c
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !o.status.success() {
        bail!("cargo test --no-run failed");
    }
    let mut out = BTreeMap::new();
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let (Some(exe), Some(name)) = (v["executable"].as_str(), v["target"]["name"].as_str()) {
            if v["target"]["kind"][0] == "test" {
                out.insert(name.to_string(), PathBuf::from(exe));
            }
        }
    }
    for t in targets {
        if !out.contains_key(*t) {
            bail!("cargo built no test binary for {t}");
        }
    }
    Ok(out)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Fetch the kernel (cached), write the guest's files into `dir`, boot it, read back what it
/// left.
fn run_kernel(
    k: &Kernel,
    dir: &Path,
    nt: &Path,
    bins: &BTreeMap<String, PathBuf>,
) -> Result<Outcome> {
    let kdir = cache().join("kernels").join(k.label);
    let mut fetch = Command::new("bash");
    fetch
        .arg(root().join("scripts/vm/fetch-kernel.sh"))
        .arg(cache())
        .args([k.label, k.suite, k.spec])
        .args(MODULES);
    run(&mut fetch).with_context(|| format!("fetching the {} kernel", k.label))?;
    let package = read(&kdir.join("package")).trim().to_string();
    prepare_guest(k, dir, nt, bins)?;
    let t0 = Instant::now();
    let st = Command::new("bash")
        .arg(root().join("scripts/vm/boot.sh"))
        .arg(&kdir)
        .arg(dir)
        .arg("1500")
        .status()?;
    let mut o = Outcome {
        package,
        wall_s: t0.elapsed().as_secs_f64(),
        ..Outcome::default()
    };
    if !st.success() {
        o.problems.push(format!("qemu: {st}"));
    }
    o.read_guest(k, dir);
    Ok(o)
}

/// A fresh `dir` with the guest's script and its vm.env: the binaries to run and what the
/// kernel is expected to put on tracefs.
fn prepare_guest(
    k: &Kernel,
    dir: &Path,
    nt: &Path,
    bins: &BTreeMap<String, PathBuf>,
) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    std::fs::copy(root().join("scripts/vm/guest.sh"), dir.join("guest.sh"))?;
    let tests: Vec<String> = SUITES
        .iter()
        .map(|(path, t)| format!("{path}:{t}:{}", bins[*t].display()))
        .collect();
    let expect_tracefs: Vec<&str> = k.tracefs.iter().map(|(t, _)| *t).collect();
    std::fs::write(
        dir.join("vm.env"),
        format!(
            "NT={}\nREPO={}\nTESTS=\"{}\"\nTEST_TIMEOUT=360\nexport NANTRACE_EXPECT_TRACEFS=\"{}\"\n",
            nt.display(),
            root().display(),
            tests.join(" "),
            expect_tracefs.join(",")
        ),
    )?;
    Ok(())
}

/// The kernels `--kernels` names (comma-separated labels), or all of them.
fn selected(kernels: Option<&str>) -> Result<Vec<&'static Kernel>> {
    let Some(list) = kernels else {
        return Ok(KERNELS.iter().collect());
    };
    let want: Vec<&str> = list.split(',').collect();
    let ks: Vec<&Kernel> = KERNELS.iter().filter(|k| want.contains(&k.label)).collect();
    if ks.len() != want.len() {
        bail!(
            "unknown kernel in {list}; known: {}",
            KERNELS
                .iter()
                .map(|k| k.label)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(ks)
}

/// A problem in a few lines: its first and its last three.
fn gist(p: &str) -> String {
    p.lines()
        .take(1)
        .chain(
            p.lines()
                .rev()
                .take(3)
                .collect::<Vec<_>>()
                .into_iter()
                .rev(),
        )
        .collect::<Vec<_>>()
        .join("\n      ")
}

/// One kernel's run, in `base`/LABEL, and a second boot (`base`/LABEL-second-boot) when the
/// first died of an emulator failure nantrace knows.
fn run_kernel_twice_if_emulator(
    k: &Kernel,
    base: &Path,
    nt: &Path,
    bins: &BTreeMap<String, PathBuf>,
) -> Result<Outcome> {
    let o = run_kernel(k, &base.join(k.label), nt, bins)?;
    // A guest that died of a named emulator failure (`console::emulator_signature`: 6.18's
    // "Oops: int3" in syscall_trace_enter once under multi-threaded TCG) boots once more. If
    // the second boot passes, the first is reported FLAKY with the end of its console, never
    // hidden; if not, both boots' problems stand. A hang or a timeout is a failure at once.
    let signature = if o.finished {
        None
    } else {
        console::emulator_signature(
            &std::fs::read_to_string(base.join(k.label).join("serial.log")).unwrap_or_default(),
        )
    };
    if !o.finished && signature.is_none() {
        eprintln!(
            "xtask: vm-test: {}: the guest did not finish, and its console shows no emulator failure nantrace knows: a failure, not booted again",
            k.label
        );
    }
    let Some(sig) = signature else {
        return Ok(o);
    };
    let first: Vec<String> = o.problems.iter().map(|p| gist(p)).collect();
    eprintln!(
        "xtask: vm-test: {}: the guest died of {sig}; booting it once more: {}",
        k.label,
        first.join("; ")
    );
    // A test's wrong answer before the guest died stands, whatever the second boot says.
    let wrong = o.problems.iter().any(|p| p.contains(" FAILED"));
    let mut again = run_kernel(k, &base.join(format!("{}-second-boot", k.label)), nt, bins)?;
    if again.problems.is_empty() && !wrong {
        again.flaky.insert(
            0,
            format!(
                "the first boot died of {sig} (its logs: {}): {}",
                base.join(k.label).display(),
                first.join("; ")
            ),
        );
    } else {
        again
            .problems
            .extend(first.into_iter().map(|p| format!("first boot: {p}")));
    }
    Ok(again)
}

/// What every QEMU guest of the tests needs on the host (the matrix, the NFS VM, the cluster).
pub const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "xz-utils",
    "zstd",
    "kmod",
    "debian-archive-keyring",
];

pub fn vm_test(args: &Args, nt: &Path) -> Result<()> {
    crate::setup::apt_install(VM_PACKAGES)?;
    let selected = selected(args.kernels.as_deref())?;
    let bins = test_binaries(&[
        "kernel_log",
        "kernel_membership",
        "kernel_events",
        "incident",
    ])?;
    let base = root()
        .join("target/vm")
        .join(now_utc().replace([' ', ':'], "-"));
    let t0 = Instant::now();
    let mut rows = Vec::new();
    for k in selected {
        eprintln!("xtask: vm-test: {} ...", k.label);
        let o = run_kernel_twice_if_emulator(k, &base, nt, &bins)?;
        eprintln!(
            "xtask: vm-test: {}: {:.0} s, {}",
            k.label,
            o.wall_s,
            if o.problems.is_empty() {
                "ok".to_string()
            } else {
                o.problems.join("; ")
            }
        );
        for f in &o.flaky {
            eprintln!("xtask: vm-test: {}: FLAKY: {f}", k.label);
        }
        rows.push((k, o));
    }
    let t = table(&rows, t0.elapsed().as_secs_f64());
    println!("{t}");
    std::fs::write(base.join("table.md"), &t)?;
    eprintln!("xtask: vm-test: logs and table in {}", base.display());
    if args.docs {
        let doc = root().join("docs/kernel-matrix.md");
        let old = read(&doc);
        let head = old.split("<!-- table -->").next().unwrap_or("").to_string();
        std::fs::write(&doc, format!("{head}<!-- table -->\n{t}"))?;
        eprintln!("xtask: vm-test: wrote {}", doc.display());
    }
    let bad: usize = rows.iter().map(|(_, o)| o.problems.len()).sum();
    if bad > 0 {
        bail!("vm-test: {bad} problem(s) across the kernel matrix (table above)");
    }
    Ok(())
}
