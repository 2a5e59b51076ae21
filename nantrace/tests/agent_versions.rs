//! Clusters upgrade node by node: for a while the agents that share a job directory are of
//! two versions. Here an agent of main at 940e9bb (the last version before incidents were
//! numbered and claimed by `mkdir`: it names them `<time>-<host>` and finds them by listing)
//! and this build's agent watch the same Slurm jobs as two nodes (each in a UTS namespace of
//! its own, so each has its own host name) and share one job directory; every job prints a
//! NaN that both see at the same moment. Each job must end with one incident holding both
//! nodes' bundles (every bundle of either node), whichever agent opened first; an incident
//! opened at the same moment and left for the earlier one keeps only its marker.
//!
//! The earlier agent is built by `cargo xtask test` from the repository's history
//! (`xtask::setup::old_agent`, cached under /var/cache/nantrace-tests); `NANTRACE_OLD_AGENT`
//! names another binary. Root only, single-threaded (`-- --test-threads=1`).
mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::slurm::Slurm;
use common::{privileged, BIN};

/// The earlier version's commit and where `cargo xtask test` puts its binary.
const OLD_COMMIT: &str = "940e9bb";
const OLD_DEFAULT: &str = "/var/cache/nantrace-tests/nantrace-940e9bb/nantrace";
/// Two NaN triggers this close are one line seen by both nodes at once (measured: 0 ms, the
/// same kernel timestamp); a node that dumped only because the other's incident asked would
/// have no NaN trigger of its own.
const CONCURRENT_MS: i64 = 3_000;

fn old_agent() -> String {
    let p = std::env::var("NANTRACE_OLD_AGENT").unwrap_or_else(|_| OLD_DEFAULT.to_string());
    assert!(
        Path::new(&p).is_file(),
        "no agent of {OLD_COMMIT} at {p}: `cargo xtask test` builds it (xtask::setup::old_agent), \
         or set NANTRACE_OLD_AGENT"
    );
    p
}

/// `bin` run as a node named `host`: a UTS namespace of its own, the rest of the host shared.
fn as_node<'a>(host: &'a str, bin: &'a str) -> [&'a str; 7] {
    [
        "unshare",
        "--uts",
        "sh",
        "-c",
        "hostname \"$0\" && exec \"$@\"",
        host,
        bin,
    ]
}

/// The visible entries of a directory, sorted.
fn names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(String::from))
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The monotonic time (ns) of the NaN trigger in `host`'s bundle, if one is there: both
/// agents run on this one machine, so their monotonic clocks are one.
fn nan_trigger_ns(job: &Path, bundles: &[(String, String)], host: &str) -> Option<i64> {
    bundles
        .iter()
        .filter(|(_, b)| b == host || b.starts_with(&format!("{host}-")))
        .filter_map(|(i, b)| {
            let t: serde_json::Value = serde_json::from_slice(
                &std::fs::read(job.join(i).join(b).join("timeline.json")).ok()?,
            )
            .ok()?;
            let tr = &t["trigger"];
            (tr["kind"] == "nan").then(|| tr["mono_ns"].as_i64()).flatten()
        })
        .min()
}

/// Every node bundle under the job's incidents: (incident, bundle directory name).
fn node_bundles(job: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for inc in names(job) {
        for b in names(&job.join(&inc)) {
            if job.join(&inc).join(&b).join("report.md").is_file() {
                out.push((inc.clone(), b));
            }
        }
    }
    out
}

