//! `nantrace demo --scenario multinode|hang`: a job report on a built-in default, without a
//! cluster. The node bundles are recordings, written out as an agent writes a job directory,
//! and `nantrace report` reads them as it reads any:
//! - multinode: the six bundles (three nodes, each with the job-wide dump and its own
//!   trigger's) that nantrace's 3-VM Slurm cluster wrote under one incident in its job
//!   directory (`cargo xtask vm-cluster`, scenario xid-on-n2, 2026-12-01 19:39 UTC: an Xid 79
//!   written to n2's /dev/kmsg, then rank 0's NaN);
//! - hang: the three bundles of a real PyTorch job (torch 2.15, gloo, three ranks in three
//!   network namespaces, each under `nantrace run --hang-after 4` with py-spy and torch's
//!   Flight Recorder; `nantrace/tests/torch_job.rs`, 2026-12-04): rank 1 on n2 stopped in a
//!   rank-only branch before collective 6, ranks 0 and 2 timed out in it. Its INCIDENT.json
//!   is the demo's own (`nantrace run` opens no job-wide incident); the bundles are as written.
use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// One recorded incident: its job and incident names, its node bundles' files, its marker,
/// and what the demo says of it.
pub struct Recording {
    pub scenario: &'static str,
    pub job: &'static str,
    pub incident: &'static str,
    files: &'static [(&'static str, &'static str, &'static [u8])],
    marker: &'static [u8],
    said: &'static str,
}

macro_rules! recorded {
    ($dir:literal; $($node:literal: $($file:literal),*);*) => {
        &[$($(
            ($node, $file, include_bytes!(concat!("../../data/", $dir, "/", $node, "/", $file)).as_slice()),
        )*)*]
    };
}

pub const MULTINODE: Recording = Recording {
    scenario: "multinode",
    job: "3",
    incident: "20261201T193916Z-n2",
    files: recorded!("demo-multinode";
        "n1": "timeline.json", "snapshot.json"; "n1-2": "timeline.json", "snapshot.json";
        "n2": "timeline.json", "snapshot.json"; "n2-2": "timeline.json", "snapshot.json";
        "n3": "timeline.json", "snapshot.json"; "n3-2": "timeline.json", "snapshot.json"),
    marker: include_bytes!("../../data/demo-multinode/INCIDENT.json"),
    said: "recorded on nantrace's 3-VM Slurm cluster (cargo xtask vm-cluster, scenario xid-on-n2, 2026-12-01 19:39 UTC): an Xid 79 written to n2's /dev/kmsg, then rank 0's NaN on n1; each node's agent dumped the incident",
};

pub const HANG: Recording = Recording {
    scenario: "hang",
    job: "torch-gloo",
    incident: "20261204T203454Z-n1",
    files: recorded!("demo-hang";
        "n1": "timeline.json", "snapshot.json", "flight_recorder.json";
        "n2": "timeline.json", "snapshot.json", "flight_recorder.json";
        "n3": "timeline.json", "snapshot.json", "flight_recorder.json"),
    marker: include_bytes!("../../data/demo-hang/INCIDENT.json"),
    said: "recorded from a real PyTorch job (torch 2.15, gloo, three ranks in three network namespaces n1-n3, each under nantrace run --hang-after 4 with py-spy and torch's Flight Recorder; nantrace/tests/torch_job.rs, 2026-12-04): rank 1 on n2 stopped in a rank-only branch before collective 6, ranks 0 and 2 waited in it until gloo's timeout",
};

/// The recording a scenario names.
pub fn recording(scenario: &str) -> Option<&'static Recording> {
    [&MULTINODE, &HANG]
        .into_iter()
        .find(|r| r.scenario == scenario)
}

impl Recording {
    /// The directory name the recording is written under (`nantrace-<scenario>-demo[-N]`).
    fn top(&self) -> String {
        format!("nantrace-{}-demo", self.scenario)
    }

