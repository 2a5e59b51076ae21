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

/// Two versions at one moment (issue 30, a cluster upgrading node by node): an earlier
/// agent's `<time>-<host>` incident and a numbered one opened within the join window, each
/// before the other's marker could be seen. Every node settles on the earlier of the two,
/// whichever kind it is, as the earlier agents do (they move their bundle to the earliest):
/// before, a numbered incident always stayed itself and the job split in two.
#[test]
fn an_earlier_agents_incident_and_a_numbered_one_at_one_moment_settle_on_the_earlier() {
    let t = Tmp::new("mixed");
    let root = Root::open(&t.0).unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let legacy = |job: &str, host: &str, at: i128| {
        let jd = root.job(job).unwrap();
        let id = format!("{}-{host}", crate::clock::compact_utc(at));
        let d = jd.create_subdir(&id).unwrap();
        d.write_new(MARKER, &serde_json::to_vec(&json!({ "schema": "nantrace.incident/1", "job": job, "incident": id, "host": host, "trigger": "nan", "time_ns": at.to_string() })).unwrap()).unwrap();
        id
    };
    // The numbered one first (the earlier agent lists after it: it joins it when it sees
    // it; here it did not, and its own is 300 ms later).
    let num = root.open_incident("7", "new1", "nan", "x", now).unwrap();
    let old = legacy("7", "old1", now + 300_000_000);
    assert_eq!(root.settle("7", &num), num);
    assert_eq!(root.settle("7", &old), num);
    // The earlier agent then removes its own (only its marker in it): a node that was told
    // of it still settles on the numbered one, by the time in its name, and never recreates it.
    std::fs::remove_file(t.0.join("7").join(&old).join(MARKER)).unwrap();
    std::fs::remove_dir(t.0.join("7").join(&old)).unwrap();
    assert_eq!(root.settle("7", &old), num);
    assert_eq!(legacy_time(&old), Some(now / 1_000_000_000 * 1_000_000_000));
    assert_eq!(legacy_time("inc-000001"), None);
    assert_eq!(legacy_time("2026x204T232739Z-n1"), None);
    // The earlier agent's first.
    let old = legacy("8", "old1", now);
    // Its marker not yet visible when this node claimed: the same as a numbered one made
    // before it was written.
    let jd = root.job("8").unwrap();
    let num = "inc-000001".to_string();
    let d = jd.create_subdir(&num).unwrap();
    d.write_new(MARKER, &serde_json::to_vec(&json!({ "schema": "nantrace.incident/1", "job": "8", "incident": num, "host": "new1", "trigger": "nan", "time_ns": (now + 300_000_000).to_string() })).unwrap()).unwrap();
    assert_eq!(root.settle("8", &num), old, "the numbered one settles on the earlier agent's");
    assert_eq!(root.settle("8", &old), old);
    // Without an earlier agent's incident in the window, a numbered one stays itself even
    // beside another numbered one (the `mkdir` decided).
    let a = root.open_incident("9", "n1", "nan", "x", now).unwrap();
    let jd = root.job("9").unwrap();
    let b = seq_name(seq_of(&a).unwrap() + 1);
    let d = jd.create_subdir(&b).unwrap();
    d.write_new(MARKER, &serde_json::to_vec(&json!({ "schema": "nantrace.incident/1", "job": "9", "incident": b, "host": "n2", "trigger": "nan", "time_ns": (now - 1_000_000_000).to_string() })).unwrap()).unwrap();
    assert_eq!(root.settle("9", &a), a);
    assert_eq!(root.settle("9", &b), b);
    // Outside the window, an earlier agent's incident changes nothing.
    let far = legacy("9", "old1", now - 900_000_000_000);
    assert_eq!(root.settle("9", &a), a);
    assert_eq!(root.settle("9", &far), far);
}

