//! The job directory's protocol on a real directory: incidents opened and joined, bundles
//! placed under them without following links, markers of anyone but the agents ignored.
use super::*;
use crate::session::Input;
use crate::trigger::TriggerKind;
use tokio::sync::mpsc;

struct Tmp(PathBuf);

impl Tmp {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("nantrace-jobdir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        Tmp(p)
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bundle(dir: &Path) -> PathBuf {
    let b = dir.join("nantrace-n1-x");
    std::fs::create_dir_all(&b).unwrap();
    std::fs::write(b.join("timeline.json"), "{}").unwrap();
    std::fs::write(b.join("report.md"), "# r").unwrap();
    b
}

#[test]
fn triggers_within_the_join_window_are_one_incident_and_bundles_land_under_it() {
    let t = Tmp::new("join");
    let root = Root::open(&t.0).unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let a = root
        .open_incident("4711", "n1", "nan", "step 300 | loss nan", now)
        .unwrap();
    assert_eq!(a, "inc-000001");
    let b = root
        .open_incident("4711", "n2", "job-error", "NCCL error", now + 3_000_000_000)
        .unwrap();
    assert_eq!(a, b, "3 s later, on another node: the same incident");
    let c = root
        .open_incident("4711", "n2", "nan", "again", now + 600_000_000_000)
        .unwrap();
    assert_ne!(a, c, "10 minutes later: a new incident");
    let incs = root.incidents("4711");
    assert_eq!(incs.len(), 2);
    assert_eq!(incs[0].1["host"], "n1");
    assert_eq!(incs[0].1["trigger"], "nan");
    let src = Tmp::new("src");
    let b1 = bundle(&src.0);
    let p = root.put_bundle("4711", &a, "n1", &b1).unwrap();
    assert_eq!(p, t.0.join("4711").join(&a).join("n1"));
    assert_eq!(std::fs::read_to_string(p.join("report.md")).unwrap(), "# r");
    let p2 = root.put_bundle("4711", &a, "n1", &b1).unwrap();
    assert_eq!(
        p2,
        t.0.join("4711").join(&a).join("n1-2"),
        "a second dump of one incident keeps the first"
    );
    let found = crate::jobreport::find_bundles(&t.0.join("4711").join(&a)).unwrap();
    assert_eq!(
        found.len(),
        2,
        "the job report finds the node bundles under the incident"
    );
}

/// Two agents of the earlier version opened an incident each (`<time>-<host>`), a moment
/// apart and before seeing each other's marker: both settle on the earlier one, a new agent
/// triggering then joins it, and nothing is removed (another node may be writing into it:
/// the VM cluster's split of 12-02 came from a removed marker whose directory a third node
/// then filled without one).
#[test]
fn incidents_of_earlier_agents_settle_on_the_earlier_and_stay() {
    let t = Tmp::new("settle");
    let root = Root::open(&t.0).unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let jd = root.job("9").unwrap();
    let legacy = |host: &str, at: i128| {
        let id = format!("{}-{host}", crate::clock::compact_utc(at));
        let d = jd.create_subdir(&id).unwrap();
        d.write_new(MARKER, &serde_json::to_vec(&json!({ "job": "9", "incident": id, "host": host, "trigger": "exit", "time_ns": at.to_string() })).unwrap()).unwrap();
        id
    };
    let a = legacy("n1", now);
    let b = legacy("n2", now + 1_000_000_000);
    assert_eq!(root.incidents("9").len(), 2);
    assert_eq!(root.settle("9", &b), a);
    assert_eq!(root.settle("9", &a), a);
    assert_eq!(root.incidents("9").len(), 2, "nothing is removed");
    assert_eq!(
        root.open_incident("9", "n3", "nan", "x", now + 2_000_000_000)
            .unwrap(),
        a,
        "a new agent joins the earlier agents' incident it sees"
    );
    let later = root
        .open_incident("9", "n3", "nan", "x", now + 900_000_000_000)
        .unwrap();
    assert_eq!(later, "inc-000001", "15 minutes later: a numbered one");
    assert_eq!(root.settle("9", &later), later);
}

/// The rendezvous under contention: eight nodes (each its own `Root`, as on eight
/// machines) trigger at the same moment, 40 times over: every node of a round gets the
/// same incident, which has exactly one marker, and each round is a new incident.
#[test]
fn nodes_triggering_at_once_converge_to_one_incident_every_time() {
    let t = Tmp::new("race");
    let base = 1_796_000_000_000_000_000i128;
    let nodes = 8;
    let mut ids = Vec::new();
    for round in 0..40i128 {
        let at = base + round * 1_000_000_000_000;
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(nodes));
        let got: Vec<String> = (0..nodes)
            .map(|n| {
                let (path, barrier) = (t.0.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let root = Root::open(&path).unwrap();
                    barrier.wait();
                    root.open_incident(
                        "77",
                        &format!("n{n}"),
                        "nan",
                        "loss nan",
                        at + n as i128 * 1_000_000,
                    )
                    .unwrap()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        assert!(got.iter().all(|g| *g == got[0]), "round {round}: {got:?}");
        ids.push(got[0].clone());
    }
    let root = Root::open(&t.0).unwrap();
    let incs = root.incidents("77");
    assert_eq!(incs.len(), 40, "one marker per round");
    let mut uniq = ids.clone();
    uniq.dedup();
    assert_eq!(uniq.len(), 40, "each round its own incident: {ids:?}");
    assert_eq!(ids[39], "inc-000040");
}

/// A claim whose opener died between its `mkdir` and its marker is adopted alike: the first
/// node to find it without a marker gives it one (O_EXCL), and every node joins it.
#[test]
fn a_claim_without_a_marker_is_adopted_alike() {
    let t = Tmp::new("dead");
    let root = Root::open(&t.0).unwrap();
    root.job("5").unwrap().create_subdir("inc-000001").unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let a = root.open_incident("5", "n1", "nan", "x", now).unwrap();
    let b = root.open_incident("5", "n2", "nan", "x", now + 1).unwrap();
    assert_eq!((a.as_str(), b.as_str()), ("inc-000001", "inc-000001"));
    let m = root
        .marker("5", "inc-000001")
        .expect("adopted with a marker");
    assert_eq!(
        (m["host"].as_str(), m["adopted"].as_bool()),
        (Some("n1"), Some(true))
    );
    assert_eq!(root.incidents("5").len(), 1);
}

/// A claim whose marker this node cannot see (the opener is slow, or this node's NFS client
/// cached the marker's absence) is joined after a short wait: the node creates the marker
/// with O_EXCL, which reaches the server, and joins whether it was created or already there.
/// It does not pass the number and open a second incident of the job.
#[test]
fn a_claim_without_a_visible_marker_is_joined_after_a_short_wait() {
    let t = Tmp::new("fresh");
    let root = Root::open(&t.0).unwrap();
    root.job("6").unwrap().create_subdir("inc-000001").unwrap();
    let now = crate::clock::realtime_ns();
    let t0 = std::time::Instant::now();
    let a = root.open_incident("6", "n1", "nan", "x", now).unwrap();
    assert_eq!(a, "inc-000001");
    assert!(
        t0.elapsed() < MARKER_WAIT + std::time::Duration::from_secs(2),
        "a short wait for the marker at most: {:?}",
        t0.elapsed()
    );
    // A marker on the server that this node cannot read (to it, the same as a cached
    // negative lookup): EEXIST on create, joined.
    root.job("6").unwrap().create_subdir("inc-000002").unwrap();
    std::fs::write(t.0.join("6/inc-000002/INCIDENT.json"), "not yet a marker").unwrap();
    let b = root
        .open_incident("6", "n2", "nan", "x", now + 900_000_000_000)
        .unwrap();
    assert_eq!(b, "inc-000002", "15 min later: 1 is over, 2 is claimed");
}

/// Two incidents within one window (a node passed a number under an earlier protocol): a
/// new trigger joins the lower, the one a node that lists neither reaches by walking up.
#[test]
fn of_two_incidents_within_the_window_the_lower_is_joined() {
    let t = Tmp::new("two");
    let root = Root::open(&t.0).unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let a = root.open_incident("8", "n1", "nan", "x", now).unwrap();
    assert_eq!(a, "inc-000001");
    // A second incident within the window, as a node that passed inc-000001 made it.
    let d = root.job("8").unwrap().create_subdir("inc-000002").unwrap();
    d.replace(
        MARKER,
        &serde_json::to_vec(&json!({ "job": "8", "incident": "inc-000002", "time_ns": (now + 5_000_000_000i128).to_string() })).unwrap(),
    )
    .unwrap();
    assert_eq!(root.incidents("8").len(), 2);
    let b = root
        .open_incident("8", "n3", "nan", "x", now + 10_000_000_000)
        .unwrap();
    assert_eq!(b, "inc-000001");
}

/// redteam4 D-4: a job directory under a parent a user owns is refused at start (the user
/// could swap it for their own, whose `.drains` is a link to /etc/...).
#[test]
fn a_job_dir_under_a_users_directory_is_refused() {
    let t = Tmp::new("ancestor");
    let user = t.0.join("user");
    std::fs::create_dir_all(user.join("jobs")).unwrap();
    std::fs::set_permissions(&user, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(
        user.join("jobs"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // SAFETY: a NUL-terminated path; chown fails without root, and the test then says so.
    let c = std::ffi::CString::new(user.as_os_str().as_encoded_bytes()).unwrap();
    if unsafe { libc::chown(c.as_ptr(), 65534, 65534) } != 0 {
        eprintln!("SKIPPED a_job_dir_under_a_users_directory_is_refused: chown needs root");
        return;
    }
    let e = Root::open(&user.join("jobs")).unwrap_err().to_string();
    assert!(e.contains("belongs to uid 65534"), "{e}");
    assert!(
        Root::open(&t.0).is_ok(),
        "the agents' own directory is fine"
    );
}

/// redteam4 D-13: 3000 entries without a marker listed before the real incident do not hide
/// it, and the walk to a new number starts past them.
#[test]
fn junk_entries_do_not_hide_a_marker() {
    let t = Tmp::new("junk");
    let root = Root::open(&t.0).unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let a = root.open_incident("8", "n1", "nan", "x", now).unwrap();
    let jd = root.job("8").unwrap();
    for i in 0..3000 {
        jd.create_subdir(&format!("0junk-{i:05}")).unwrap();
    }
    let incs = root.incidents("8");
    assert_eq!(incs.len(), 1, "the marker is found");
    assert_eq!(incs[0].0, a);
    assert_eq!(
        root.open_incident("8", "n2", "nan", "x", now + 1_000_000_000)
            .unwrap(),
        a
    );
}

#[test]
fn a_job_dir_others_can_write_is_refused() {
    let t = Tmp::new("mode");
    std::fs::set_permissions(&t.0, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let e = Root::open(&t.0).unwrap_err().to_string();
    assert!(e.contains("writable by group or others"), "{e}");
    let link = t.0.with_extension("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&t.0, &link).unwrap();
    assert!(Root::open(&link)
        .unwrap_err()
        .to_string()
        .contains("not a directory"));
    let _ = std::fs::remove_file(&link);
}

#[test]
fn markers_in_a_directory_others_can_write_or_of_the_wrong_shape_are_ignored() {
    let t = Tmp::new("forge");
    let root = Root::open(&t.0).unwrap();
    let id = root
        .open_incident("77", "n1", "nan", "x", 1_796_000_000_000_000_000)
        .unwrap();
    assert_eq!(root.incidents("77").len(), 1);
    // A marker that names another job or incident than its place: ignored.
    let fake = t.0.join("77").join("fake");
    std::fs::create_dir(&fake).unwrap();
    std::fs::write(
        fake.join("INCIDENT.json"),
        serde_json::to_vec(&json!({ "job": "77", "incident": "other", "host": "n9" })).unwrap(),
    )
    .unwrap();
    // A marker that is a link: ignored.
    let linked = t.0.join("77").join("linked");
    std::fs::create_dir(&linked).unwrap();
    std::os::unix::fs::symlink(
        t.0.join("77").join(&id).join("INCIDENT.json"),
        linked.join("INCIDENT.json"),
    )
    .unwrap();
    assert_eq!(
        root.incidents("77")
            .iter()
            .map(|x| x.0.as_str())
            .collect::<Vec<_>>(),
        [id.as_str()]
    );
    // The job's directory made writable by others (a user given access): nothing is trusted.
    std::fs::set_permissions(
        t.0.join("77"),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    assert!(root.incidents("77").is_empty());
    assert!(
        root.put_bundle("77", &id, "n1", &t.0).is_err(),
        "nor written into"
    );
}

#[test]
fn only_slurm_job_ids_name_a_job() {
    assert_eq!(
        job_key(&json!({ "kind": "slurm", "job_id": "4711" })).as_deref(),
        Some("4711")
    );
    assert_eq!(
        job_key(&json!({ "kind": "slurm", "job_id": "4711_3" })).as_deref(),
        Some("4711_3")
    );
    assert_eq!(
        job_key(&json!({ "kind": "slurm", "job_id": "../etc" })),
        None
    );
    assert_eq!(job_key(&json!({ "kind": "pod", "job_id": "4711" })), None);
}

/// The thread: a marker another node wrote makes the job's session fire once; this node's
/// own trigger opens (or joins) the incident and its bundle is shared under it.
#[test]
fn another_nodes_incident_fires_this_nodes_session_once() {
    let t = Tmp::new("thread");
    let root = Root::open(&t.0).unwrap();
    let (tx, mut rx) = mpsc::channel::<Input>(8);
    let said = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let s2 = said.clone();
    let jd = spawn(
        root.clone(),
        "n2".into(),
        Box::new(move |k, m| s2.lock().unwrap().push(format!("{k}: {m}"))),
    );
    jd.send(Msg::Watch {
        job: "4711".into(),
        key: "slurm-4711".into(),
        owner: Value::Null,
        tx,
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let id = root
        .open_incident(
            "4711",
            "n1",
            "nan",
            "step 300 | loss nan",
            crate::clock::realtime_ns(),
        )
        .unwrap();
    let t0 = std::time::Instant::now();
    let fired = loop {
        if let Ok(i) = rx.try_recv() {
            break i;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "no fire within 3 s: {:?}",
            said.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let Input::Fire(kind, why, _) = fired else {
        panic!("not a fire")
    };
    assert_eq!(kind, TriggerKind::JobWide);
    assert!(why.contains(&id) && why.contains("nan on n1"), "{why}");
    assert!(
        t0.elapsed() <= POLL * 3,
        "within the poll interval: {:?}",
        t0.elapsed()
    );
    // The session's own view of it opens nothing new; its bundle goes under the incident.
    jd.send(Msg::Opened {
        key: "slurm-4711".into(),
        trigger: "manual".into(),
        reason: why,
        at: crate::clock::realtime_ns(),
    })
    .unwrap();
    let src = Tmp::new("thread-src");
    jd.send(Msg::Dumped {
        key: "slurm-4711".into(),
        bundle: Some(bundle(&src.0)),
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    while !t
        .0
        .join("4711")
        .join(&id)
        .join("n2")
        .join("report.md")
        .exists()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "bundle not shared: {:?}",
            said.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(POLL * 2);
    assert!(rx.try_recv().is_err(), "fired once");
    assert_eq!(root.incidents("4711").len(), 1, "no second incident");
}

/// Two incidents opened a moment apart by two nodes: a third node dumps once, for the first it
/// sees, and takes the other as the same incident of the job.
#[test]
fn incidents_within_the_join_window_fire_a_third_node_once() {
    let t = Tmp::new("pair");
    let root = Root::open(&t.0).unwrap();
    let (tx, mut rx) = mpsc::channel::<Input>(8);
    let jd = spawn(root.clone(), "n3".into(), Box::new(|_, _| {}));
    jd.send(Msg::Watch {
        job: "5".into(),
        key: "slurm-5".into(),
        owner: Value::Null,
        tx,
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let now = crate::clock::realtime_ns();
    let a = root.open_incident("5", "n1", "nan", "x", now).unwrap();
    // n2's own, made before it saw n1's (as open_incident would, one second later).
    let d = safefs::Dir::open(&t.0.join("5"))
        .unwrap()
        .create_subdir(&format!(
            "{}-n2",
            crate::clock::compact_utc(now + 1_000_000_000)
        ))
        .unwrap();
    let b = format!("{}-n2", crate::clock::compact_utc(now + 1_000_000_000));
    d.write_new(MARKER, &serde_json::to_vec(&json!({ "job": "5", "incident": b, "host": "n2", "trigger": "exit", "time_ns": (now + 1_000_000_000).to_string() })).unwrap()).unwrap();
    std::thread::sleep(POLL * 3);
    assert!(
        matches!(rx.try_recv(), Ok(Input::Fire(TriggerKind::JobWide, _, _))),
        "fired for the first"
    );
    let src = Tmp::new("pair-src");
    jd.send(Msg::Dumped {
        key: "slurm-5".into(),
        bundle: Some(bundle(&src.0)),
    })
    .unwrap();
    std::thread::sleep(POLL * 3);
    assert!(
        rx.try_recv().is_err(),
        "not a second time for n2's incident of the same moment"
    );
    assert!(
        t.0.join("5").join(&a).join("n3").join("report.md").exists(),
        "the bundle is under the earlier incident"
    );
    // A failed dump ends the incident here: the next incident of the job fires again.
    jd.send(Msg::Dumped {
        key: "slurm-5".into(),
        bundle: None,
    })
    .unwrap();
}

/// redteam4 D-7: two clusters share one job directory and their job ids repeat. Cluster B's
/// job 12 neither joins cluster A's incident of its job 12 nor dumps for it; the same owner
/// (and an earlier agent's marker, which says none) still joins.
#[test]
fn the_same_job_id_of_another_cluster_or_user_is_another_job() {
    let t = Tmp::new("owner");
    let root = Root::open(&t.0).unwrap();
    let now = crate::clock::realtime_ns();
    let a = json!({ "uid": 1001, "cluster": "alpha" });
    let b = json!({ "uid": 1002, "cluster": "beta" });
    let ia = root
        .open_incident_of("12", &a, "n1", "nan", "loss nan", now)
        .unwrap();
    assert_eq!(ia, "inc-000001");
    let m: Value =
        serde_json::from_slice(&std::fs::read(t.0.join("12").join(&ia).join(MARKER)).unwrap())
            .unwrap();
    assert_eq!(m["owner"], a, "the marker says whose job it is");
    // Cluster B, a second later: its own incident, not A's.
    let ib = root
        .open_incident_of("12", &b, "m1", "nan", "loss nan", now + 1_000_000_000)
        .unwrap();
    assert_eq!(ib, "inc-000002");
    // Same uid, other cluster: another job too.
    let other_cluster = json!({ "uid": 1001, "cluster": "beta" });
    assert_eq!(
        root.open_incident_of("12", &other_cluster, "m2", "nan", "x", now + 2_000_000_000)
            .unwrap(),
        "inc-000003",
        "neither A's job (its cluster) nor B's (its uid)"
    );
    // A's other nodes join A's; an owner that is not known joins the first.
    assert_eq!(
        root.open_incident_of("12", &a, "n2", "job-error", "NCCL", now + 3_000_000_000)
            .unwrap(),
        ia
    );
    assert_eq!(
        root.open_incident("12", "n3", "nan", "x", now + 3_000_000_000)
            .unwrap(),
        ia
    );

    // A node of cluster B watching its job 12 is not fired by A's incident, and says why.
    let t2 = Tmp::new("owner-poll");
    let root2 = Root::open(&t2.0).unwrap();
    let (tx, mut rx) = mpsc::channel::<Input>(8);
    let said = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let s2 = said.clone();
    let jd = spawn(
        root2.clone(),
        "m1".into(),
        Box::new(move |k, m| s2.lock().unwrap().push(format!("{k}: {m}"))),
    );
    jd.send(Msg::Watch {
        job: "12".into(),
        key: "slurm-12".into(),
        owner: b.clone(),
        tx,
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let id = root2
        .open_incident_of(
            "12",
            &a,
            "n1",
            "nan",
            "loss nan",
            crate::clock::realtime_ns(),
        )
        .unwrap();
    let t0 = std::time::Instant::now();
    while !said
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("another job's"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no warning: {:?}",
            said.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        rx.try_recv().is_err(),
        "cluster B's job was dumped for cluster A's incident {id}"
    );
    // Its own cluster's incident does fire it.
    let own = root2
        .open_incident_of(
            "12",
            &b,
            "m2",
            "nan",
            "loss nan",
            crate::clock::realtime_ns(),
        )
        .unwrap();
    assert_ne!(own, id);
    let t0 = std::time::Instant::now();
    let fired = loop {
        if let Ok(i) = rx.try_recv() {
            break i;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "its own cluster's incident did not fire it: {:?}",
            said.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let Input::Fire(_, why, _) = fired else {
        panic!("not a fire")
    };
    assert!(why.contains(&own), "{why}");
}

#[test]
fn the_cluster_name_is_slurm_confs() {
    assert_eq!(
        cluster_of("# c\nSlurmctldHost=h\nClusterName=Alpha-1 # the lab\n").as_deref(),
        Some("alpha-1")
    );
    assert_eq!(cluster_of("clustername = beta\n").as_deref(), Some("beta"));
    assert_eq!(cluster_of("#ClusterName=gamma\n"), None);
    assert_eq!(cluster_of("ClusterName=../x\n"), None);
}
