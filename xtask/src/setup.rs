//! Toolchain setup for the eBPF build (see docs/toolchain.md and ../shared/TOOLCHAIN.md).
//!
//! Route A (preferred): rustup nightly pinned to one on LLVM 22 + rust-src, build-std=core.
//! Route B (fallback, no rustup servers): Debian's rustc-web on LLVM 22 with a prebuilt core
//! for bpfel. Both need bpf-linker 0.13 built against llvm-22.
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _, Result};

use crate::{root, run};

pub const NIGHTLY: &str = "nightly-2026-05-20";
pub const LLVM_MAJOR: &str = "22";
pub const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
pub const BPF_LINKER: &str = "0.13.0";

pub enum Route {
    Rustup,
    Debian,
}

fn output(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

pub(crate) fn apt_install(pkgs: &[&str]) -> Result<()> {
    let missing: Vec<&str> = pkgs
        .iter()
        .copied()
        .filter(|p| {
            output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .is_none_or(|s| !s.contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let sudo: &[&str] = if unsafe_euid() == 0 { &[] } else { &["sudo"] };
    let mut upd = Command::new(sudo.first().copied().unwrap_or("apt-get"));
    if sudo.is_empty() {
        upd.args(["update", "-q"]);
    } else {
        upd.args(["apt-get", "update", "-q"]);
    }
    run(&mut upd).context("apt-get update failed: check network access to the Debian mirrors")?;
    let mut inst = Command::new(sudo.first().copied().unwrap_or("apt-get"));
    if !sudo.is_empty() {
        inst.arg("apt-get");
    }
    // Wait for a dpkg lock held by another apt run rather than fail at once.
    inst.env("DEBIAN_FRONTEND", "noninteractive")
        .args([
            "-o",
            "DPkg::Lock::Timeout=300",
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
        ])
        .args(&missing);
    run(&mut inst).with_context(|| format!("apt-get install {missing:?} failed"))
}

fn unsafe_euid() -> u32 {
    extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: geteuid has no failure mode.
    unsafe { geteuid() }
}

fn nightly_ok() -> Result<bool> {
    let Some(v) = output(Command::new("rustc").arg(format!("+{NIGHTLY}")).arg("-vV")) else {
        return Ok(false);
    };
    let llvm = v
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .unwrap_or("?");
    if !llvm.starts_with(&format!("{LLVM_MAJOR}.")) {
        bail!("{NIGHTLY} uses LLVM {llvm}, but bpf-linker is built against LLVM {LLVM_MAJOR}: the eBPF link would fail with 'Invalid record'. Pin a nightly on LLVM {LLVM_MAJOR}.");
    }
    let sysroot = output(
        Command::new("rustc")
            .arg(format!("+{NIGHTLY}"))
            .args(["--print", "sysroot"]),
    )
    .unwrap_or_default();
    Ok(Path::new(sysroot.trim())
        .join("lib/rustlib/src/rust/library/core")
        .is_dir())
}

fn bpf_linker_ok() -> bool {
    output(Command::new("bpf-linker").arg("--version"))
        .is_some_and(|v| v.contains(BPF_LINKER.trim_end_matches(".0")))
}

/// Install what is missing; return the route the eBPF build will take.
pub fn setup() -> Result<Route> {
    // llvm-22-dev for bpf-linker; iproute2 and nftables for the network tests and demo.
    apt_install(&["llvm-22-dev", "iproute2", "nftables"])?;
    let route = if nightly_ok()? {
        Route::Rustup
    } else {
        let st = Command::new("rustup")
            .args([
                "toolchain",
                "install",
                NIGHTLY,
                "--profile",
                "minimal",
                "--component",
                "rust-src",
            ])
            .status();
        if matches!(st, Ok(s) if s.success()) && nightly_ok()? {
            Route::Rustup
        } else {
            eprintln!("xtask: rustup could not install {NIGHTLY} with rust-src; falling back to Debian's rustc-web (route B)");
            apt_install(&["rustc-web", "cargo-web", "libstd-rust-web-dev-bpf"]).context(
                "neither route works: install by hand either `rustup toolchain install nightly-2026-05-20 --component rust-src` \
                 or `apt-get install rustc-web cargo-web libstd-rust-web-dev-bpf`, then rerun",
            )?;
            Route::Debian
        }
    };
    if !bpf_linker_ok() {
        let cargo = match route {
            Route::Rustup => "cargo",
            Route::Debian => "cargo-web",
        };
        let mut c = Command::new(cargo);
        if matches!(route, Route::Rustup) {
            c.arg("+stable");
        }
        c.env("LLVM_PREFIX", LLVM_PREFIX).args([
            "install",
            "--locked",
            &format!("bpf-linker@{BPF_LINKER}"),
            "--no-default-features",
            "--features",
            "llvm-22",
        ]);
        run(&mut c).context("building bpf-linker failed (LLVM_PREFIX must point at llvm-22; /usr/bin/llvm-config is LLVM 14)")?;
    }
    Ok(route)
}

/// What the tests and the benchmark need beyond the build: a headless browser for the HTML
/// report test, bpftrace as the benchmark's peer, torch and py-spy for the real PyTorch job.
pub fn test_deps() -> Result<()> {
    apt_install(&["chromium", "bpftrace"])
        .context("installing chromium and bpftrace for the tests")?;
    torch_venv()?;
    old_agent()
}

/// The agent of an earlier version for `nantrace/tests/agent_versions.rs` (clusters upgrade
/// node by node, so agents of two versions share a job directory): main at
/// [`OLD_AGENT_COMMIT`], the last before incidents were numbered, built from this
/// repository's history into [`OLD_AGENT`] unless it is there. Outside the clone, so later
/// clones on the machine reuse it.
pub const OLD_AGENT_COMMIT: &str = "940e9bb87af1ea00c059db1c9e7a9a1d5f4a803e";
pub const OLD_AGENT: &str = "/var/cache/nantrace-tests/nantrace-940e9bb/nantrace";

/// Builds [`OLD_AGENT`] (its sources from `git archive`, its own target directory, removed
/// after: about 4 minutes here). As root only (the test that runs it is privileged).
pub fn old_agent() -> Result<()> {
    let bin = Path::new(OLD_AGENT);
    if bin.is_file() {
        return Ok(());
    }
    if unsafe_euid() != 0 {
        eprintln!("xtask: WARNING: not root: no agent of {OLD_AGENT_COMMIT} at {OLD_AGENT} (the mixed-version test will SKIP)");
        return Ok(());
    }
    let have = Command::new("git")
        .current_dir(root())
        .args(["cat-file", "-e", &format!("{OLD_AGENT_COMMIT}^{{commit}}")])
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        // Said, and left to the test, which fails with the same words in CI.
        eprintln!("xtask: WARNING: commit {OLD_AGENT_COMMIT} cannot be read from this clone (a shallow clone, a source tarball, or git refusing a clone another user owns): no agent of it at {OLD_AGENT}, the mixed-version test will FAIL; `git fetch --unshallow`, or set NANTRACE_OLD_AGENT");
        return Ok(());
    }
    let dir = bin.parent().unwrap();
    let src = dir.join("src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src)?;
    run(Command::new("bash").current_dir(root()).args([
        "-c",
        &format!("set -o pipefail; git archive {OLD_AGENT_COMMIT} | tar -x -C {}", src.display()),
    ]))?;
    run(Command::new("cargo")
        .current_dir(&src)
        .args(["xtask", "build"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTC")
        .env_remove("CARGO")
        .env_remove("NANTRACE_BPF_OBJ"))
    .with_context(|| format!("building the agent of {OLD_AGENT_COMMIT} for the mixed-version test"))?;
    let tmp = dir.join("nantrace.tmp");
    std::fs::copy(src.join("target/debug/nantrace"), &tmp)?;
    std::fs::rename(&tmp, bin)?;
    let _ = std::fs::remove_dir_all(&src);
    Ok(())
}

/// torch and py-spy from PyPI, pinned, for `nantrace/tests/torch_job.rs`.
pub const TORCH: &str = "torch==2.15.0";
pub const PYSPY: &str = "py-spy==0.4.3";
/// Where the venv lives: root-owned (nantrace runs py-spy only from a path only root can
/// write), outside the clone so that later clones on the machine reuse it.
pub const TORCH_VENV: &str = "/var/cache/nantrace-tests/torch-2.15.0-debian";
/// Debian's python: the test's ranks run as nobody, who cannot reach an interpreter under
/// /root (rustup's and pyenv's machines keep one there).
const PYTHON: &str = "/usr/bin/python3";

/// Makes [`TORCH_VENV`] unless it is there and imports torch with gloo (PyPI's Linux torch
/// is the CUDA build: about 5.4 GiB installed, 63 s here, 3.5 s to import on CPU). As root
/// only (the tests that use it are privileged); otherwise said and left to them to skip.
pub fn torch_venv() -> Result<()> {
    let venv = Path::new(TORCH_VENV);
    let py = venv.join("bin/python");
    let ok = |py: &Path| {
        Command::new(py)
            .args(["-c", "import torch.distributed as d; assert d.is_gloo_available()"])
            .output()
            .is_ok_and(|o| o.status.success())
            && venv.join("bin/py-spy").is_file()
    };
    if ok(&py) {
        return Ok(());
    }
    if unsafe_euid() != 0 {
        eprintln!("xtask: WARNING: not root: no torch venv at {TORCH_VENV} (the real PyTorch job test will SKIP)");
        return Ok(());
    }
    if Command::new(PYTHON).args(["-c", "import venv, ensurepip"]).output().map_or(true, |o| !o.status.success()) {
        apt_install(&["python3", "python3-venv"])?;
    }
    let _ = std::fs::remove_dir_all(venv);
    std::fs::create_dir_all(venv.parent().unwrap())?;
    run(Command::new(PYTHON).args(["-m", "venv"]).arg(venv))?;
    run(Command::new(venv.join("bin/pip")).args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        TORCH,
        PYSPY,
    ]))
    .context("pip install torch and py-spy from PyPI for the real PyTorch job test")?;
    if !ok(&py) {
        bail!("{TORCH_VENV}: torch installed but does not import with gloo");
    }
    Ok(())
}

pub fn build_ebpf(route: &Route) -> Result<()> {
    let dir = root().join("nantrace-ebpf");
    let mut c = match route {
        Route::Rustup => {
            let mut c = Command::new("cargo");
            c.arg(format!("+{NIGHTLY}")).args([
                "build",
                "--locked",
                "--release",
                "--target",
                "bpfel-unknown-none",
                "-Z",
                "build-std=core",
            ]);
            c
        }
        Route::Debian => {
            let mut c = Command::new("cargo-web");
            c.env("RUSTC_BOOTSTRAP", "1").args([
                "build",
                "--locked",
                "--release",
                "--target",
                "bpfel-unknown-none",
            ]);
            c
        }
    };
    c.current_dir(&dir)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET");
    // `cargo xtask` runs under the stable toolchain; do not let its RUSTUP_TOOLCHAIN leak in.
    c.env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO");
    run(&mut c)?;
    let obj = dir.join("target/bpfel-unknown-none/release/nantrace");
    if !obj.exists() {
        bail!("the eBPF build succeeded but {} is missing", obj.display());
    }
    Ok(())
}