/// The review of 2026-12-04: a marker left empty (an adopter killed between its O_EXCL create
/// and its write) is never joined (before: every later trigger of the job joined that old
/// incident, whatever its time); another cluster's incident under the same job id is never
/// settled on, even beside an earlier agent's; an earlier agent's removed incident with
/// nothing of its window in view is not recreated (`settle_of` says so).
#[test]
fn an_empty_marker_another_clusters_incident_and_a_removed_one_are_not_settled_on() {
    let t = Tmp::new("broken");
    let root = Root::open(&t.0).unwrap();
    let now = 1_796_000_000_000_000_000i128;
    let jd = root.job("5").unwrap();
    let d = jd.create_subdir("inc-000001").unwrap();
    d.write_new(MARKER, b"").unwrap();
    let id = root.open_incident("5", "n1", "nan", "x", now).unwrap();
    assert_eq!(id, "inc-000002", "the empty marker's incident is not joined");
    // Two clusters share the job directory; both run a job 12.
    let a = json!({ "uid": 1000, "cluster": "a" });
    let b = json!({ "uid": 1000, "cluster": "b" });
    let theirs = root.open_incident_of("12", &b, "b1", "nan", "x", now - 50_000_000_000).unwrap();
    let ours = root.open_incident_of("12", &a, "a1", "nan", "x", now).unwrap();
    assert_ne!(theirs, ours);
    let jd = root.job("12").unwrap();
    let old = format!("{}-old1", crate::clock::compact_utc(now + 1_000_000_000));
    let d = jd.create_subdir(&old).unwrap();
    d.write_new(MARKER, &serde_json::to_vec(&json!({ "job": "12", "incident": old, "host": "old1", "trigger": "nan", "time_ns": (now + 1_000_000_000).to_string() })).unwrap()).unwrap();
    assert_eq!(root.settle_of("12", &a, &ours).as_deref(), Some(ours.as_str()), "not cluster b's earlier one");
    // An earlier agent's incident that its agent removed, nothing of its window in view.
    let gone = format!("{}-old2", crate::clock::compact_utc(now + 900_000_000_000));
    assert_eq!(root.settle_of("12", &a, &gone), None);
}

