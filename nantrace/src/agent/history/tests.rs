use std::os::unix::fs::PermissionsExt as _;

use super::*;
use crate::agent::trust::doubtful_gpus;

struct Spool(PathBuf);

impl Spool {
    fn new(tag: &str) -> Spool {
        let d = std::env::temp_dir().join(format!("nt-history-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        Spool(d)
    }

    /// A bundle directory as the agent names them.
    fn bundle(&self, n: u32) -> String {
        let b = self.0.join(format!("nantrace-n1-2026120{n}T100000Z"));
        std::fs::create_dir_all(&b).unwrap();
        b.display().to_string()
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn entry(t: i64, bundle: &str, gpus: &[(&str, Option<&str>)], verdict: &str) -> Entry {
    Entry {
        time_s: t,
        job: "slurm-42".into(),
        trigger: "xid".into(),
        verdict: verdict.into(),
        family: "GPU".into(),
        gpus: gpus
            .iter()
            .map(|(p, u)| Gpu {
                pci: (*p).into(),
                uuid: u.map(String::from),
            })
            .collect(),
        bundle: bundle.into(),
        faults: Vec::new(),
    }
}

const DAY: i64 = 86_400;
const T0: i64 = 1_796_000_000;

#[test]
fn incidents_survive_a_restart_and_a_torn_or_edited_line_is_not_believed() {
    let s = Spool::new("restart");
    let mut h = History::open(&s.0);
    assert!(h.entries.is_empty());
    h.add(entry(
        T0,
        &s.bundle(1),
        &[("0000:3b:00.0", Some("GPU-aaaa"))],
        "PROBABLY THE MACHINE (GPU)",
    ))
    .unwrap();
    h.add(entry(
        T0 + 60,
        &s.bundle(2),
        &[],
        "NOT THE MACHINE (software/configuration)",
    ))
    .unwrap();
    let again = History::open(&s.0);
    assert_eq!(again.entries, h.entries);
    assert_eq!(again.bad_lines, 0);
    // A crash mid-write leaves half a line; someone edits a verdict in place.
    let path = s.0.join(FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replacen(
        "PROBABLY THE MACHINE (GPU)",
        "PROBABLY THE MACHINE (PCIe)",
        1,
    );
    std::fs::write(
        &path,
        format!("{edited}{{\"fnv\":\"00\",\"e\":{{\"time_s\":1"),
    )
    .unwrap();
    let h2 = History::open(&s.0);
    assert_eq!(h2.entries.len(), 1, "{:?}", h2.entries);
    assert_eq!(
        h2.entries[0].verdict,
        "NOT THE MACHINE (software/configuration)"
    );
    assert_eq!(h2.bad_lines, 2);
}

#[test]
fn a_lost_index_is_rebuilt_from_the_bundles_and_the_index_stays_bounded() {
    let s = Spool::new("rebuild");
    let mut h = History::open(&s.0);
    for n in 1..=3 {
        h.add(entry(
            T0 + i64::from(n),
            &s.bundle(n),
            &[("0000:3b:00.0", None)],
            "PROBABLY THE MACHINE (GPU)",
        ))
        .unwrap();
    }
    std::fs::remove_file(s.0.join(FILE)).unwrap();
    let r = History::open(&s.0);
    assert!(r.rebuilt);
    assert_eq!(r.entries, h.entries);
    assert!(s.0.join(FILE).exists(), "the rebuilt index is written");
    // Bounded: past MAX_ENTRIES the newest half stays.
    let mut h = r;
    let b = s.bundle(9);
    for i in 0..MAX_ENTRIES as i64 {
        h.entries.push(entry(T0 + 10 + i, &b, &[], "x"));
    }
    h.add(entry(T0 + 1_000_000, &b, &[], "last")).unwrap();
    assert!(
        h.entries.len() <= MAX_ENTRIES / 2 + 5,
        "{}",
        h.entries.len()
    );
    let back = History::open(&s.0);
    assert_eq!(back.entries.len(), h.entries.len());
    assert_eq!(back.entries.last().unwrap().verdict, "last");
}

#[test]
fn a_gpu_implicated_three_times_in_a_week_is_a_repeat_offender() {
    let s = Spool::new("repeat");
    let mut h = History::open(&s.0);
    let gpu = [("0000:3b:00.0", Some("GPU-aaaa"))];
    h.add(entry(
        T0 - 20 * DAY,
        &s.bundle(1),
        &gpu,
        "PROBABLY THE MACHINE (GPU)",
    ))
    .unwrap();
    h.add(entry(
        T0 - 3 * DAY,
        &s.bundle(2),
        &gpu,
        "POSSIBLY THE MACHINE (GPU, or the job's own code)",
    ))
    .unwrap();
    let second = entry(T0 - DAY, &s.bundle(3), &gpu, "PROBABLY THE MACHINE (GPU)");
    h.add(second.clone()).unwrap();
    let sec = h.section(&second).unwrap();
    assert!(sec.contains("GPU 0000:3b:00.0 (GPU-aaaa) was implicated in 2 earlier incidents on this node in 30 days"), "{sec}");
    assert!(!sec.contains("Repeat offender"), "2 in 7 days: {sec}");
    let now = entry(T0, &s.bundle(4), &gpu, "PROBABLY THE MACHINE (GPU)");
    h.add(now.clone()).unwrap();
    let sec = h.section(&now).unwrap();
    assert!(sec.contains("implicated in 3 earlier incidents") && sec.contains("Repeat offender: implicated 3 times in 7 days: drain the node and send GPU 0000:3b:00.0 (GPU-aaaa) for service"), "{sec}");
    // Another GPU of the node: its own story.
    let other = entry(
        T0,
        &s.bundle(5),
        &[("0000:5e:00.0", None)],
        "PROBABLY THE MACHINE (GPU)",
    );
    h.add(other.clone()).unwrap();
    assert!(h
        .section(&other)
        .unwrap()
        .contains("GPU 0000:5e:00.0: no earlier incident"));
    assert!(h
        .section(&entry(T0, &s.bundle(6), &[], "NOT THE MACHINE"))
        .is_none());
    // ctl history: by UUID or PCI address, since a time.
    assert_eq!(h.query(Some("gpu-AAAA"), 0).len(), 4);
    assert_eq!(h.query(Some("0000:3B:00.0"), T0 - 7 * DAY).len(), 3);
    assert_eq!(h.query(None, T0 - 1).len(), 2);
    assert_eq!(h.per_gpu().get("0000:3b:00.0"), Some(&4));
    assert_eq!(
        h.answer(Some("0000:5e:00.0"), 0)["incidents"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn since_reads_days_hours_minutes_and_seconds() {
    assert_eq!(parse_since("30d"), Some(30 * DAY));
    assert_eq!(parse_since("12h"), Some(12 * 3600));
    assert_eq!(parse_since("90m"), Some(5400));
    assert_eq!(parse_since("3600"), Some(3600));
    for bad in ["", "d", "-1d", "1y", "99999999999d", "1.5d"] {
        assert_eq!(parse_since(bad), None, "{bad}");
    }
    assert_eq!(
        verdict_head("PROBABLY THE MACHINE (GPU): Xid 79 on 0000:3b:00.0"),
        "PROBABLY THE MACHINE (GPU)"
    );
}

/// redteam4 D-5 (H2, P3): one Xid 79 line on a node with three watched jobs gave three
/// entries and "Repeat offender"; each later incident in the window implicated it again. The
/// same fault (GPU, signal, time within FAULT_SAME_MS) in several bundles is one incident;
/// three distinct faults in a week still make a repeat offender.
#[test]
fn one_fault_in_three_watched_jobs_bundles_is_one_incident() {
    let s = Spool::new("one-fault");
    let mut h = History::open(&s.0);
    let gpu = [("0000:00:02.0", None)];
    let with = |t: i64, b: u32, fault_ms: i64| {
        let mut e = entry(t, &s.bundle(b), &gpu, "PROBABLY THE MACHINE (GPU)");
        e.faults = vec![Fault {
            pci: "0000:00:02.0".into(),
            signal: "xid_fatal".into(),
            time_ms: fault_ms,
        }];
        e
    };
    let x = T0 * 1000;
    // Three jobs' bundles of one line (their clocks read it 3 ms and 40 ms apart).
    for (b, d) in [(1, 0), (2, 3), (3, 40)] {
        let e = with(T0 + i64::from(b), b, x + d);
        h.add(e.clone()).unwrap();
        let sec = h.section(&e).unwrap();
        assert!(!sec.contains("Repeat offender"), "bundle {b}: {sec}");
        assert!(sec.contains("no earlier incident"), "bundle {b}: {sec}");
    }
    assert_eq!(h.per_gpu().get("0000:00:02.0"), Some(&1));
    // Two more Xids, an hour and a day later: three faults in a week.
    h.add(with(T0 + 3600, 4, x + 3_600_000)).unwrap();
    let third = with(T0 + DAY, 5, x + DAY * 1000);
    h.add(third.clone()).unwrap();
    let sec = h.section(&third).unwrap();
    assert!(sec.contains("implicated in 2 earlier incidents"), "{sec}");
    assert!(
        sec.contains("Repeat offender: implicated 3 times in 7 days"),
        "{sec}"
    );
    assert_eq!(h.per_gpu().get("0000:00:02.0"), Some(&3));
    // Written and read back: the faults survive a restart, the checksum holds.
    let again = History::open(&s.0);
    assert_eq!(again.bad_lines, 0);
    assert_eq!(again.per_gpu().get("0000:00:02.0"), Some(&3));
}

/// redteam4 D-10 (H6): one user's 1-s jobs exiting 1 made 46 incidents in 21 s; past
/// MAX_ENTRIES the oldest half was dropped, so about 30 min of that pushed a GPU's record out.
/// Entries without GPU evidence go first: the GPU's three incidents stay a repeat offender
/// through a flood past MAX_ENTRIES (an eviction), and a restart reads them back.
#[test]
fn a_flood_of_incidents_without_gpu_evidence_does_not_erase_a_gpus_record() {
    let s = Spool::new("flood");
    let mut h = History::open(&s.0);
    let gpu = [("0000:3b:00.0", None)];
    for i in 0..3 {
        h.add(entry(
            T0 + i * 3600,
            &s.bundle(1 + i as u32),
            &gpu,
            "PROBABLY THE MACHINE (GPU)",
        ))
        .unwrap();
    }
    let junk = s.bundle(99);
    for i in 0..(MAX_ENTRIES + 100) as i64 {
        h.add(entry(T0 + 20_000 + i, &junk, &[], "NOT THE MACHINE"))
            .unwrap();
    }
    assert!(h.entries.len() <= MAX_ENTRIES, "{}", h.entries.len());
    assert_eq!(h.query(Some("0000:3b:00.0"), 0).len(), 3);
    let again = History::open(&s.0);
    assert_eq!(again.query(Some("0000:3b:00.0"), 0).len(), 3);
    let now = entry(
        T0 + 4 * 3600,
        &s.bundle(50),
        &gpu,
        "PROBABLY THE MACHINE (GPU)",
    );
    let mut again = again;
    again.add(now.clone()).unwrap();
    assert!(again.section(&now).unwrap().contains("Repeat offender"));
}

/// redteam4 D-14 for the history: a GPU named only by a kernel log line written into
/// /dev/kmsg from user space (a relay of a user's text) or no longer in the buffer is not
/// counted, and why is said; the kernel's own line, NVML's record, or root's line with
/// `trust_user_written_kmsg` count.
#[test]
fn a_gpu_named_only_by_a_user_written_line_is_not_counted() {
    use crate::klog::Writer;
    use crate::report::GpuWitness;
    let line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.";
    let d = crate::session::Dumped {
        gpus: vec![("0000:3b:00.0".into(), None), ("0000:5e:00.0".into(), None)],
        gpu_witnesses: vec![
            GpuWitness {
                pci: "0000:3b:00.0".into(),
                unforgeable: false,
                lines: vec![crate::klog::Line::new(line, 5, None)],
            },
            GpuWitness {
                pci: "0000:5e:00.0".into(),
                unforgeable: true,
                lines: Vec::new(),
            },
        ],
        ..Default::default()
    };
    let user = |l: &[crate::klog::Line]| Ok(vec![Writer::UserSpace { facility: 1 }; l.len()]);
    let doubtful = doubtful_gpus(&d, false, user);
    assert_eq!(doubtful.len(), 1, "{doubtful:?}");
    assert_eq!(doubtful[0].0, "0000:3b:00.0");
    assert!(
        doubtful[0].1.contains("from user space (facility 1)"),
        "{doubtful:?}"
    );
    assert!(doubtful_gpus(&d, true, user).is_empty());
    assert!(doubtful_gpus(&d, false, |l: &[crate::klog::Line]| Ok(vec![
        Writer::Kernel;
        l.len()
    ]))
    .is_empty());
    let gone = doubtful_gpus(&d, true, |l: &[crate::klog::Line]| {
        Ok(vec![Writer::NotFound; l.len()])
    });
    assert_eq!(
        gone.len(),
        1,
        "a line no longer in the buffer proves nothing: {gone:?}"
    );
}
