//! The agent with real services, started by the tests: a one-node Slurm cluster (Debian's
//! slurm-wlm + munge, scripts/slurm-local.sh) and Prometheus (Debian's prometheus,
//! scripts/prometheus-local.sh). As root, single-threaded; the scripts install the packages
//! when they are missing.
mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::agent::{timeline, Agent};
use common::slurm::{run, scripts, Slurm};
use common::{bundles, kmsg, privileged, BIN};
use serde_json::Value;

#[test]
fn slurm_job_nan_gives_a_bundle_with_job_step_user_and_ctl_dump_on_demand() {
    if !privileged("slurm_job_nan_gives_a_bundle_with_job_step_user_and_ctl_dump_on_demand") {
        return;
    }
    // A user of our own submits (the bundle must name the submitter, not root).
    let _ = Command::new("useradd")
        .args(["-M", "-s", "/bin/bash", "ntjob"])
        .status();
    // The shipped prolog/epilog, pointed at the agent's socket.
    let socket = Agent::dir_for("slurm").join("run/agent.sock");
    let hooks = std::env::temp_dir().join(format!("nt-slurmhooks-{}", std::process::id()));
    std::fs::create_dir_all(&hooks).unwrap();
    std::fs::set_permissions(&hooks, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/slurm");
    for h in ["prolog", "epilog"] {
        let p = hooks.join(format!("{h}.sh"));
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\nexport NANTRACE_BIN={BIN} NANTRACE_SOCKET={}\nexec {}\n",
                socket.display(),
                dist.join(format!("{h}.sh")).display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let slurm = Slurm::up(&hooks.join("prolog.sh"), &hooks.join("epilog.sh"));
    // As on a Slurm node: the agent's scontrol finds the cluster.
    let a = Agent::start_env("slurm", 19476, &[], &[("SLURM_CONF", &slurm.conf)]);
    let work = a.dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).unwrap();
    // The agent watches GPU jobs only (the default): this CPU job is watched because the
    // prolog announced it.
    let id = slurm.sbatch("ntjob", &work, "for i in $(seq 1 10); do echo \"step $i loss 2.$i\"; sleep 0.4; done; echo 'step 11 loss nan'; sleep 3; exit 1");
    a.wait_line("prolog", Duration::from_secs(30), |l| {
        l.contains(&format!("slurm-prolog for Slurm job {id}"))
    });
    let t0 = Instant::now();
    let key = format!("slurm-{id}");
    let job = loop {
        let v = a.ctl(&["jobs"]);
        if let Some(j) = v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["key"] == key.as_str())
        {
            break j.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "Slurm job {id} not watched: {v}\n{}",
            slurm.scontrol(&["show", "job", &id])
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "Slurm job {id} watched {:.0} ms after the prolog ran",
        t0.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(job["identity"]["kind"], "slurm");
    assert_eq!(job["identity"]["user"], "ntjob");
    assert_eq!(job["found_by"], "slurm");
    let out_file = work.join(format!("slurm-{id}.out"));
    a.wait_line("log followed", Duration::from_secs(10), |l| {
        l.contains("following") && l.contains(&format!("slurm-{id}.out"))
    });
    let b = a.wait_bundles(1, Duration::from_secs(40));
    assert!(
        !b.is_empty(),
        "no bundle for Slurm job {id}; its output: {:?}",
        std::fs::read_to_string(&out_file)
    );
    let t = timeline(&b[0]);
    assert_eq!(t["trigger"]["kind"], "nan", "{}", t["trigger"]);
    let sched = &t["job"]["identity"]["scheduler"];
    assert_eq!(
        (
            sched["kind"].as_str(),
            sched["job_id"].as_str(),
            sched["step_id"].as_str(),
            sched["user"].as_str()
        ),
        (
            Some("slurm"),
            Some(id.as_str()),
            Some("batch"),
            Some("ntjob")
        ),
        "{sched}"
    );
    let snap: Value =
        serde_json::from_str(&std::fs::read_to_string(b[0].join("snapshot.json")).unwrap())
            .unwrap();
    let s = &snap["job"]["scheduler"]["slurm"];
    let s = if s.is_null() {
        &snap["scheduler"]["slurm"]
    } else {
        s
    };
    assert_eq!(
        s["job_id"],
        id.as_str(),
        "scheduler section: {}",
        snap["scheduler"]
    );
    assert_eq!(s["user"], "ntjob");
    assert!(s["scontrol_show_job"]
        .as_str()
        .unwrap()
        .contains(&format!("JobId={id}")));
    let md = std::fs::read_to_string(b[0].join("report.md")).unwrap();
    assert!(
        md.contains(&format!("- job: Slurm job {id}, step batch, user ntjob")),
        "{md}"
    );
    assert!(std::fs::read_to_string(b[0].join("app.log"))
        .unwrap()
        .contains("step 11 loss nan"));
    // The epilog ran when it ended.
    a.wait_line("epilog", Duration::from_secs(30), |l| {
        l.contains(&format!("slurm-epilog for Slurm job {id}"))
    });

    // On demand: a running job, `nantrace ctl dump --job <Slurm id>`.
    let before = bundles(&a.spool).len();
    let id2 = slurm.sbatch(
        "ntjob",
        &work,
        "for i in $(seq 1 300); do echo \"step $i loss 0.$i\"; sleep 0.2; done",
    );
    let key2 = format!("slurm-{id2}");
    let t0 = Instant::now();
    while !a.ctl(&["jobs"]).to_string().contains(&key2) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "Slurm job {id2} not watched"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    let d = a.ctl(&["dump", "--job", &id2]);
    assert_eq!(d["dumping"][0], key2.as_str(), "{d}");
    let t0 = Instant::now();
    let newest = loop {
        if let Some(t) = bundles(&a.spool)
            .iter()
            .map(|p| timeline(p))
            .find(|t| t["job"]["identity"]["job"] == key2.as_str())
        {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no bundle for the second job ({before} before)"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(newest["trigger"]["kind"], "ctl");
    let _ = Command::new("scancel")
        .arg(&id2)
        .env("SLURM_CONF", &slurm.conf)
        .status();
    drop(slurm);
    a.stop();
    let _ = std::fs::remove_dir_all(&hooks);
}

#[test]
fn prometheus_scrapes_the_agent_and_sees_an_injected_xid() {
    if !privileged("prometheus_scrapes_the_agent_and_sees_an_injected_xid") {
        return;
    }
    let a = Agent::start("prom", 19477, &[]);
    struct Prom;
    impl Drop for Prom {
        fn drop(&mut self) {
            let _ = Command::new("bash")
                .arg(scripts().join("prometheus-local.sh"))
                .arg("down")
                .status();
        }
    }
    run(Command::new("bash")
        .arg(scripts().join("prometheus-local.sh"))
        .args(["up", &a.metrics, "19090"]));
    let _p = Prom;
    kmsg("NVRM: Xid (PCI:0000:b1:00): 79, pid=4242, name=python3, GPU has fallen off the bus.");
    let q = |promql: &str| -> Value {
        serde_json::from_str(&run(Command::new("bash")
            .arg(scripts().join("prometheus-local.sh"))
            .args(["query", promql])))
        .unwrap()
    };
    let t0 = Instant::now();
    let series = loop {
        let v = q("nantrace_xid_total{xid=\"79\"}");
        if let Some(s) = v["data"]["result"].as_array().filter(|r| !r.is_empty()) {
            break s.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "Prometheus never saw nantrace_xid_total{{xid=\"79\"}}: {v}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!(
        "Xid in Prometheus {:.1} s after injection: {series:?}",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(series.len(), 1);
    assert_eq!(series[0]["metric"]["gpu"], "0000:b1:00.0");
    assert_eq!(series[0]["metric"]["job"], "nantrace");
    assert_eq!(series[0]["value"][1], "1");
    let probes = q("nantrace_probes_attached");
    let n: f64 = probes["data"]["result"][0]["value"][1]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n >= 5.0, "{probes}");
    // The shipped rules (dist/prometheus/nantrace-rules.yml, loaded by prometheus-local.sh)
    // page on it: the series appeared at 1, with no 0 before it, as the agent exports a
    // counter at its first event, and the alert still fires, with the action in it.
    let t1 = Instant::now();
    let alert = loop {
        let v = q("ALERTS{alertname=\"NantraceGpuFatalXid\",alertstate=\"firing\"}");
        if let Some(s) = v["data"]["result"].as_array().and_then(|r| r.first()) {
            break s.clone();
        }
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "NantraceGpuFatalXid never fired: {v}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!(
        "NantraceGpuFatalXid firing {:.1} s after the series: {alert}",
        t1.elapsed().as_secs_f64()
    );
    assert_eq!(
        (
            alert["metric"]["gpu"].as_str(),
            alert["metric"]["xid"].as_str(),
            alert["metric"]["severity"].as_str()
        ),
        (Some("0000:b1:00.0"), Some("79"), Some("critical")),
        "{alert}"
    );
    a.stop();
}

/// The job-wide dump through the job directory, on the real Slurm: an incident another node's
/// agent opened for a job watched here makes this agent dump its window under that incident
/// within a poll (≤ 1 s to the trigger) and writes it within `JOB_WIDE_POST_S` (not the
/// shipped 15 s post-window), and this node's own NaN opens an incident there with
/// its marker and bundle, which `nantrace report` reads as a job.
#[test]
fn a_job_wide_incident_in_the_job_directory_is_dumped_here_and_ours_is_shared() {
    if !privileged("a_job_wide_incident_in_the_job_directory_is_dumped_here_and_ours_is_shared") {
        return;
    }
    let _ = Command::new("useradd")
        .args(["-M", "-s", "/bin/bash", "ntjob"])
        .status();
    let base = std::env::temp_dir().join(format!("nt-jobdir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let shared = base.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = base.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "job_dir = {:?}\nslurm_jobs = \"all\"\n",
            shared.display().to_string()
        ),
    )
    .unwrap();
    let slurm = Slurm::up(Path::new("/bin/true"), Path::new("/bin/true"));
    // The shipped post-window: a job-wide dump another node asked for still comes within
    // `JOB_WIDE_POST_S` (issue 30: every node's bundle soon), this node's own after its job.
    let a = Agent::start_env(
        "jobdir",
        19477,
        &["--config", cfg.to_str().unwrap(), "--post", "15"],
        &[("SLURM_CONF", &slurm.conf)],
    );
    let work = a.dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).unwrap();
    let host = nantrace::bundle::Host::read().hostname;

    // 1. Another node (n9) opened an incident of a job that runs here too.
    let id = slurm.sbatch(
        "ntjob",
        &work,
        "for i in $(seq 1 300); do echo \"step $i loss 0.$i\"; sleep 0.2; done",
    );
    let key = format!("slurm-{id}");
    let t0 = Instant::now();
    while !a.ctl(&["jobs"]).to_string().contains(&key) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "Slurm job {id} not watched"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    let root = nantrace::agent::jobdir::Root::open(&shared).unwrap();
    let inc = root
        .open_incident(
            &id,
            "n9",
            "nan",
            "step 12 | loss nan (rank 0, on n9)",
            nantrace::clock::realtime_ns(),
        )
        .unwrap();
    let marked = Instant::now();
    let fired = a.wait_line("the job-wide trigger", Duration::from_secs(10), |l| {
        l.contains(&format!(
            "job {key}: trigger job-wide: job-wide dump: incident {inc}"
        ))
    });
    let reaction = marked.elapsed();
    eprintln!(
        "job-wide dump: marker to trigger {:.0} ms: {fired}",
        reaction.as_secs_f64() * 1e3
    );
    assert!(
        reaction <= Duration::from_millis(1500),
        "the marker was seen after {reaction:?} (poll {:?})",
        nantrace::agent::jobdir::POLL
    );
    let here = shared
        .join(&id)
        .join(&inc)
        .join(nantrace::safefs::sanitize(&host, "host"));
    let t0 = Instant::now();
    while !here.join("report.md").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no bundle under {}",
            here.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = marked.elapsed();
    eprintln!(
        "job-wide dump: marker to bundle {:.1} s (post_s 15)",
        took.as_secs_f64()
    );
    assert!(
        took < Duration::from_secs_f64(nantrace::session::JOB_WIDE_POST_S + 8.0),
        "the job-wide bundle took {took:?}: the full post-window, not JOB_WIDE_POST_S"
    );
    let t = timeline(&here);
    assert_eq!(t["trigger"]["kind"], "job-wide", "{}", t["trigger"]);
    assert!(
        t["trigger"]["reason"]
            .as_str()
            .unwrap()
            .contains("nan on n9"),
        "{}",
        t["trigger"]
    );
    assert_eq!(
        std::fs::symlink_metadata(&here)
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    assert!(
        bundles(&a.spool)
            .iter()
            .any(|b| timeline(b)["trigger"]["kind"] == "job-wide"),
        "the local spool keeps its own copy"
    );
    assert_eq!(
        root.incidents(&id).len(),
        1,
        "no second incident for the same one"
    );
    let _ = Command::new("scancel")
        .arg(&id)
        .env("SLURM_CONF", &slurm.conf)
        .status();

    // 2. This node's own NaN: an incident opened here, with this node's bundle in it.
    let id2 = slurm.sbatch("ntjob", &work, "for i in $(seq 1 15); do echo \"step $i loss 2.$i\"; sleep 0.3; done; echo 'step 16 loss nan'; sleep 4; exit 1");
    let t0 = Instant::now();
    let (inc2, marker) = loop {
        if let Some(x) = root.incidents(&id2).into_iter().next() {
            break x;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no incident opened for job {id2}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(marker["trigger"], "nan", "{marker}");
    assert_eq!(
        marker["host"],
        nantrace::safefs::sanitize(&host, "host").as_str()
    );
    let dir2 = shared.join(&id2).join(&inc2);
    let t0 = Instant::now();
    while nantrace::jobreport::find_bundles(&dir2).map_or(true, |b| b.is_empty()) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no bundle under {}",
            dir2.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let o = Command::new(BIN)
        .args(["report", "--json", dir2.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["nodes"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["jobs"][0], id2.as_str(), "{r}");
    assert!(
        r["missing"].as_array().unwrap().is_empty(),
        "a one-node job misses no node: {r}"
    );
    assert!(
        r["reference"]
            .as_str()
            .unwrap()
            .contains("step 16 loss nan"),
        "{r}"
    );
    drop(slurm);
    a.stop();
    let _ = std::fs::remove_dir_all(&base);
}