/// An earlier agent's incident that shows up within the window of one this node opened and
/// dumped into (both opened at one moment; the earlier agent then settles on the earliest)
/// is the same incident of the job: no second, job-wide dump of it here (issue 30, the
/// mixed-version test: before, the poll dumped it again, into a directory its agent removed).
#[test]
fn an_incident_within_the_window_of_one_this_node_took_is_not_dumped_again() {
    let t = Tmp::new("took");
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
        job: "4712".into(),
        key: "slurm-4712".into(),
        owner: Value::Null,
        tx,
    })
    .unwrap();
    let now = crate::clock::realtime_ns();
    // This node's own trigger, its bundle shared.
    jd.send(Msg::Opened {
        key: "slurm-4712".into(),
        trigger: "nan".into(),
        reason: "step 9 | loss nan".into(),
        at: now,
    })
    .unwrap();
    let src = Tmp::new("took-src");
    jd.send(Msg::Dumped {
        key: "slurm-4712".into(),
        bundle: Some(bundle(&src.0)),
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    while !said.lock().unwrap().iter().any(|l| l.contains("bundle shared")) {
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", said.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    // An earlier agent's, opened 300 ms later (it did not see this node's marker).
    let jdir = root.job("4712").unwrap();
    let old = format!("{}-old1", crate::clock::compact_utc(now + 300_000_000));
    let d = jdir.create_subdir(&old).unwrap();
    d.write_new(MARKER, &serde_json::to_vec(&json!({ "job": "4712", "incident": old, "host": "old1", "trigger": "nan", "time_ns": (now + 300_000_000).to_string() })).unwrap()).unwrap();
    std::thread::sleep(POLL * 4);
    assert!(
        rx.try_recv().is_err(),
        "dumped again for {old}: {:?}",
        said.lock().unwrap()
    );
    // One opened 10 minutes later is another incident: dumped.
    let later = root
        .open_incident("4712", "n1", "nan", "x", now + 600_000_000_000)
        .unwrap();
    let t0 = std::time::Instant::now();
    loop {
        if let Ok(Input::Fire(kind, why, _)) = rx.try_recv() {
            assert_eq!(kind, TriggerKind::JobWide);
            assert!(why.contains(&later), "{why}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", said.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The rendezvous under contention: eight nodes (each its own `Root`, as on eight
/// machines) trigger at the same moment, 40 times over: every node of a round gets the
/// same incident, which has exactly one marker, and each round is a new incident. The same
/// rounds over two NFS mounts: `nfs_nodes_triggering_at_once_converge_to_one_incident_every_time`
/// (the body, [`converge_rounds`], is at the end of this file).
#[test]
fn nodes_triggering_at_once_converge_to_one_incident_every_time() {
    let t = Tmp::new("race");
    converge_rounds(&[t.0.clone()], &t.0, "77", 8, 40, Duration::ZERO);
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
    // A file at the marker's name that is no marker (markers are made whole, by rename or
    // link, so never half written): EEXIST on create, seen, not a marker: not joined (a
    // marker this node's NFS cache hides is joined: the `nfs_*` tests in a guest).
    root.job("6").unwrap().create_subdir("inc-000002").unwrap();
    std::fs::write(t.0.join("6/inc-000002/INCIDENT.json"), "not a marker").unwrap();
    let b = root
        .open_incident("6", "n2", "nan", "x", now + 900_000_000_000)
        .unwrap();
    assert_eq!(b, "inc-000003", "15 min later: 1 is over, 2 holds no marker");
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

// The rendezvous over NFS (issue 30): the rounds of
// `nodes_triggering_at_once_converge_to_one_incident_every_time` on two `nosharecache` mounts
// of one export (two client caches: dentries, negative lookups, attributes, directory
// listings, as two machines have), a marker one mount looked up before it was written, and a
// claim without a marker adopted across the mounts. Ignored here: `cargo xtask vm-nfs`
// (part of `cargo xtask test`) runs them in a guest with the kernel's NFS server
// (scripts/vm/nfs-check.sh), by name, and fails when one fails or does not run.

/// What one node of a round chose: its number, its directory's index, the incident, how long
/// its `open_incident` took.
struct Pick {
    node: usize,
    dir: usize,
    id: String,
    took: Duration,
}

/// The marker of `<dir>/<job>/<id>` read directly (no trust checks): what the server holds.
fn raw_marker(dir: &Path, job: &str, id: &str) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(dir.join(job).join(id).join(MARKER)).ok()?).ok()
}

/// The sorted names in `dir` (dot-files included), or the error.
fn names_in(dir: &Path) -> Result<Vec<String>, String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// What `server` (the job directory as the server sees it) and each of `dirs` (through each
/// client cache) show of `job`'s newest incidents: the evidence of a round that went wrong.
fn views(dirs: &[PathBuf], server: &Path, job: &str) -> String {
    let mut out = String::new();
    let names = names_in(&server.join(job)).unwrap_or_else(|e| vec![e]);
    out.push_str("\n  the server holds:");
    for id in names.iter().rev().take(4).rev() {
        let inside = names_in(&server.join(job).join(id)).unwrap_or_else(|e| vec![e]);
        let m = raw_marker(server, job, id);
        out.push_str(&format!(
            "\n    {id}: {inside:?}; marker: {}",
            m.map_or("none".into(), |m| format!(
                "host {} time_ns {} adopted {}",
                m["host"], m["time_ns"], m["adopted"]
            ))
        ));
    }
    for (i, d) in dirs.iter().enumerate() {
        let listed = names_in(&d.join(job)).unwrap_or_else(|e| vec![e]);
        let seen: Vec<String> = Root::open(d)
            .map(|r| {
                r.incidents(job)
                    .into_iter()
                    .map(|(id, m)| format!("{id} ({})", m["host"]))
                    .collect()
            })
            .unwrap_or_default();
        let last: Vec<&String> = listed.iter().rev().take(4).rev().collect();
        out.push_str(&format!(
            "\n  mount {i} ({}) lists {last:?}; its markers it can read, newest: {:?}",
            d.display(),
            seen.iter().rev().take(4).rev().collect::<Vec<_>>()
        ));
    }
    out
}

/// The rendezvous under contention, on `dirs`: `nodes` nodes, node n a `Root` of
/// `dirs[n % dirs.len()]` (one directory: eight nodes on one kernel's cache; several: each
/// mount of one NFS export a cache of its own, as each machine has), trigger for `job` at one
/// instant (a barrier), `rounds` times over, 1000 s apart on their clocks. Every node of a
/// round must get the same incident, the next number (each round a new incident, none
/// skipped); on the server (`server`: the job directory as the server itself sees it) the
/// job holds exactly those incidents, each with its marker alone (no second marker, no
/// stray temporary file), written by a node of its round; and every directory of `dirs`
/// reads every marker within `settle` (a client's cache may hide a new entry for up to its
/// `acdirmax`, 60 s by default: the agents' poll must see other nodes' incidents in the end).
/// Every round runs; the rounds that went wrong are reported together, each with what each
/// node chose and what the server and each mount showed.
fn converge_rounds(
    dirs: &[PathBuf],
    server: &Path,
    job: &str,
    nodes: usize,
    rounds: usize,
    settle: Duration,
) {
    let base = 1_796_000_000_000_000_000i128;
    let round_at = |round: usize| base + round as i128 * 1_000_000_000_000;
    let mut bad = Vec::new();
    let mut ids = Vec::new();
    let mut waited = 0;
    let t_all = std::time::Instant::now();
    for round in 0..rounds {
        let at = round_at(round);
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(nodes));
        let picks: Vec<Pick> = (0..nodes)
            .map(|n| {
                let (dir, barrier, job) = (n % dirs.len(), barrier.clone(), job.to_string());
                let path = dirs[dir].clone();
                std::thread::spawn(move || {
                    let root = Root::open(&path)
                        .unwrap_or_else(|e| panic!("n{n}: {}: {e}", path.display()));
                    barrier.wait();
                    let t0 = std::time::Instant::now();
                    let id = root
                        .open_incident(
                            &job,
                            &format!("n{n}"),
                            "nan",
                            "loss nan",
                            at + n as i128 * 1_000_000,
                        )
                        .unwrap_or_else(|e| panic!("round {round}: n{n}: {e}"));
                    Pick {
                        node: n,
                        dir,
                        id,
                        took: t0.elapsed(),
                    }
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let want = seq_name(round as u64 + 1);
        let id = picks[0].id.clone();
        let slow = picks.iter().filter(|p| p.took >= MARKER_WAIT).count();
        waited += usize::from(slow > 0);
        let m = raw_marker(server, job, &id);
        let by = m.as_ref().map_or("nobody".into(), |m| {
            format!(
                "{}{}",
                m["host"].as_str().unwrap_or("?"),
                if m["adopted"] == true {
                    " (adopted)"
                } else {
                    ""
                }
            )
        });
        let max = picks.iter().map(|p| p.took).max().unwrap_or_default();
        if dirs.len() > 1 {
            eprintln!(
                "round {round:2}: {id} opened by {by}; {nodes} nodes in {:.0} ms at most, {slow} waited for the marker",
                max.as_secs_f64() * 1e3
            );
        }
        let mut wrong = Vec::new();
        if picks.iter().any(|p| p.id != id) || id != want {
            wrong.push(format!("not all on {want}"));
        }
        let mine = |m: &Value| {
            let host = m["host"].as_str().unwrap_or("");
            (0..nodes).any(|n| host == format!("n{n}"))
                && time_of(m).is_some_and(|t| (t - at).abs() < 1_000_000_000)
                && m["incident"] == want.as_str()
        };
        match raw_marker(server, job, &want) {
            Some(m) if mine(&m) => {}
            other => wrong.push(format!("the server's marker of {want}: {other:?}")),
        }
        match names_in(&server.join(job).join(&want)) {
            Ok(v) if v == [MARKER] => {}
            other => wrong.push(format!("{want} holds {other:?}, not its marker alone")),
        }
        if !wrong.is_empty() {
            let chose: Vec<String> = picks
                .iter()
                .map(|p| {
                    format!(
                        "n{} (mount {}): {} in {} ms",
                        p.node,
                        p.dir,
                        p.id,
                        p.took.as_millis()
                    )
                })
                .collect();
            bad.push(format!(
                "round {round}: {}\n  chose: {}{}",
                wrong.join("; "),
                chose.join(", "),
                views(dirs, server, job)
            ));
        }
        ids.push(id);
    }
    let rounds_took = t_all.elapsed();
    assert!(
        bad.is_empty(),
        "{} of {rounds} rounds did not converge on one new incident:\n{}",
        bad.len(),
        bad.join("\n")
    );
    let want: Vec<String> = (1..=rounds as u64).map(seq_name).collect();
    assert_eq!(ids, want, "each round its own incident, in turn");
    assert_eq!(
        names_in(&server.join(job)).unwrap(),
        want,
        "the server holds one incident per round, nothing else"
    );
    // Every node's view reaches every marker: an agent's poll finds the incidents other
    // nodes opened through its own cache.
    let mut seen_after = Vec::new();
    for d in dirs {
        let root = Root::open(d).unwrap();
        let t0 = std::time::Instant::now();
        loop {
            let seen: Vec<String> = root.incidents(job).into_iter().map(|(id, _)| id).collect();
            if seen == want {
                seen_after.push(t0.elapsed());
                break;
            }
            assert!(
                t0.elapsed() <= settle,
                "{} reads the markers of {:?} only, after {:?}; the server holds {want:?}",
                d.display(),
                seen,
                t0.elapsed()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    if dirs.len() > 1 {
        eprintln!(
            "{rounds} rounds of {nodes} nodes on {} mounts converged in {:.1} s (in {waited} of them nodes waited out a marker their cache hid); every mount read every marker after {:?}",
            dirs.len(),
            rounds_took.as_secs_f64(),
            seen_after
        );
    }
}

/// The NFS tests' directories: `NANTRACE_NFS_JOB_DIRS` (two or more, `:`-separated: the job
/// directory on each mount of one export) and `NANTRACE_NFS_SERVER_DIR` (the same job
/// directory as the server sees it), set by scripts/vm/nfs-check.sh. Without them the test
/// fails: it would prove nothing.
fn nfs_dirs() -> (Vec<PathBuf>, PathBuf) {
    let dirs: Vec<PathBuf> = std::env::var("NANTRACE_NFS_JOB_DIRS")
        .expect("NANTRACE_NFS_JOB_DIRS is not set: this test runs over NFS in a guest (cargo xtask vm-nfs runs it through scripts/vm/nfs-check.sh), not on the host")
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    assert!(
        dirs.len() >= 2,
        "NANTRACE_NFS_JOB_DIRS names {dirs:?}: two mounts or more (two client caches)"
    );
    let server =
        PathBuf::from(std::env::var("NANTRACE_NFS_SERVER_DIR").expect(
            "NANTRACE_NFS_SERVER_DIR is not set (the export's job directory on the server)",
        ));
    for d in dirs.iter().chain([&server]) {
        assert!(d.is_dir(), "{} is not a directory", d.display());
    }
    (dirs, server)
}

/// Issue 30 over NFS: six nodes, three on each of two `nosharecache` mounts of one export,
/// trigger at one instant, 40 times over, and converge each time (see [`converge_rounds`]);
/// every mount reads every marker within 90 s (`acdirmax` is 60 s).
#[test]
#[ignore = "run by cargo xtask vm-nfs in a guest over NFS (scripts/vm/nfs-check.sh)"]
fn nfs_nodes_triggering_at_once_converge_to_one_incident_every_time() {
    let (dirs, server) = nfs_dirs();
    converge_rounds(&dirs, &server, "7701", 6, 40, Duration::from_secs(90));
}

/// Node B's marker of incident `id` of `job`, written whole (as the opener writes it).
fn write_b_marker(claimed: &safefs::Dir, job: &str, id: &str, now: i128) {
    let marker = json!({ "schema": "nantrace.incident/1", "job": job, "owner": Value::Null, "incident": id, "host": "nb", "trigger": "nan", "reason": "x", "time": crate::clock::rfc3339(now), "time_ns": now.to_string() });
    claimed
        .replace(MARKER, &serde_json::to_vec_pretty(&marker).unwrap())
        .unwrap();
}

/// A node whose NFS client cached the marker's absence: mount A looks for the marker of an
/// incident mount B has claimed (its `mkdir`) before B writes it, B writes it (whole, then
/// renamed, as the opener does), and A, still reading no marker, triggers within the window:
/// it joins B's incident, whose marker stays B's, and opens no second one. Then the same
/// with A already triggering (its `mkdir` refused, the marker looked for and not there) when
/// B writes the marker: A's cache hides it for the whole wait, A creates it with O_EXCL, the
/// server answers that it exists, and A joins; the marker stays B's.
#[test]
#[ignore = "run by cargo xtask vm-nfs in a guest over NFS (scripts/vm/nfs-check.sh)"]
fn nfs_a_marker_one_mount_looked_up_before_it_was_written_is_joined() {
    let (dirs, server) = nfs_dirs();
    let (a, b) = (Root::open(&dirs[0]).unwrap(), Root::open(&dirs[1]).unwrap());
    let (job, id) = ("7702", "inc-000001");
    let now = 1_796_000_000_000_000_000i128;
    let claimed = b.job(job).unwrap().create_subdir(id).unwrap();
    assert!(a.marker(job, id).is_none(), "no marker yet");
    write_b_marker(&claimed, job, id, now);
    assert_eq!(raw_marker(&server, job, id).unwrap()["host"], "nb");
    assert!(b.marker(job, id).is_some(), "the writer's mount reads it");
    // The precondition: A's cache still holds the marker's absence (else this is the plain
    // case and proves nothing about a negative lookup).
    assert!(
        a.marker(job, id).is_none() && !dirs[0].join(job).join(id).join(MARKER).exists(),
        "mount A already reads the marker: its client cached no negative lookup"
    );
    let t0 = std::time::Instant::now();
    let got = a
        .open_incident(job, "na", "job-error", "NCCL", now + 1_000_000_000)
        .unwrap();
    let took = t0.elapsed();
    eprintln!(
        "the node on mount A joined {got} in {} ms ({})",
        took.as_millis(),
        if took >= MARKER_WAIT {
            "after waiting for the marker: O_EXCL adoption found it on the server"
        } else {
            "its client revalidated the incident's directory and read the marker"
        }
    );
    assert_eq!(got, id, "A joins B's incident, not a second one");
    assert_eq!(names_in(&server.join(job)).unwrap(), [id], "one incident");
    assert_eq!(names_in(&server.join(job).join(id)).unwrap(), [MARKER]);
    let m = raw_marker(&server, job, id).unwrap();
    assert_eq!(
        (m["host"].as_str(), m["adopted"].as_bool()),
        (Some("nb"), None),
        "B's marker stays"
    );
    assert!(a.marker(job, id).is_some(), "A reads it now");

    // `refresh` by itself: A's cache hides B's marker, a change of A's own in the
    // directory makes its client look again (a review found the tests passed with `refresh`
    // a no-op; measured with it a no-op: this block fails, "after refresh mount A still
    // reads no marker", and the convergence rounds waited out a hidden marker in 3-5 of 40,
    // 0-1 with it).
    let job = "7705";
    let claimed = b.job(job).unwrap().create_subdir(id).unwrap();
    assert!(a.marker(job, id).is_none(), "no marker yet");
    write_b_marker(&claimed, job, id, now);
    assert!(
        a.marker(job, id).is_none(),
        "mount A already reads the marker: its client cached no negative lookup"
    );
    a.refresh(job, id);
    assert!(
        a.marker(job, id).is_some(),
        "after refresh mount A still reads no marker: its client did not look again"
    );
    assert_eq!(names_in(&server.join(job).join(id)).unwrap(), [MARKER], "refresh leaves nothing behind");

    // A triggers first; B's marker arrives while A waits for it.
    let job = "7704";
    let claimed = b.job(job).unwrap().create_subdir(id).unwrap();
    let path = dirs[0].clone();
    let t0 = std::time::Instant::now();
    let node_a = std::thread::spawn(move || {
        let a = Root::open(&path).unwrap();
        let got = a.open_incident(job, "na", "job-error", "NCCL", now + 1_000_000_000);
        (got, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(500));
    write_b_marker(&claimed, job, id, now);
    let written = t0.elapsed();
    let (got, took) = node_a.join().unwrap();
    let got = got.unwrap();
    eprintln!(
        "the node on mount A, triggering before the marker was written ({} ms after it started), joined {got} in {} ms ({})",
        written.as_millis(),
        took.as_millis(),
        if took >= MARKER_WAIT {
            "its cache hid the marker for the whole wait: O_EXCL adoption found it on the server"
        } else {
            "it read the marker while it waited"
        }
    );
    assert_eq!(
        got,
        id,
        "A joins B's incident, not a second one{}",
        views(&dirs, &server, job)
    );
    assert_eq!(names_in(&server.join(job)).unwrap(), [id], "one incident");
    assert_eq!(names_in(&server.join(job).join(id)).unwrap(), [MARKER]);
    let m = raw_marker(&server, job, id).unwrap();
    assert_eq!(
        (m["host"].as_str(), m["adopted"].as_bool()),
        (Some("nb"), None),
        "B's marker stays"
    );
}

/// A claim whose opener died between its `mkdir` and its marker, found by four nodes at one
/// instant, two on each mount: each waits for the marker, then creates it with O_EXCL, which
/// the server decides for both client caches: exactly one node's marker (`adopted`), every
/// node on that incident. Five times over.
#[test]
#[ignore = "run by cargo xtask vm-nfs in a guest over NFS (scripts/vm/nfs-check.sh)"]
fn nfs_a_claim_without_a_marker_is_adopted_once_across_mounts() {
    let (dirs, server) = nfs_dirs();
    let job = "7703";
    let base = 1_796_000_000_000_000_000i128;
    let nodes = 4;
    for round in 0..5u64 {
        let id = seq_name(round + 1);
        let at = base + round as i128 * 1_000_000_000_000;
        Root::open(dirs.last().unwrap())
            .unwrap()
            .job(job)
            .unwrap()
            .create_subdir(&id)
            .unwrap();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(nodes));
        let got: Vec<(usize, String, Duration)> = (0..nodes)
            .map(|n| {
                let (path, barrier) = (dirs[n % dirs.len()].clone(), barrier.clone());
                std::thread::spawn(move || {
                    let root = Root::open(&path).unwrap();
                    barrier.wait();
                    let t0 = std::time::Instant::now();
                    let id = root
                        .open_incident(job, &format!("n{n}"), "nan", "x", at + n as i128)
                        .unwrap();
                    (n, id, t0.elapsed())
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let m = raw_marker(&server, job, &id);
        eprintln!(
            "round {round}: {:?}; the marker: {}",
            got.iter()
                .map(|(n, id, t)| format!(
                    "n{n} (mount {}) {id} in {} ms",
                    n % dirs.len(),
                    t.as_millis()
                ))
                .collect::<Vec<_>>(),
            m.as_ref().map_or("none".into(), |m| format!(
                "{} adopted {}",
                m["host"], m["adopted"]
            ))
        );
        assert!(
            got.iter().all(|(_, g, _)| *g == id),
            "round {round}: {got:?}{}",
            views(&dirs, &server, job)
        );
        let m =
            m.unwrap_or_else(|| panic!("round {round}: no marker{}", views(&dirs, &server, job)));
        assert_eq!(m["adopted"], true, "round {round}: {m}");
        assert!(
            (0..nodes).any(|n| m["host"] == format!("n{n}")),
            "round {round}: {m}"
        );
        assert_eq!(
            names_in(&server.join(job).join(&id)).unwrap(),
            [MARKER],
            "round {round}"
        );
    }
    assert_eq!(
        names_in(&server.join(job)).unwrap(),
        (1..=5).map(seq_name).collect::<Vec<_>>()
    );
}
