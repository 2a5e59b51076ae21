//! Tests of `discover.rs`: matching jobs, grouping processes into jobs, trusting Slurm.

use super::*;

#[test]
fn slurm_job_from_environment_or_cgroup() {
    let env = b"PATH=/usr/bin\0SLURM_JOB_ID=4242\0SLURM_STEP_ID=0\0SLURM_JOB_USER=alice\0HF_TOKEN=hf_secret\0";
    assert_eq!(
        slurm_from(
            b"SLURM_JOB_ID=4242\0SLURM_SCRIPT_CONTEXT=prolog_slurmd\0",
            ""
        ),
        None
    );
    assert_eq!(
        slurm_from(env, ""),
        Some(SlurmRef {
            job_id: "4242".into(),
            step_id: Some("0".into()),
            user: Some("alice".into()),
            from_cgroup: false
        })
    );
    // proctrack/cgroup, cgroup v2 (recorded from a Slurm 23.02 node).
    let cg = "0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n";
    assert_eq!(
        slurm_from(b"", cg).map(|s| (s.job_id, s.step_id)),
        Some(("77".into(), Some("batch".into())))
    );
    // cgroup v1.
    let cg = "12:memory:/slurm/uid_1000/job_123/step_0/task_0\n11:devices:/slurm/uid_1000/job_123/step_0\n";
    assert_eq!(slurm_from(b"", cg).unwrap().job_id, "123");
    assert_eq!(slurm_from(b"SLURM_JOB_ID=1;rm -rf\0", ""), None);
    assert_eq!(
        slurm_from(b"", "0::/user.slice/user-1000.slice/session-3.scope\n"),
        None
    );
    // A Slurm-looking path in a user's own delegated subtree is not Slurm's (re-review D6).
    assert_eq!(
        slurm_from(
            b"",
            "0::/user.slice/user-1000.slice/user@1000.service/slurm/job_778/step_0\n"
        ),
        None
    );
    assert_eq!(
        slurm_from(b"", "4:memory:/slurm_node7/uid_1000/job_5/step_batch\n")
            .unwrap()
            .job_id,
        "5"
    );
}