#[test]
fn an_earlier_agent_and_this_one_share_one_incident_per_job() {
    if !privileged("an_earlier_agent_and_this_one_share_one_incident_per_job") {
        return;
    }
    let old = old_agent();
    let _ = Command::new("useradd")
        .args(["-M", "-s", "/bin/bash", "ntjob"])
        .status();
    let base = std::env::temp_dir().join(format!("nt-versions-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let shared = base.join("shared");
    let work = base.join("work");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).unwrap();
    let cfg = base.join("agent.toml");
    std::fs::write(
        &cfg,
        format!("job_dir = {:?}\nslurm_jobs = \"all\"\n", shared.display().to_string()),
    )
    .unwrap();
    let slurm = Slurm::up(Path::new("/bin/true"), Path::new("/bin/true"));
    let env = [("SLURM_CONF", slurm.conf.as_str())];
    let args = ["--config", cfg.to_str().unwrap()];
    let new = Agent::start_program("v-new", 19497, &as_node("vnew", BIN), &args, &env);
    let older = Agent::start_program("v-old", 19498, &as_node("vold", &old), &args, &env);

    let rounds = 4;
    let mut openers = Vec::new();
    let mut leftovers = 0;
    let mut gaps_ms = Vec::new();
    for round in 0..rounds {
        let id = slurm.sbatch(
            "ntjob",
            &work,
            "for i in $(seq 1 12); do echo \"step $i loss 2.$i\"; sleep 0.3; done; \
             echo 'step 13 loss nan'; sleep 3; exit 1",
        );
        let job: PathBuf = shared.join(&id);
        // Both nodes' bundles, then a quiet moment: a late second dump lands too.
        let t0 = Instant::now();
        loop {
            let b = node_bundles(&job);
            let has = |h: &str| b.iter().any(|(_, n)| n == h || n.starts_with(&format!("{h}-")));
            if has("vnew") && has("vold") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "round {round}, job {id}: not both nodes' bundles within 90 s: {b:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(Duration::from_secs(5));
        let incidents = names(&job);
        let bundles = node_bundles(&job);
        let with_bundles: BTreeSet<&String> = bundles.iter().map(|(i, _)| i).collect();
        let markers: Vec<String> = incidents
            .iter()
            .filter_map(|i| std::fs::read_to_string(job.join(i).join("INCIDENT.json")).ok())
            .collect();
        eprintln!(
            "round {round}, job {id}: incidents {incidents:?}, bundles {bundles:?}, markers {markers:?}"
        );
        assert_eq!(
            with_bundles.len(),
            1,
            "round {round}, job {id}: one trigger on two nodes of two versions put bundles under {} incidents: \
             {bundles:?}; markers {markers:?}",
            with_bundles.len()
        );
        let inc = with_bundles.into_iter().next().unwrap();
        // The race this test is for: each node triggered on the NaN by itself (its bundle's
        // trigger is the NaN line, not a job-wide dump the other node's incident asked for),
        // on the same line (both read the job's output through the kernel: one timestamp,
        // 0 ms apart in every round measured), so both went to open an incident at once.
        let (Some(tn), Some(to)) = (
            nan_trigger_ns(&job, &bundles, "vnew"),
            nan_trigger_ns(&job, &bundles, "vold"),
        ) else {
            panic!("round {round}: a node's bundles hold no NaN trigger: {bundles:?}");
        };
        let gap_ms = (tn - to).abs() / 1_000_000;
        gaps_ms.push(gap_ms);
        assert!(
            gap_ms <= CONCURRENT_MS,
            "round {round}: the two nodes' NaN triggers were {gap_ms} ms apart: not the concurrent triggers this test is for"
        );
        // This build's agent dumps the NaN and the job's exit, nothing more: an earlier
        // agent's incident opened at the same moment is not dumped again (`took`).
        let ours = bundles.iter().filter(|(_, b)| b.starts_with("vnew")).count();
        assert!(
            ours <= 2,
            "round {round}: this build's agent put {ours} bundles for one NaN and one exit: {bundles:?}"
        );
        let marker: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(job.join(inc).join("INCIDENT.json"))
                .unwrap_or_else(|e| panic!("round {round}: {inc} has no marker: {e}")),
        )
        .unwrap();
        openers.push(marker["host"].as_str().unwrap_or("?").to_string());
        // A numbered incident this build's agent opened at the same moment as the earlier
        // agent's earlier one stays, empty: its marker alone (never removed: another node of
        // this version may have joined it). Nothing else may be there.
        for other in incidents.iter().filter(|i| *i != inc) {
            assert_eq!(
                names(&job.join(other)),
                vec!["INCIDENT.json".to_string()],
                "round {round}: {other} holds more than its marker"
            );
            leftovers += 1;
        }
        let _ = Command::new("scancel")
            .arg(&id)
            .env("SLURM_CONF", &slurm.conf)
            .status();
    }
    eprintln!("opened by: {openers:?}; marker-only incidents left: {leftovers}; the two NaN triggers apart (ms): {gaps_ms:?}");
    new.stop();
    older.stop();
    let _ = std::fs::remove_dir_all(&base);
}
