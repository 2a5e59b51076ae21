//! `cargo xtask vm-nfs`: the job directory's rendezvous over NFS (issue 30). One QEMU/TCG
//! guest on Debian bookworm's 6.1 kernel (its nfsd and nfsv4 modules), booted as the kernel
//! matrix boots its guests (scripts/vm/boot.sh, init.sh: the host's root read-only over 9p,
//! so the guest runs the unit test binary built here), runs scripts/vm/nfs-check.sh: the
//! kernel's NFS server exporting a tmpfs, two `nosharecache` NFSv4.2 mounts of it (two client
//! caches, as two machines have), then [`TESTS`] (`#[ignore]`d on the host) by exact name.
//! Fails when NFS cannot be set up, when a test fails, or when not every test ran.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{root, run};

/// The kernel (its own entry in the VM cache: the matrix's and the cluster's stay as they are).
const LABEL: &str = "nfs-6.1-bookworm";
const MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "nfsd", "nfsv4"];

/// The unit tests run in the guest, each by its exact name.
pub const TESTS: &[&str] = &[
    "agent::jobdir::tests::nfs_nodes_triggering_at_once_converge_to_one_incident_every_time",
    "agent::jobdir::tests::nfs_a_marker_one_mount_looked_up_before_it_was_written_is_joined",
    "agent::jobdir::tests::nfs_a_claim_without_a_marker_is_adopted_once_across_mounts",
];

fn cache() -> PathBuf {
    std::env::var_os("NANTRACE_VM_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/nantrace-vm"), PathBuf::from)
}

/// The nantrace library's unit test binary (built when it is not).
fn unit_test_binary() -> Result<PathBuf> {
    let o = Command::new("cargo")
        .current_dir(root())
        .args([
            "test",
            "--locked",
            "-p",
            "nantrace",
            "--lib",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cargo test --lib --no-run")?;
    if !o.status.success() {
        bail!("cargo test -p nantrace --lib --no-run failed");
    }
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["target"]["kind"][0] == "lib" && v["profile"]["test"] == true)
        .and_then(|v| v["executable"].as_str().map(PathBuf::from))
        .context("cargo built no unit test binary for the nantrace library")
}

/// What the guest left in `dir`, judged: Ok with the tests' summary, or why not.
fn judge(dir: &Path) -> Result<String> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    let log = read("nfs.log");
    let tail = |s: &str, n: usize| {
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    };
    let rc = read("nfs.rc");
    if rc.is_empty() {
        bail!(
            "the guest did not finish; its console ends:\n{}\nnfs.log ends:\n{}",
            tail(&read("serial.log"), 30),
            tail(&log, 30)
        );
    }
    match rc.trim() {
        "0" => {}
        "3" => bail!("NFS could not be set up in the guest:\n{}", tail(&log, 40)),
        rc => {
            // The failures' panics (libtest's "failures:" section), else the end of the log.
            let failures = log
                .find("\nfailures:\n")
                .map_or_else(|| tail(&log, 60), |i| log[i..].to_string());
            bail!("the NFS tests exited {rc}:\n{failures}");
        }
    }
    let want = format!("test result: ok. {} passed; 0 failed", TESTS.len());
    let Some(summary) = log.lines().find(|l| l.starts_with(&want)) else {
        bail!(
            "the NFS tests exited 0 but not every one of the {} ran and passed (a name that matches no test runs nothing):\n{}",
            TESTS.len(),
            tail(&log, 20)
        );
    };
    Ok(summary.to_string())
}

pub fn vm_nfs() -> Result<()> {
    crate::setup::apt_install(crate::vm::VM_PACKAGES)?;
    let bin = unit_test_binary()?;
    let t_fetch = Instant::now();
    run(Command::new("bash")
        .arg(root().join("scripts/vm/fetch-kernel.sh"))
        .arg(cache())
        .args([LABEL, "bookworm", "linux-image-amd64"])
        .args(MODULES))
    .context("fetching the NFS guest's kernel")?;
    let fetch_s = t_fetch.elapsed().as_secs_f64();
    let kdir = cache().join("kernels").join(LABEL);
    let dir = root()
        .join("target/vm-nfs")
        .join(format!("{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(root().join("scripts/vm/nfs-guest.sh"), dir.join("guest.sh"))?;
    std::fs::write(
        dir.join("vm.env"),
        format!(
            "REPO={}\nBIN={}\nTESTS=\"{}\"\n",
            root().display(),
            bin.display(),
            TESTS.join(" ")
        ),
    )?;
    let t0 = Instant::now();
    let st = Command::new("bash")
        .arg(root().join("scripts/vm/boot.sh"))
        .arg(&kdir)
        .arg(&dir)
        .arg("360")
        .env("NANTRACE_VM_MEM", "1024")
        .status()
        .context("starting qemu")?;
    let wall_s = t0.elapsed().as_secs_f64();
    let log = std::fs::read_to_string(dir.join("nfs.log")).unwrap_or_default();
    for l in log.lines().filter(|l| {
        l.starts_with("nfs-check:") || l.contains(" rounds of ") || l.contains("joined")
    }) {
        eprintln!("xtask: vm-nfs: {l}");
    }
    let verdict = judge(&dir).map_err(|e| {
        e.context(format!(
            "vm-nfs (qemu {st}, {wall_s:.0} s; logs: {})",
            dir.display()
        ))
    })?;
    eprintln!(
        "xtask: vm-nfs: ok: {verdict} (the guest: {wall_s:.0} s from boot to power-off; the kernel fetched or found cached in {fetch_s:.0} s; logs: {})",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run that did not run every test, or whose NFS was not set up, or whose guest did not
    /// finish, is a failure: never a vacuous pass.
    #[test]
    fn only_every_test_run_and_passed_is_a_pass() {
        let dir = std::env::temp_dir().join(format!("xtask-nfs-judge-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let guest = |rc: Option<&str>, log: &str| {
            let _ = std::fs::remove_file(dir.join("nfs.rc"));
            if let Some(rc) = rc {
                std::fs::write(dir.join("nfs.rc"), rc).unwrap();
            }
            std::fs::write(dir.join("nfs.log"), log).unwrap();
            judge(&dir).map_err(|e| e.to_string())
        };
        let n = TESTS.len();
        let ok = format!("test result: ok. {n} passed; 0 failed; 0 ignored; 0 measured; 330 filtered out; finished in 30s\n");
        assert!(guest(Some("0\n"), &ok).is_ok());
        let fewer = format!("test result: ok. {} passed; 0 failed; 0 ignored\n", n - 1);
        assert!(guest(Some("0\n"), &fewer)
            .unwrap_err()
            .contains("not every one"));
        assert!(guest(Some("0\n"), "test result: ok. 0 passed; 0 failed\n").is_err());
        let setup = "nfs-check: SETUP FAILED: portlist (tcp 2049)\n";
        assert!(guest(Some("3\n"), setup)
            .unwrap_err()
            .contains("could not be set up"));
        let failed = "running 3 tests\n\nfailures:\n\n---- round 7: not all on inc-000008\n";
        assert!(guest(Some("101\n"), failed)
            .unwrap_err()
            .contains("round 7"));
        assert!(guest(None, &ok).unwrap_err().contains("did not finish"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
