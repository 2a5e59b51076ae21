use super::*;

#[test]
fn the_prefix_comes_from_the_jobs_variables_then_torchs_defaults() {
    let c = candidates(
        &[
            ("HOME", "/home/u"),
            ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/scratch/nccl_"),
        ],
        None,
        3,
    );
    assert_eq!(
        c,
        vec![("/scratch/nccl_3".into(), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")]
    );
    let c = candidates(
        &[
            ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/scratch/nccl_"),
            ("TORCH_FR_DUMP_TEMP_FILE", "fr/t_"),
        ],
        Some("/work/job/"),
        0,
    );
    assert_eq!(
        c,
        vec![("/work/job/fr/t_0".into(), "TORCH_FR_DUMP_TEMP_FILE")],
        "relative to its cwd"
    );
    let c = candidates(&[("HOME", "/home/u/")], None, 12);
    assert_eq!(
        c.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(),
        [
            "/home/u/.cache/torch/comm_lib_trace_rank_12",
            "/tmp/nccl_trace_rank_12"
        ]
    );
    let env = b"A=1\0HOME=/h\0TORCH_FR_DUMP_TEMP_FILE=/x/fr_\0SECRET=s\0";
    assert_eq!(
        env_pairs(env),
        vec![("HOME", "/h"), ("TORCH_FR_DUMP_TEMP_FILE", "/x/fr_")]
    );
    let st = "Name:\tpython\nUid:\t1001\t1001\t1001\t1001\nGid:\t102\t102\t102\t102\n";
    assert_eq!(ids(st), Some((1001, 102)));
    // A setuid program the job started keeps the user's environment with root's ids: never
    // read as it (review finding).
    let st = "Name:\tsudo\nUid:\t1000\t0\t0\t0\nGid:\t100\t100\t100\t100\n";
    assert_eq!(ids(st), None);
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("nantrace-fr-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fixture(s: &str, r: u32) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/flight/{s}/fr_{r}")),
    )
    .unwrap()
}

/// The job's user in these tests: nobody when they run as root (a job of root's is never
/// read), else this process's own user.
fn owner() -> (u32, u32) {
    // SAFETY: no failure mode.
    match unsafe { (libc::geteuid(), libc::getegid()) } {
        (0, _) => (65534, 65534),
        ids => ids,
    }
}

/// Give `p` (not following a link) to [`owner`].
fn own(p: &std::path::Path) {
    let (uid, gid) = owner();
    let c = std::ffi::CString::new(p.display().to_string()).unwrap();
    // SAFETY: a valid path; lchown does not follow a link.
    unsafe { libc::lchown(c.as_ptr(), uid, gid) };
}

/// A source as the trigger's snapshot lists it, for a file of [`owner`].
fn source(rank: u32, paths: &[&std::path::Path], started_s: u64) -> Value {
    let (uid, gid) = owner();
    json!({ "rank": rank, "pid": 4000 + rank, "uid": uid, "gid": gid, "started_s": started_s,
        "paths": paths.iter().map(|p| json!({ "path": p.display().to_string(), "from": "TORCH_FR_DUMP_TEMP_FILE" })).collect::<Vec<_>>() })
}

