//! A one-node Slurm cluster for the tests (Debian's slurm-wlm + munge,
//! scripts/slurm-local.sh), brought down at the end even when the test fails.
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts")
}

pub fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The cluster, brought down at the end even when the test fails.
pub struct Slurm {
    pub conf: String,
}

impl Slurm {
    pub fn up(prolog: &Path, epilog: &Path) -> Self {
        let out = run(Command::new("bash")
            .arg(scripts().join("slurm-local.sh"))
            .arg("up")
            .env("NANTRACE_SLURM_PROLOG", prolog)
            .env("NANTRACE_SLURM_EPILOG", epilog));
        let conf = out
            .lines()
            .find_map(|l| l.strip_prefix("export SLURM_CONF="))
            .expect("SLURM_CONF from slurm-local.sh up")
            .trim()
            .to_string();
        Slurm { conf }
    }

    /// Submit as `user`; returns the job id.
    pub fn sbatch(&self, user: &str, dir: &Path, script: &str) -> String {
        let out = run(Command::new("runuser")
            .args([
                "-u",
                user,
                "--",
                "env",
                &format!("SLURM_CONF={}", self.conf),
                "sbatch",
                "--parsable",
                "--chdir",
            ])
            .arg(dir)
            .args(["-o", "slurm-%j.out", "--wrap", script]));
        out.trim().split(';').next().unwrap().to_string()
    }

    pub fn scontrol(&self, args: &[&str]) -> String {
        run(Command::new("scontrol")
            .args(args)
            .env("SLURM_CONF", &self.conf))
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(scripts().join("slurm-local.sh"))
            .arg("down")
            .status();
    }
}
