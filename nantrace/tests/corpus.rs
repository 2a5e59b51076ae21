//! Corpus tests: real lines copied from public bug reports (the source URL is on each line of
//! tests/corpus/*.tsv), classified by the same code the session runs. Each family's count and
//! accuracy is printed; docs/log-formats.md records them. Not privileged: pure classification.
use std::collections::BTreeMap;

use nantrace::session::LineReader;

fn rows(file: &str) -> Vec<Vec<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(file);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split('\t').map(String::from).collect())
        .collect()
}

/// Lines nantrace knowingly gets wrong, with the reason (a fix would over-fit or weaken a
/// safety rule). Any other miss fails the test.
const KNOWN_MISSES: &[(&str, &str)] = &[
    ("INFO - INFO - [ 6166.009184] mlxsw_spectrum", "a log shipper's `INFO - INFO - ` prefix: kernel patterns stay anchored (a prefix nantrace does not know could be a forged process name)"),
    ("INFO - INFO - [ 6160.176012] mlxsw_spectrum", "same"),
    ("RuntimeError: File my_out/checkpoints/checkpoint_0.pt cannot be opened.", "could be a wrong path as well as a storage fault: not evidence by itself"),
];

/// Per label: (right, total), and the wrong ones.
fn score(items: impl Iterator<Item = (String, String, String)>) -> (BTreeMap<String, (usize, usize)>, Vec<String>) {
    let mut per: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (want, got, line) in items {
        let e = per.entry(want.clone()).or_default();
        e.1 += 1;
        if want == got {
            e.0 += 1;
        } else if !KNOWN_MISSES.iter().any(|(k, _)| line.contains(k)) {
            wrong.push(format!("want {want}, got {got}: {line}"));
        }
    }
    for (k, (r, t)) in &per {
        eprintln!("  {k:<20} {r:>3}/{t:<3}");
    }
    (per, wrong)
}

#[test]
fn joblog_corpus() {
    let items = rows("joblog.tsv").into_iter().map(|c| {
        let got = nantrace::joblog::classify(&c[2]).map_or("none", |f| f.family.as_str()).to_string();
        (c[0].clone(), got, c[2].clone())
    });
    eprintln!("job output corpus:");
    let (per, wrong) = score(items);
    let total: usize = per.values().map(|v| v.1).sum();
    assert!(total >= 300, "corpus shrank: {total}");
    assert!(wrong.is_empty(), "{} of {total} wrong:\n{}", wrong.len(), wrong.join("\n"));
}

#[test]
fn tracebacks_are_read_as_one_error_and_the_innermost_cause_wins() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/tracebacks");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    files.sort();
    assert!(files.len() >= 8);
    let mut wrong = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let want = text.lines().find_map(|l| l.strip_prefix("# expect: ")).unwrap().trim().to_string();
        let mut r = LineReader::new(nantrace::nanscan::Scanner::default());
        let faults: Vec<_> = text.lines().filter(|l| !l.starts_with("# ")).filter_map(|l| r.read(l).fault).collect();
        // What the report ranks first: specific lines before generic ones, machine families by severity.
        let rank = |f: &nantrace::joblog::JobFault| {
            use nantrace::joblog::JobFamily::*;
            let base = match f.family { GpuHw => 9, HostMemory => 8, Network => 7, Storage => 6, GpuAmbiguous => 5, Hang => 3, GpuOom => 2, Software => 1 };
            base - if f.generic { 5 } else { 0 }
        };
        let top = faults.iter().max_by_key(|f| rank(f)).map_or("none", |f| f.family.as_str());
        if top != want {
            wrong.push(format!("{}: want {want}, got {top} ({:?})", f.display(), faults.iter().map(|f| (f.family, f.kind)).collect::<Vec<_>>()));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn kernel_corpus() {
    let map = |c: &nantrace::classify::KmsgClass| -> &'static str {
        use nantrace::classify::KmsgClass::*;
        match c {
            Xid { .. } => "xid",
            Sxid { .. } => "sxid",
            GpuFallenOffBus { .. } => "gpu_fallen_off_bus",
            Aer { .. } => "aer",
            OomKill { .. } | OomInvoked => "oom_kill",
            LinkDown { .. } => "link_down",
            LinkUp { .. } => "link_up",
            NicError { .. } => "mlx5_error",
            HungTask { .. } => "hung_task",
            SoftLockup { .. } => "soft_lockup",
            RcuStall => "rcu_stall",
            MachineCheck { .. } => "machine_check",
            CpuThermal { .. } => "cpu_thermal",
            NetFsDown { .. } => "nfs_not_responding",
            NetFsOk { .. } => "nfs_ok",
            StaleHandle { .. } => "stale_handle",
            BlockError { .. } => "block_io_error",
            Segfault { gpu_library: true, .. } => "segfault_gpu_lib",
            Segfault { .. } => "segfault_other",
        }
    };
    let items = rows("kernel.tsv").into_iter().map(|c| {
        let got = nantrace::classify::classify(&c[1]).map_or("none", |k| map(&k)).to_string();
        (c[0].clone(), got, c[1].clone())
    });
    eprintln!("kernel corpus:");
    let (per, wrong) = score(items);
    let total: usize = per.values().map(|v| v.1).sum();
    assert!(total >= 150, "corpus shrank: {total}");
    assert!(wrong.is_empty(), "{} of {total} wrong:\n{}", wrong.len(), wrong.join("\n"));
}

#[test]
fn nan_corpus() {
    let items = rows("nan.tsv").into_iter().map(|c| {
        let mut r = LineReader::new(nantrace::nanscan::Scanner::default());
        let got = if r.read(&c[1]).nonfinite { "nan" } else { "none" }.to_string();
        (c[0].clone(), got, c[1].clone())
    });
    eprintln!("NaN corpus:");
    let (per, wrong) = score(items);
    let total: usize = per.values().map(|v| v.1).sum();
    assert!(total >= 60, "corpus shrank: {total}");
    assert!(wrong.is_empty(), "{} of {total} wrong:\n{}", wrong.len(), wrong.join("\n"));
}