/// Each rank's dump read or why not: read (decoded, copied), no file, stale, a link, a FIFO,
/// too big, not a pickle.
#[test]
fn each_ranks_dump_is_read_or_says_why_not() {
    let d = tmpdir("read");
    std::fs::write(d.join("fr_0"), fixture("stopped", 0)).unwrap();
    std::fs::write(d.join("fr_2"), fixture("stopped", 2)).unwrap();
    std::os::unix::fs::symlink(d.join("fr_0"), d.join("fr_3")).unwrap();
    let fifo = std::ffi::CString::new(d.join("fr_4").display().to_string()).unwrap();
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    std::fs::write(d.join("fr_5"), vec![b'N'; (DUMP_MAX + 1) as usize]).unwrap();
    std::fs::write(d.join("fr_6"), b"\x80\x02cos\nsystem\n.").unwrap();
    for i in 0..7 {
        own(&d.join(format!("fr_{i}")));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let p = |n: &str| d.join(n);
    let srcs = json!({ "sources": [
        source(0, &[&p("nope_0"), &p("fr_0")], now - 60),
        source(1, &[&p("fr_1")], now - 60),
        source(2, &[&p("fr_2")], now + 3600),
        source(3, &[&p("fr_3")], 0),
        source(4, &[&p("fr_4")], 0),
        source(5, &[&p("fr_5")], 0),
        source(6, &[&p("fr_6")], 0),
    ]});
    let (v, copies) = read(&srcs).unwrap();
    let st: Vec<&str> = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(
        st,
        [
            "read",
            "no_file",
            "stale",
            "refused",
            "refused",
            "too_big",
            "undecodable"
        ]
    );
    let r0 = &v["ranks"][0];
    assert_eq!(r0["path"], p("fr_0").display().to_string());
    assert_eq!(r0["copy"], "flight_recorder/fr_rank_0");
    assert_eq!(r0["dump"]["entries"].as_array().unwrap().len(), 6);
    assert_eq!(r0["dump"]["entries"][5]["collective_seq_id"], 6);
    assert!(
        v["ranks"][1]["why"].as_str().unwrap().contains("fr_1"),
        "{}",
        v["ranks"][1]
    );
    assert!(v["ranks"][2]["why"]
        .as_str()
        .unwrap()
        .contains("earlier job"));
    assert!(v["ranks"][6]["why"].as_str().unwrap().contains("GLOBAL"));
    assert_eq!(v["ranks_read"], 1);
    // The raw copies: the decoded one and the undecodable one (for torch's own tools).
    assert_eq!(
        copies.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
        ["fr_rank_0", "fr_rank_6"]
    );
    assert_eq!(copies[0].1, fixture("stopped", 0));
    assert!(read(&json!({ "not_collected": "x" })).is_none());
    let _ = std::fs::remove_dir_all(&d);
}

/// An earlier job's dump at the first candidate does not hide this job's at the second
/// (the review of 2026-12-04: a stale `$HOME/.cache/torch` file hid a fresh /tmp one), and a
/// path longer than what is shown is still the one opened.
#[test]
fn a_stale_first_candidate_does_not_hide_a_fresh_second_and_long_paths_are_opened_whole() {
    let d = tmpdir("stale2");
    std::fs::write(d.join("old_0"), fixture("stopped", 0)).unwrap();
    std::fs::write(d.join("new_0"), fixture("stopped", 0)).unwrap();
    let long = d.join("x".repeat(200));
    std::fs::create_dir_all(&long).unwrap();
    std::fs::write(long.join("fr_1"), fixture("stopped", 1)).unwrap();
    for f in [d.join("old_0"), d.join("new_0"), long.join("fr_1")] {
        own(&f);
    }
    // old_0 written an hour before the rank started.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let t = std::ffi::CString::new(d.join("old_0").display().to_string()).unwrap();
    let times = [
        libc::timespec { tv_sec: (now - 7200) as i64, tv_nsec: 0 },
        libc::timespec { tv_sec: (now - 7200) as i64, tv_nsec: 0 },
    ];
    // SAFETY: a valid path and two timespecs.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, t.as_ptr(), times.as_ptr(), 0) }, 0);
    let mut s0 = source(0, &[&d.join("old_0"), &d.join("new_0")], now - 3600);
    s0["paths"][0]["from"] = json!("default ($HOME/.cache/torch/comm_lib_trace_rank_)");
    let long_path = long.join("fr_1").display().to_string();
    let s1 = json!({ "rank": 1, "pid": 4001, "uid": owner().0, "gid": owner().1, "started_s": now - 60,
        "paths": [path_entry(&long_path, "TORCH_FR_DUMP_TEMP_FILE")] });
    assert_ne!(s1["paths"][0]["path"], long_path, "shown cut: {}", s1["paths"][0]);
    assert_eq!(s1["paths"][0]["open"], long_path);
    let (v, _) = read(&json!({ "sources": [s0, s1] })).unwrap();
    let r0 = &v["ranks"][0];
    assert_eq!(r0["status"], "read", "{r0}");
    assert_eq!(r0["path"], d.join("new_0").display().to_string());
    assert!(
        r0["earlier_candidate"].as_str().is_some_and(|w| w.contains("old_0") && w.contains("earlier job")),
        "{r0}"
    );
    assert_eq!(v["ranks"][1]["status"], "read", "{}", v["ranks"][1]);
    // Only a stale file anywhere: stale, said.
    let (v, _) = read(&json!({ "sources": [source(0, &[&d.join("nope"), &d.join("old_0")], now - 3600)] })).unwrap();
    assert_eq!(v["ranks"][0]["status"], "stale", "{}", v["ranks"][0]);
    let _ = std::fs::remove_dir_all(&d);
}

/// As root, a file of another user is read with that user's rights: a file it cannot read
/// (root's, mode 0600) is refused even through a path the user could name.
#[test]
fn as_root_the_dump_is_read_with_the_jobs_rights() {
    // SAFETY: no failure mode.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    use std::os::unix::fs::PermissionsExt as _;
    let d = tmpdir("rights");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mine = d.join("fr_0");
    std::fs::write(&mine, fixture("stopped", 1)).unwrap();
    let c = std::ffi::CString::new(mine.display().to_string()).unwrap();
    // SAFETY: a valid path.
    unsafe { libc::chown(c.as_ptr(), 65534, 65534) };
    let (b, _) = read::dump(&mine, Some((65534, 65534)), DUMP_MAX).unwrap();
    assert_eq!(b.len(), fixture("stopped", 1).len());
    let roots = d.join("root_only");
    std::fs::write(&roots, b"secret").unwrap();
    std::fs::set_permissions(&roots, std::fs::Permissions::from_mode(0o600)).unwrap();
    let e = read::dump(&roots, Some((65534, 65534)), DUMP_MAX).unwrap_err();
    assert_eq!(e.status(), "refused", "{e}");
    assert!(
        e.to_string().contains("denied") || e.to_string().contains("owned"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_sources_of_a_process_without_rank_say_so() {
    let none = sources(&BTreeSet::from([std::process::id()]));
    assert!(none["not_collected"].is_string() || none["sources"].is_array());
}
