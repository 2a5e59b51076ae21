//! `nantrace demo --scenario multinode`: a job report on the built-in default, without a
//! cluster. The node bundles are a recording: the six bundles (three nodes, each with the
//! job-wide dump and its own trigger's) that nantrace's 3-VM Slurm cluster wrote under one
//! incident in its job directory (`cargo xtask vm-cluster`, scenario xid-on-n2, 2026-12-01 19:39 UTC:
//! an Xid 79 written to n2's /dev/kmsg, then rank 0's NaN). They are written out as an agent
//! writes a job directory, and `nantrace report` reads them as it reads any.
use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The job and incident of the recording, as the job directory names them.
pub const JOB: &str = "3";
pub const INCIDENT: &str = "20261201T193916Z-n2";

macro_rules! recorded {
    ($($node:literal),*) => {
        &[$(
            ($node, "timeline.json", include_bytes!(concat!("../../data/demo-multinode/", $node, "/timeline.json")).as_slice()),
            ($node, "snapshot.json", include_bytes!(concat!("../../data/demo-multinode/", $node, "/snapshot.json")).as_slice()),
        )*]
    };
}

const FILES: &[(&str, &str, &[u8])] = recorded!("n1", "n1-2", "n2", "n2-2", "n3", "n3-2");
const MARKER: &[u8] = include_bytes!("../../data/demo-multinode/INCIDENT.json");

/// Write the recorded incident under `out` (`nantrace-multinode-demo[-N]/<job>/<incident>/`,
/// directories 0700, files created new, never through a link) and return the incident's
/// directory.
pub fn write(out: &Path) -> anyhow::Result<PathBuf> {
    crate::safefs::check_out_dir(out)?;
    let top = crate::safefs::Dir::open(out).with_context(|| format!("{}", out.display()))?;
    let (tmp, tmp_name) = top.create_temp_subdir(".nantrace-multinode-demo.tmp-")?;
    let inc = tmp.create_subdir(JOB)?.create_subdir(INCIDENT)?;
    inc.write_new("INCIDENT.json", MARKER)?;
    let mut node: Option<(&str, crate::safefs::Dir)> = None;
    for (name, file, data) in FILES {
        if node.as_ref().is_none_or(|(n, _)| n != name) {
            node = Some((name, inc.create_subdir(name)?));
        }
        if let Some((_, d)) = &node {
            d.write_new(file, data)?;
        }
    }
    let name = crate::bundle::recover::claim(&top, &tmp_name, "nantrace-multinode-demo")?;
    Ok(out.join(name).join(JOB).join(INCIDENT))
}

/// `nantrace demo --scenario multinode`: the recording written under `out`, said to be one,
/// and its job report printed (job-report.md, .json, .html and trace.json written beside it).
pub fn cli(out: &Path) -> anyhow::Result<()> {
    let inc = write(out)?;
    crate::say!("nantrace demo: no cluster here: these node bundles are a recording, written where a job directory would hold them: {}", inc.display());
    crate::say!("nantrace demo: recorded on nantrace's 3-VM Slurm cluster (cargo xtask vm-cluster, scenario xid-on-n2, 2026-12-01 19:39 UTC): an Xid 79 written to n2's /dev/kmsg, then rank 0's NaN on n1; each node's agent dumped the incident");
    crate::cmd::report::job_dir(&inc, false, true)?;
    crate::say!("nantrace demo: job-report.md, job-report.json, job-report.html (open it in a browser) and trace.json (a lane per node, for ui.perfetto.dev) written into {}", inc.display());
    Ok(())
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
}