#[test]
fn pod_from_recorded_cgroups() {
    // containerd, systemd cgroup driver, cgroup v2 (a recorded /proc/PID/cgroup).
    let cg = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e3d4c_5b6a_7980_a1b2_c3d4e5f60718.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n";
    let p = pod_from(b"POD_NAMESPACE=ml\0POD_NAME=trainer-0\0", cg).unwrap();
    assert_eq!(p.uid, "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718");
    assert_eq!(
        p.container_id.as_deref(),
        Some("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
    );
    assert_eq!(
        (p.namespace.as_deref(), p.name.as_deref()),
        (Some("ml"), Some("trainer-0"))
    );
    // cgroupfs driver, cgroup v1, docker.
    let cg = "11:memory:/kubepods/besteffort/pod6a7b8c9d-0e1f-2a3b-4c5d-6e7f8a9b0c1d/fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210\n";
    assert_eq!(
        pod_from(b"", cg).unwrap().uid,
        "6a7b8c9d-0e1f-2a3b-4c5d-6e7f8a9b0c1d"
    );
    assert!(pod_from(b"", "0::/system.slice/ssh.service\n").is_none());
}

#[test]
fn gpu_minors_from_device_paths() {
    let d = vec![
        "/dev/nvidiactl".to_string(),
        "/dev/nvidia3".into(),
        "/dev/nvidia-uvm".into(),
        "/dev/nvidia0".into(),
    ];
    assert_eq!(gpu_minors(&d).into_iter().collect::<Vec<_>>(), vec![0, 3]);
}

mod grouping {
    use super::super::*;

    fn seen(pid: u32, ppid: u32, cmd: &str, devices: &[&str]) -> (u32, Seen) {
        let proc = Proc {
            pid,
            ppid,
            pgid: 100,
            uid: 1000,
            starttime: u64::from(pid),
            cmdline: cmd.into(),
            ..Proc::default()
        };
        (
            pid,
            Seen {
                proc,
                devices: devices.iter().map(|d| (*d).to_string()).collect(),
                next_fd_check: u64::MAX,
                backoff_ns: 0,
            },
        )
    }

    #[test]
    fn torchrun_workers_are_one_job_and_separate_scripts_are_two() {
        let cfg = crate::agent::config::Config {
            match_commands: vec!["train-b\\.sh".into()],
            ..Default::default()
        };
        let mut d = Discovery::new(PathBuf::from("/nonexistent"), &cfg);
        d.ignore.clear();
        d.seen = HashMap::from([
            seen(10, 1, "bash", &[]),
            seen(
                20,
                10,
                "/usr/bin/python3 /usr/local/bin/torchrun --nproc-per-node=2 train.py",
                &[],
            ),
            seen(
                21,
                20,
                "/usr/bin/python3 -u train.py --local-rank=0",
                &["/dev/nvidiactl", "/dev/nvidia0"],
            ),
            seen(
                22,
                20,
                "/usr/bin/python3 -u train.py --local-rank=1",
                &["/dev/nvidiactl", "/dev/nvidia1"],
            ),
            // A DataLoader worker of rank 0: no GPU, not found by itself (the kernel's fork
            // tracking makes it the job's).
            seen(23, 21, "/usr/bin/python3 -u train.py --local-rank=0", &[]),
            // Another job from the same shell, by pattern.
            seen(30, 10, "/bin/bash ./train-b.sh", &[]),
            seen(31, 30, "sleep 1", &[]),
        ]);
        let jobs = d.group();
        assert_eq!(jobs.len(), 2, "{jobs:?}");
        let t = jobs
            .iter()
            .find(|j| j.key == "pid-20")
            .expect("torchrun's job");
        assert_eq!((t.root, t.reason), (20, "gpu"));
        assert_eq!(t.gpus.iter().copied().collect::<Vec<_>>(), vec![0, 1]);
        assert!(t.pids.contains(&21) && t.pids.contains(&22));
        let b = jobs
            .iter()
            .find(|j| j.key == "pid-30")
            .expect("the script's job");
        assert_eq!(b.reason, "command");
    }
}

mod slurm_trust {
    use super::super::*;

    fn proc(pid: u32, ppid: u32, uid: u32, cmd: &str, job: Option<&str>) -> (u32, Seen) {
        let slurm = job.map(|j| SlurmRef {
            job_id: j.into(),
            ..SlurmRef::default()
        });
        let proc = Proc {
            pid,
            ppid,
            pgid: pid,
            uid,
            starttime: u64::from(pid),
            cmdline: cmd.into(),
            comm: String::new(),
            slurm,
            pod: None,
            rank: None,
        };
        (
            pid,
            Seen {
                proc,
                devices: Vec::new(),
                next_fd_check: u64::MAX,
                backoff_ns: 0,
            },
        )
    }

    #[test]
    fn slurm_job_id_counts_only_under_that_jobs_slurmstepd() {
        let cfg = crate::agent::config::Config {
            slurm_jobs: "all".into(),
            ..Default::default()
        };
        let mut d = Discovery::new(PathBuf::from("/nonexistent"), &cfg);
        d.ignore.clear();
        d.seen = HashMap::from([
            proc(100, 1, 0, "slurmstepd: [777.batch]", None),
            proc(
                101,
                100,
                1001,
                "/bin/bash /var/spool/slurmd/job00777/slurm_script",
                Some("777"),
            ),
            // A user's process renamed `slurmstepd: [777.0]` (re-review D1).
            proc(400, 1, 1002, "slurmstepd: [777.0]", None),
            proc(401, 400, 1002, "python fake_step.py", Some("777")),
            // Another user claims job 777 from a login shell: not Slurm's word.
            proc(200, 1, 1002, "bash", None),
            proc(201, 200, 1002, "python attacker.py", Some("777")),
            // And under another job's slurmstepd.
            proc(300, 1, 0, "slurmstepd: [778.0]", None),
            proc(301, 300, 1002, "python step.py", Some("777")),
        ]);
        let jobs = d.group();
        assert_eq!(jobs.len(), 1, "{jobs:?}");
        assert_eq!(
            (jobs[0].key.as_str(), jobs[0].root, jobs[0].pids.len()),
            ("slurm-777", 101, 1)
        );
        assert_eq!(jobs[0].uid, 1001);
    }
}

/// A process in a /proc-shaped directory: (pid, ppid, uid, start time), its name, command
/// line and environment (spaces stand for NULs).
fn fake_proc(
    root: &std::path::Path,
    (pid, ppid, uid, start): (u32, u32, u32, u64),
    comm: &str,
    cmdline: &str,
    environ: &str,
) {
    let d = root.join(pid.to_string());
    std::fs::create_dir_all(&d).unwrap();
    let zeros = vec!["0"; 16].join(" ");
    std::fs::write(
        d.join("stat"),
        format!("{pid} ({comm}) S {ppid} {pid} {zeros} {start} 0 0\n"),
    )
    .unwrap();
    std::fs::write(d.join("cmdline"), cmdline.replace(' ', "\0")).unwrap();
    std::fs::write(d.join("environ"), environ.replace(' ', "\0")).unwrap();
    std::fs::write(
        d.join("status"),
        format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
    )
    .unwrap();
    std::fs::write(d.join("cgroup"), "0::/\n").unwrap();
}

/// A process first seen between its fork and its exec (slurmd's child before it becomes
/// `slurmstepd: [5.0]`, seen so on a slow machine): its new name at a later scan makes it read
/// again, so the job under it is found. The start time alone does not change at an exec.
#[test]
fn a_process_seen_before_its_exec_is_read_again_after_it() {
    let root = std::env::temp_dir().join(format!("nantrace-proc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let put = |pid: u32, ppid: u32, comm: &str, cmdline: &str, environ: &str| {
        fake_proc(&root, (pid, ppid, 0, 4242), comm, cmdline, environ)
    };
    put(
        100,
        1,
        "slurmd",
        "slurmd -f /etc/slurm/slurm.conf",
        "PATH=/usr/bin",
    );
    put(
        101,
        100,
        "python3",
        "python3 train.py",
        "SLURM_JOB_ID=5 SLURM_STEP_ID=0",
    );
    let cfg = crate::agent::config::Config {
        slurm_jobs: "all".into(),
        gpu_devices: Vec::new(),
        ..Default::default()
    };
    let mut d = Discovery::new(root.clone(), &cfg);
    assert!(d.scan(0).is_empty(), "no slurmstepd yet: not Slurm's");
    // Just after its exec, before it sets its title.
    put(
        100,
        1,
        "slurmstepd",
        "/usr/sbin/slurmstepd",
        "PATH=/usr/bin",
    );
    assert!(d.scan(1).is_empty(), "no title yet");
    put(100, 1, "slurmstepd", "slurmstepd: [5.0]", "PATH=/usr/bin");
    let found = d.scan(2);
    assert_eq!(
        found.iter().map(|f| f.key.as_str()).collect::<Vec<_>>(),
        ["slurm-5"],
        "{found:?}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// torchrun's workers on one node: one job, each worker's rank (from its environment, the
/// launcher's keys only) in the job's identity; the same for Slurm's own ranks.
#[test]
fn a_jobs_ranks_on_this_node_are_in_its_identity() {
    let root = std::env::temp_dir().join(format!("nantrace-proc-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let put = |pid: u32, ppid: u32, cmdline: &str, environ: &str| {
        fake_proc(
            &root,
            (pid, ppid, 1000, u64::from(pid)),
            "python3",
            cmdline,
            environ,
        )
    };
    put(
        20,
        1,
        "/usr/bin/python3 /usr/local/bin/torchrun --nproc-per-node=2 train.py",
        "PATH=/usr/bin",
    );
    for (pid, rank, local) in [(21, 8, 0), (22, 9, 1)] {
        put(pid, 20, "/usr/bin/python3 -u train.py", &format!("RANK={rank} LOCAL_RANK={local} WORLD_SIZE=16 GROUP_RANK=4 MASTER_ADDR=n1 MASTER_PORT=29500 TORCHELASTIC_RUN_ID=run-7 WANDB_API_KEY=secret"));
    }
    let cfg = crate::agent::config::Config {
        match_commands: vec!["train\\.py".into()],
        gpu_devices: Vec::new(),
        ..Default::default()
    };
    let mut d = Discovery::new(root.clone(), &cfg);
    let found = d.scan(0);
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(found.len(), 1, "{found:?}");
    let id = found[0].identity();
    let dist = &id["distributed"];
    assert_eq!(
        (
            dist["launcher"].as_str(),
            dist["world_size"].as_u64(),
            dist["node_rank"].as_u64(),
            dist["master"].as_str(),
            dist["run_id"].as_str()
        ),
        (
            Some("torch"),
            Some(16),
            Some(4),
            Some("n1:29500"),
            Some("run-7")
        ),
        "{id}"
    );
    let ranks: Vec<u64> = dist["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, [8, 9], "{id}");
    assert!(
        !id.to_string().contains("secret") && !id.to_string().contains("WANDB"),
        "only the launcher's keys: {id}"
    );
}