    /// Write the recorded incident under `out` (`nantrace-<scenario>-demo[-N]/<job>/<incident>/`,
    /// directories 0700, files created new, never through a link) and return the incident's
    /// directory.
    pub fn write(&self, out: &Path) -> anyhow::Result<PathBuf> {
        crate::safefs::check_out_dir(out)?;
        let top = crate::safefs::Dir::open(out).with_context(|| format!("{}", out.display()))?;
        let (tmp, tmp_name) = top.create_temp_subdir(&format!(".{}.tmp-", self.top()))?;
        let inc = tmp.create_subdir(self.job)?.create_subdir(self.incident)?;
        inc.write_new("INCIDENT.json", self.marker)?;
        let mut node: Option<(&str, crate::safefs::Dir)> = None;
        for (name, file, data) in self.files {
            if node.as_ref().is_none_or(|(n, _)| n != name) {
                node = Some((name, inc.create_subdir(name)?));
            }
            if let Some((_, d)) = &node {
                d.write_new(file, data)?;
            }
        }
        let name = crate::bundle::recover::claim(&top, &tmp_name, &self.top())?;
        Ok(out.join(name).join(self.job).join(self.incident))
    }

    /// `nantrace demo --scenario <scenario>`: the recording written under `out`, said to be
    /// one, and its job report printed (job-report.md, .json, .html and trace.json beside it).
    pub fn cli(&self, out: &Path) -> anyhow::Result<()> {
        let inc = self.write(out)?;
        crate::say!("nantrace demo: no cluster here: these node bundles are a recording, written where a job directory would hold them: {}", inc.display());
        crate::say!("nantrace demo: {}", self.said);
        crate::cmd::report::job_dir(&inc, false, true)?;
        crate::say!("nantrace demo: job-report.md, job-report.json, job-report.html (open it in a browser) and trace.json (a lane per node, for ui.perfetto.dev) written into {}", inc.display());
        Ok(())
    }
}

/// The multinode recording's job and incident (`golden` and `report_outputs` tests).
pub const JOB: &str = MULTINODE.job;
pub const INCIDENT: &str = MULTINODE.incident;

/// [`MULTINODE`] written under `out`.
pub fn write(out: &Path) -> anyhow::Result<PathBuf> {
    MULTINODE.write(out)
}

#[cfg(test)]
mod tests {
    /// The recording reads back as the cluster's report read it: n2 and its GPU named, three
    /// nodes, none missing.
    #[test]
    fn the_recorded_job_names_n2_and_its_gpu() {
        let d =
            std::env::temp_dir().join(format!("nantrace-multinode-demo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let inc = super::write(&d).unwrap();
        assert!(
            inc.starts_with(d.join("nantrace-multinode-demo")),
            "{}",
            inc.display()
        );
        let (r, _, nodes) = crate::jobreport::from_dir(&inc).unwrap();
        assert_eq!(nodes.len(), 3, "six bundles, three nodes");
        assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
        assert!(
            r.verdict
                .starts_with("PROBABLY THE MACHINE (GPU): n2, GPU 0000:3b:00.0: Xid 79"),
            "{}",
            r.verdict
        );
        assert!(
            r.verdict.contains("2 other nodes clean (n1, n3)")
                && r.verdict.contains("Action: drain n2"),
            "{}",
            r.verdict
        );
        assert!(r.missing.is_empty(), "{:?}", r.missing);
        // A second run does not write over the first.
        assert!(super::write(&d)
            .unwrap()
            .starts_with(d.join("nantrace-multinode-demo-2")));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// The recorded real PyTorch hang: rank 1 on n2 named with its frame, the job's side.
    #[test]
    fn the_recorded_hang_names_rank_1_on_n2_and_its_frame() {
        let d = std::env::temp_dir().join(format!("nantrace-hang-demo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let inc = super::HANG.write(&d).unwrap();
        let (r, _, nodes) = crate::jobreport::from_dir(&inc).unwrap();
        assert_eq!(nodes.len(), 3);
        assert_eq!(r.node.as_deref(), Some("n2"), "{}", r.verdict);
        assert!(
            r.verdict
                .starts_with("NOT THE MACHINE (software/configuration), most likely: rank 1 on n2"),
            "{}",
            r.verdict
        );
        assert!(r.verdict.contains("wait_for_the_flag"), "{}", r.verdict);
        let _ = std::fs::remove_dir_all(&d);
    }
}
