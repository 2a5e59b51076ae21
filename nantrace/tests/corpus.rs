//! Corpus tests: real lines copied from public bug reports (the source URL is on each line of
//! tests/corpus/*.tsv), classified by the same code the session runs. Each family's count and
//! accuracy is printed; docs/log-formats.md records them. Not privileged: pure classification.
use std::collections::BTreeMap;

use nantrace::session::LineReader;

fn rows(file: &str) -> Vec<Vec<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(file);
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
    // The two corpora (collected separately) label these differently; nantrace keeps one rule.
    ("[E ProcessGroupNCCL.cpp:325] Some NCCL operations have failed or timed out.", "corpora disagree (none / hang): nantrace says a generic hang that gives way to any specific cause"),
    ("\"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\" disables this message", "corpora disagree: part of a hung-task report, counted as one"),
    ("oom_reaper: reaped process 15784", "corpora disagree: the reaper line names the OOM victim, one kill with the others"),
    ("Failed to check the \"should dump\" flag on TCPStore", "corpora disagree (none / network): teardown after another rank died, not evidence"),
    ("W tensorflow/stream_executor/platform/default/dso_loader.cc:64] Could not load dynamic library", "corpora disagree (software / none): a missing library is configuration, even when TF falls back"),
    ("[PG 5 Rank 0] ProcessGroupNCCL preparing to dump debug info.", "corpora disagree (hang / none): printed when the watchdog fires"),
    ("ib_mlx5_log.c:139  DCI QP 0x7fba", "corpora disagree (network / none): UCX's completion-error dump"),
    ("sonic login: [10304.603691] NMI watchdog", "console noise before the kernel line: kernel patterns stay anchored"),
    ("gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation", "labelled network by the held-out collector; nantrace reads gloo's collective timeout as a hang (a peer rank never sent), as NCCL's watchdog timeout: a real 3-rank torch job whose rank 1 stopped in Python prints exactly this on the waiting ranks (tests/torch_job.rs)"),
    ("**grad_norm: 0.3922 (nan)**", "a running average in parentheses under fp16 loss scaling: not this step's value"),
    ("2000      [nan]         [nan]         [nan]", "a table row whose header (with the loss column names) is not in the corpus line"),
];

/// Per label: (right, total), and the wrong ones.
fn score(
    items: impl Iterator<Item = (String, String, String)>,
) -> (BTreeMap<String, (usize, usize)>, Vec<String>) {
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
    joblog_file("joblog.tsv", 300);
}

#[test]
fn joblog_heldout() {
    joblog_file("heldout/joblog.tsv", 200);
}

fn joblog_file(file: &str, min: usize) {
    let items = rows(file).into_iter().map(|c| {
        let line = &c[c.len() - 2];
        let got = nantrace::joblog::classify(line)
            .map_or("none", |f| f.family.as_str())
            .to_string();
        (c[0].clone(), got, line.clone())
    });
    eprintln!("job output corpus {file}:");
    let (per, wrong) = score(items);
    let total: usize = per.values().map(|v| v.1).sum();
    assert!(total >= min, "corpus shrank: {total}");
    assert!(
        wrong.is_empty(),
        "{} of {total} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn tracebacks_are_read_as_one_error_and_the_innermost_cause_wins() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/tracebacks");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    assert!(files.len() >= 8);
    let mut wrong = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let want = text
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .unwrap()
            .trim()
            .to_string();
        let mut r = LineReader::new(nantrace::nanscan::Scanner::default());
        let faults: Vec<_> = text
            .lines()
            .filter(|l| !l.starts_with("# "))
            .filter_map(|l| r.read(l).fault)
            .collect();
        // What the report ranks first: specific lines before generic ones, machine families by severity.
        let rank = |f: &nantrace::joblog::JobFault| {
            use nantrace::joblog::JobFamily::*;
            let base = match f.family {
                GpuHw => 9,
                HostMemory => 8,
                Network => 7,
                Storage => 6,
                GpuAmbiguous => 5,
                Hang => 3,
                GpuOom => 2,
                Software => 1,
            };
            base - if f.generic { 5 } else { 0 }
        };
        let top = faults
            .iter()
            .max_by_key(|f| rank(f))
            .map_or("none", |f| f.family.as_str());
        if top != want {
            wrong.push(format!(
                "{}: want {want}, got {top} ({:?})",
                f.display(),
                faults
                    .iter()
                    .map(|f| (f.family, f.kind))
                    .collect::<Vec<_>>()
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn kernel_corpus() {
    kernel_file("kernel.tsv", 150);
}

#[test]
fn kernel_heldout() {
    kernel_file("heldout/kernel.tsv", 100);
}

fn kernel_file(file: &str, min: usize) {
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
            Segfault {
                gpu_library: true, ..
            } => "segfault_gpu_lib",
            Segfault { .. } => "segfault_other",
        }
    };
    let items = rows(file).into_iter().map(|c| {
        let got = nantrace::classify::classify(&c[1])
            .map_or("none", |k| map(&k))
            .to_string();
        (c[0].clone(), got, c[1].clone())
    });
    eprintln!("kernel corpus {file}:");
    let (per, wrong) = score(items);
    let total: usize = per.values().map(|v| v.1).sum();
    assert!(total >= min, "corpus shrank: {total}");
    assert!(
        wrong.is_empty(),
        "{} of {total} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn nan_corpus() {
    nan_file("nan.tsv", 60);
}

#[test]
fn nan_heldout() {
    nan_file("heldout/nan.tsv", 50);
}

fn nan_file(file: &str, min: usize) {
    let items = rows(file).into_iter().map(|c| {
        let mut r = LineReader::new(nantrace::nanscan::Scanner::default());
        let got = if r.read(&c[1]).nonfinite {
            "nan"
        } else {
            "none"
        }
        .to_string();
        (c[0].clone(), got, c[1].clone())
    });
    eprintln!("NaN corpus {file}:");
    let (per, wrong) = score(items);
    let total: usize = per.values().map(|v| v.1).sum();
    assert!(total >= min, "corpus shrank: {total}");
    assert!(
        wrong.is_empty(),
        "{} of {total} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
