//! `cargo xtask vm-test`: the kernel matrix. Boots each kernel of [`KERNELS`] (Debian's own
//! packages, cached) in QEMU and runs inside it `nantrace doctor` and the kernel integration
//! tests (`kernel_log`, `kernel_membership`, `kernel_events`, `incident` on the BTF path;
//! `kernel_membership` and `kernel_events` again on the tracefs fallback), with the very binaries built here: the guest mounts the host's
//! root read-only over 9p (scripts/vm/). Prints a table per kernel and fails when a test
//! fails or a kernel differs from what [`KERNELS`] says it can do (which probes run on the
//! tracefs path and why, where the kernel log comes from).
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{root, run};

mod console;

/// One kernel of the matrix and what it is expected to do.
pub struct Kernel {
    pub label: &'static str,
    pub suite: &'static str,
    /// `linux-image-amd64` (what the suite's metapackage points at) or an anchored regex of
    /// package names (the highest version).
    pub spec: &'static str,
    /// Probes that must run on the tracefs path on this kernel, each with words of the reason
    /// `doctor` must give (a kernel feature, never a verifier refusal). Every other probe with
    /// a BTF program must be on BTF.
    pub tracefs: &'static [(&'static str, &'static str)],
    /// Where the kernel log must come from: `printk:console` or `/dev/kmsg`.
    pub klog: &'static str,
}

pub const KERNELS: &[Kernel] = &[
    Kernel {
        label: "5.10-bullseye",
        suite: "bullseye",
        spec: "linux-image-amd64",
        tracefs: &[
            ("block:block_rq_issue", "request_queue.disk"),
            ("block:block_rq_complete", "request_queue.disk"),
        ],
        klog: "/dev/kmsg",
    },
    Kernel {
        label: "6.1-bookworm",
        suite: "bookworm",
        spec: "linux-image-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
    Kernel {
        label: "6.12-trixie",
        suite: "trixie",
        spec: "linux-image-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
    Kernel {
        label: "6.18-trixie-bpo",
        suite: "trixie-backports",
        spec: r"linux-image-6\.18\.[0-9]+\+deb13-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
    Kernel {
        label: "7.x-trixie-bpo",
        suite: "trixie-backports",
        spec: "linux-image-amd64",
        tracefs: &[],
        klog: "printk:console",
    },
];

/// Modules the guest loads (with their dependencies) where the kernel builds them as modules:
/// 9p for the host's root, loop for block I/O, veth and nf_tables for the TCP retransmit test.
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "loop",
    "veth",
    "crc32c_generic",
    "nf_tables",
];

/// Test suites run in the guest: (path, test target), every test of each (none is kept to the
/// host: the last three that were, for hangs and sleeps under TCG, were fixed at their cause;
/// docs/kernel-matrix.md).
const SUITES: &[(&str, &str)] = &[
    ("btf", "kernel_log"),
    ("btf", "kernel_membership"),
    ("btf", "kernel_events"),
    ("btf", "incident"),
    ("tracefs", "kernel_membership"),
    ("tracefs", "kernel_events"),
];

pub struct Args {
    pub kernels: Option<String>,
    pub docs: bool,
}

fn cache() -> PathBuf {
    std::env::var_os("NANTRACE_VM_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/nantrace-vm"), PathBuf::from)
}

/// The test executables cargo built for `targets`, by target name.
fn test_binaries(targets: &[&str]) -> Result<BTreeMap<String, PathBuf>> {
    let mut c = Command::new("cargo");
    c.current_dir(root()).args([
        "test",
        "--locked",
        "-p",
        "nantrace",
        "--no-run",
        "--message-format=json",
    ]);
    for t in targets {
        c.args(["--test", t]);
    }
    let o = c
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !o.status.success() {
        bail!("cargo test --no-run failed");
    }
    let mut out = BTreeMap::new();
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let (Some(exe), Some(name)) = (v["executable"].as_str(), v["target"]["name"].as_str()) {
            if v["target"]["kind"][0] == "test" {
                out.insert(name.to_string(), PathBuf::from(exe));
            }
        }
    }
    for t in targets {
        if !out.contains_key(*t) {
            bail!("cargo built no test binary for {t}");
        }
    }
    Ok(out)
}

/// One suite's result in a guest: (path, name, passed, failures, flaky, seconds, finished).
type Suite = (String, String, usize, Vec<String>, usize, f64, bool);

/// What one kernel's run gave.
#[derive(Default)]
struct Outcome {
    package: String,
    uname: String,
    boot_s: String,
    wall_s: f64,
    doctor: Value,
    /// (path, suite) -> (passed, failed names, total, seconds, finished)
    suites: Vec<Suite>,
    problems: Vec<String>,
    /// Tests that failed once and passed when run again alone (guest.sh): reported, with
    /// their first failure, in the table and on stderr; not problems.
    flaky: Vec<String>,
    /// The guest ran to its end (`done`): false after a guest kernel panic or a hang.
    finished: bool,
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The verifier's key line out of a fallback reason: the failing instruction and its error.
pub fn key_line(why: &str) -> String {
    let parts: Vec<&str> = why.split(" | ").collect();
    let is_insn = |s: &str| {
        let s = s.trim_start();
        let d = s.bytes().take_while(u8::is_ascii_digit).count();
        d > 0 && s[d..].starts_with(": (")
    };
    match parts
        .iter()
        .rposition(|p| is_insn(p.rsplit(" ... ").next().unwrap_or(p)))
    {
        Some(i) => {
            let insn = parts[i].rsplit(" ... ").next().unwrap_or(parts[i]);
            let insn = insn.split(" ; ").next().unwrap_or(insn).trim();
            let err = parts.get(i + 1).map_or("", |s| s.trim());
            format!("{insn} -> {err}")
        }
        None => why.chars().take(160).collect(),
    }
}

/// Compare what doctor said with what the kernel's entry expects.
fn check_doctor(k: &Kernel, d: &Value, problems: &mut Vec<String>) {
    let Some(probes) = d["probes"].as_array() else {
        problems.push(format!("no doctor report: {}", d["load_error"]));
        return;
    };
    for p in probes {
        let tp = p["tracepoint"].as_str().unwrap_or("?");
        let attached = p["attached"] == true;
        let reason = p["reason"].as_str().unwrap_or("");
        if !attached {
            let expected =
                tp == "printk:console" && k.klog == "/dev/kmsg" && reason.contains("/dev/kmsg");
            if !expected {
                problems.push(format!("{tp} not attached: {reason}"));
            }
            continue;
        }
        let Some(why) = p["btf_fallback"].as_str() else {
            continue;
        };
        // Probes with a BTF program that run on tracefs.
        if p["path"] != "tracefs" {
            continue;
        }
        match k.tracefs.iter().find(|(t, _)| *t == tp) {
            Some((_, words)) if why.contains(words) => {}
            Some((_, words)) => problems.push(format!(
                "{tp} on tracefs, but not for the expected reason ({words}): {}",
                key_line(why)
            )),
            None => problems.push(format!("{tp} on tracefs: {}", key_line(why))),
        }
    }
    for (tp, _) in k.tracefs {
        if probes
            .iter()
            .any(|p| p["tracepoint"] == *tp && p["path"] == "btf")
        {
            problems.push(format!(
                "{tp} is on BTF, expected on tracefs: update KERNELS in xtask/src/vm.rs"
            ));
        }
    }
    let src = d["kernel_log"]["source"].as_str().unwrap_or("none");
    if src != k.klog {
        problems.push(format!(
            "kernel log from {src}, expected {}: {}",
            k.klog, d["kernel_log"]["why"]
        ));
    }
}

/// (passed, failed names, total, finished) from libtest's output: the totals from its
/// `test result:` line, the failed names from its closing `failures:` list (a test's own
/// output can land on its `test NAME ... ` line, e.g. a shell's "Killed").
fn parse_suite(log: &str) -> (usize, Vec<String>, usize, bool) {
    let Some(result) = log.lines().rev().find(|l| l.starts_with("test result:")) else {
        let started = log
            .lines()
            .filter(|l| l.starts_with("test ") && l.contains(" ... "))
            .count();
        return (0, Vec::new(), started, false);
    };
    let num = |word: &str| {
        result
            .split(';')
            .find_map(|part| {
                part.trim()
                    .strip_suffix(word)
                    .and_then(|n| n.trim().rsplit(' ').next()?.parse::<usize>().ok())
            })
            .unwrap_or(0)
    };
    let (passed, failed_n, ignored) = (num("passed"), num("failed"), num("ignored"));
    let mut failed = Vec::new();
    // The last "failures:" header is followed by the list of names, indented.
    if let Some(pos) = log.rfind("\nfailures:\n") {
        for l in log[pos + 11..].lines() {
            let name = l.trim();
            if name.is_empty() || name.starts_with("test result:") {
                break;
            }
            failed.push(name.to_string());
        }
    }
    if failed.len() < failed_n {
        failed.push(format!("{} more failed", failed_n - failed.len()));
    }
    (passed, failed, passed + failed_n + ignored, true)
}

/// Whether a test's second run alone (guest.sh's `rerun.*` files) passed: rc 0, and libtest
/// ran exactly that one test and it passed.
fn passed_alone(log: &str, rc: &str) -> bool {
    let (passed, failed, total, done) = parse_suite(log);
    rc.trim() == "0" && done && passed == 1 && failed.is_empty() && total == 1
}

/// The panic of a failed test, from its `---- NAME stdout ----` section: the `panicked at`
/// line and the few after it, each cut short, so that a CI log shows why without the guest's
/// files (which stay on the CI machine).
fn panic_of(log: &str, name: &str) -> String {
    let Some(pos) = log.find(&format!("---- {name} stdout ----")) else {
        return String::new();
    };
    let mut lines = log[pos..]
        .lines()
        .skip(1)
        .skip_while(|l| !l.contains("panicked at"));
    let mut out = String::new();
    for l in lines.by_ref().take(4) {
        if l.starts_with("---- ") || l.starts_with("note: run with") || l.trim() == "failures:" {
            break;
        }
        let cut: String = l.chars().take(300).collect();
        let _ = write!(out, "\n      {cut}");
    }
    out
}

/// What a guest that did not finish was doing: the last test its running suite started
/// (`test NAME ...` without a result), so that a panic or a hang names the test.
fn running_test(dir: &Path) -> String {
    for (path, t) in SUITES.iter().rev() {
        let log = read(&dir.join(format!("test.{path}.{t}.log")));
        if log.is_empty() || dir.join(format!("test.{path}.{t}.rc")).exists() {
            continue;
        }
        let last = log
            .lines()
            .rev()
            .find(|l| l.starts_with("test "))
            .unwrap_or("(before its first test)");
        return format!(", during {t} ({path}): {last}");
    }
    String::new()
}

fn run_kernel(
    k: &Kernel,
    dir: &Path,
    nt: &Path,
    bins: &BTreeMap<String, PathBuf>,
) -> Result<Outcome> {
    let mut o = Outcome::default();
    let kdir = cache().join("kernels").join(k.label);
    let mut fetch = Command::new("bash");
    fetch
        .arg(root().join("scripts/vm/fetch-kernel.sh"))
        .arg(cache())
        .args([k.label, k.suite, k.spec])
        .args(MODULES);
    run(&mut fetch).with_context(|| format!("fetching the {} kernel", k.label))?;
    o.package = read(&kdir.join("package")).trim().to_string();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    std::fs::copy(root().join("scripts/vm/guest.sh"), dir.join("guest.sh"))?;
    let tests: Vec<String> = SUITES
        .iter()
        .map(|(path, t)| format!("{path}:{t}:{}", bins[*t].display()))
        .collect();
    let expect_tracefs: Vec<&str> = k.tracefs.iter().map(|(t, _)| *t).collect();
    std::fs::write(
        dir.join("vm.env"),
        format!(
            "NT={}\nREPO={}\nTESTS=\"{}\"\nTEST_TIMEOUT=360\nexport NANTRACE_EXPECT_TRACEFS=\"{}\"\n",
            nt.display(),
            root().display(),
            tests.join(" "),
            expect_tracefs.join(",")
        ),
    )?;
    let t0 = Instant::now();
    let st = Command::new("bash")
        .arg(root().join("scripts/vm/boot.sh"))
        .arg(&kdir)
        .arg(dir)
        .arg("1500")
        .status()?;
    o.wall_s = t0.elapsed().as_secs_f64();
    if !st.success() {
        o.problems.push(format!("qemu: {st}"));
    }
    o.finished = dir.join("done").exists();
    if !o.finished {
        let serial = read(&dir.join("serial.log"));
        o.problems.push(format!(
            "the guest did not finish{}{}",
            running_test(dir),
            console::story(&serial)
        ));
    }
    o.uname = read(&dir.join("uname")).trim().to_string();
    o.boot_s = read(&dir.join("boot_to_init_s")).trim().to_string();
    o.doctor = serde_json::from_str(&read(&dir.join("doctor.json"))).unwrap_or(Value::Null);
    check_doctor(k, &o.doctor, &mut o.problems);
    for (path, t) in SUITES {
        let log = read(&dir.join(format!("test.{path}.{t}.log")));
        let (passed, failed, total, finished) = parse_suite(&log);
        let secs = read(&dir.join(format!("test.{path}.{t}.time")))
            .split_whitespace()
            .filter_map(|x| x.parse::<f64>().ok())
            .collect::<Vec<_>>();
        let secs = if secs.len() == 2 {
            secs[1] - secs[0]
        } else {
            0.0
        };
        if !finished {
            o.problems.push(format!(
                "{t} ({path}) did not finish (rc {})",
                read(&dir.join(format!("test.{path}.{t}.rc"))).trim()
            ));
        }
        for f in &failed {
            let rerun = read(&dir.join(format!("rerun.{path}.{t}.{f}.log")));
            let again = read(&dir.join(format!("rerun.{path}.{t}.{f}.rc")));
            // A wrong answer is never flaky (issue 30): the second run alone is evidence for
            // whoever reads the failure, not a pass.
            if passed_alone(&rerun, &again) {
                o.problems.push(format!(
                    "{t} ({path}): {f} FAILED, then passed alone (a test that fails once is a bug to find){}",
                    panic_of(&log, f)
                ));
            } else {
                let second = if rerun.is_empty() {
                    String::new()
                } else {
                    format!(
                        "\n    and again alone (rc {}){}",
                        again.trim(),
                        panic_of(&rerun, f)
                    )
                };
                o.problems.push(format!(
                    "{t} ({path}): {f} FAILED{}{second}",
                    panic_of(&log, f)
                ));
            }
        }
        o.suites.push((
            (*path).to_string(),
            (*t).to_string(),
            passed,
            failed,
            total,
            secs,
            finished,
        ));
    }
    Ok(o)
}

fn probe_cell(d: &Value) -> (String, String, String, String) {
    let Some(probes) = d["probes"].as_array() else {
        return ("-".into(), "-".into(), "-".into(), "-".into());
    };
    let attached = probes.iter().filter(|p| p["attached"] == true).count();
    let count = |path: &str| {
        probes
            .iter()
            .filter(|p| p["attached"] == true && p["path"] == path)
            .count()
    };
    let short = |tp: &str| {
        tp.rsplit(':')
            .next()
            .unwrap_or(tp)
            .trim_start_matches("sched_process_")
            .trim_start_matches("block_")
            .to_string()
    };
    let btf: Vec<String> = probes
        .iter()
        .filter(|p| p["attached"] == true && p["path"] == "btf")
        .map(|p| short(p["tracepoint"].as_str().unwrap_or("?")))
        .collect();
    let fallback: Vec<String> = probes
        .iter()
        .filter(|p| p["path"] == "tracefs" && p["btf_fallback"].is_string())
        .map(|p| {
            format!(
                "{}: {}",
                short(p["tracepoint"].as_str().unwrap_or("?")),
                key_line(p["btf_fallback"].as_str().unwrap_or(""))
            )
        })
        .collect();
    let not: Vec<String> = probes
        .iter()
        .filter(|p| p["attached"] != true)
        .map(|p| p["tracepoint"].as_str().unwrap_or("?").to_string())
        .collect();
    (
        format!(
            "{attached}/{} (btf {}, tracefs {}, kmsg {})",
            probes.len(),
            count("btf"),
            count("tracefs"),
            count("kmsg")
        ),
        if btf.is_empty() {
            "-".into()
        } else {
            btf.join(", ")
        },
        if fallback.is_empty() {
            "-".into()
        } else {
            fallback.join("; ").replace('|', "\\|")
        },
        if not.is_empty() {
            not.join(", ")
        } else {
            "-".into()
        },
    )
}

fn table(rows: &[(&Kernel, Outcome)], total_s: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Kernel matrix, {} UTC, nantrace at {}; {} kernels in {:.0} s (TCG, 2 vCPUs).\n",
        now_utc(),
        git_rev(),
        rows.len(),
        total_s
    );
    let _ = writeln!(s, "| kernel | package | boot→init s | probes attached | on BTF | on tracefs, and why | not attached | kernel log | tests (btf) | tests (tracefs) | wall s | result |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (k, o) in rows {
        let (att, btf, fb, not) = probe_cell(&o.doctor);
        let suites = |path: &str| {
            o.suites
                .iter()
                .filter(|x| x.0 == path)
                .map(|(_, t, p, _, total, secs, _)| format!("{t} {p}/{total} ({secs:.0} s)"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let klog = o.doctor["kernel_log"]["source"].as_str().unwrap_or("-");
        let _ = writeln!(
            s,
            "| {} ({}) | {} | {} | {att} | {btf} | {fb} | {not} | {klog} | {} | {} | {:.0} | {} |",
            k.label,
            if o.uname.is_empty() { "?" } else { &o.uname },
            o.package,
            o.boot_s,
            suites("btf"),
            suites("tracefs"),
            o.wall_s,
            match (o.problems.len(), o.flaky.len()) {
                (0, 0) => "ok".to_string(),
                (0, f) => format!("ok, **{f} flaky**"),
                (p, 0) => format!("**{p} problem(s)**"),
                (p, f) => format!("**{p} problem(s), {f} flaky**"),
            }
        );
    }
    for (k, o) in rows {
        let why = o.doctor["kernel_log"]["why"].as_str().unwrap_or("-");
        let _ = writeln!(s, "\n{}: kernel log: {why}", k.label);
        for p in &o.problems {
            let _ = writeln!(s, "- PROBLEM: {p}");
        }
        for f in &o.flaky {
            let _ = writeln!(s, "- FLAKY: {f}");
        }
    }
    s
}

fn now_utc() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn git_rev() -> String {
    Command::new("git")
        .current_dir(root())
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub fn vm_test(args: &Args, nt: &Path) -> Result<()> {
    crate::setup::apt_install(&[
        "qemu-system-x86",
        "busybox-static",
        "cpio",
        "xz-utils",
        "zstd",
        "kmod",
        "debian-archive-keyring",
    ])?;
    let selected: Vec<&Kernel> = match &args.kernels {
        Some(list) => {
            let want: Vec<&str> = list.split(',').collect();
            let ks: Vec<&Kernel> = KERNELS.iter().filter(|k| want.contains(&k.label)).collect();
            if ks.len() != want.len() {
                bail!(
                    "unknown kernel in {list}; known: {}",
                    KERNELS
                        .iter()
                        .map(|k| k.label)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            ks
        }
        None => KERNELS.iter().collect(),
    };
    let bins = test_binaries(&[
        "kernel_log",
        "kernel_membership",
        "kernel_events",
        "incident",
    ])?;
    let base = root()
        .join("target/vm")
        .join(now_utc().replace([' ', ':'], "-"));
    let t0 = Instant::now();
    let mut rows = Vec::new();
    for k in selected {
        eprintln!("xtask: vm-test: {} ...", k.label);
        let mut o = run_kernel(k, &base.join(k.label), nt, &bins)?;
        // A guest that died of a named emulator failure (`console::emulator_signature`: 6.18's
        // "Oops: int3" in syscall_trace_enter once under multi-threaded TCG) boots once more. If
        // the second boot passes, the first is reported FLAKY with the end of its console, never
        // hidden; if not, both boots' problems stand. A hang or a timeout is a failure at once.
        let signature = if o.finished {
            None
        } else {
            console::emulator_signature(
                &std::fs::read_to_string(base.join(k.label).join("serial.log")).unwrap_or_default(),
            )
        };
        if !o.finished && signature.is_none() {
            eprintln!(
                "xtask: vm-test: {}: the guest did not finish, and its console shows no emulator failure nantrace knows: a failure, not booted again",
                k.label
            );
        }
        if let Some(sig) = signature {
            let first: Vec<String> = o
                .problems
                .iter()
                .map(|p| {
                    p.lines()
                        .take(1)
                        .chain(
                            p.lines()
                                .rev()
                                .take(3)
                                .collect::<Vec<_>>()
                                .into_iter()
                                .rev(),
                        )
                        .collect::<Vec<_>>()
                        .join("\n      ")
                })
                .collect();
            eprintln!(
                "xtask: vm-test: {}: the guest died of {sig}; booting it once more: {}",
                k.label,
                first.join("; ")
            );
            // A test's wrong answer before the guest died stands, whatever the second boot says.
            let wrong = o.problems.iter().any(|p| p.contains(" FAILED"));
            let again = run_kernel(k, &base.join(format!("{}-second-boot", k.label)), nt, &bins)?;
            o = if again.problems.is_empty() && !wrong {
                let mut a = again;
                a.flaky.insert(
                    0,
                    format!(
                        "the first boot died of {sig} (its logs: {}): {}",
                        base.join(k.label).display(),
                        first.join("; ")
                    ),
                );
                a
            } else {
                let mut a = again;
                a.problems
                    .extend(first.into_iter().map(|p| format!("first boot: {p}")));
                a
            };
        }
        eprintln!(
            "xtask: vm-test: {}: {:.0} s, {}",
            k.label,
            o.wall_s,
            if o.problems.is_empty() {
                "ok".to_string()
            } else {
                o.problems.join("; ")
            }
        );
        for f in &o.flaky {
            eprintln!("xtask: vm-test: {}: FLAKY: {f}", k.label);
        }
        rows.push((k, o));
    }
    let t = table(&rows, t0.elapsed().as_secs_f64());
    println!("{t}");
    std::fs::write(base.join("table.md"), &t)?;
    eprintln!("xtask: vm-test: logs and table in {}", base.display());
    if args.docs {
        let doc = root().join("docs/kernel-matrix.md");
        let old = read(&doc);
        let head = old.split("<!-- table -->").next().unwrap_or("").to_string();
        std::fs::write(&doc, format!("{head}<!-- table -->\n{t}"))?;
        eprintln!("xtask: vm-test: wrote {}", doc.display());
    }
    let bad: usize = rows.iter().map(|(_, o)| o.problems.len()).sum();
    if bad > 0 {
        bail!("vm-test: {bad} problem(s) across the kernel matrix (table above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verifier_key_line_is_found_in_doctors_excerpt() {
        let why = "BTF program blk_done_btf refused, so the block pair stays on tracefs: load: the BPF_PROG_LOAD syscall returned Permission denied (os error 13). Verifier output: 0: R1=ctx(off=0,imm=0) R10=fp0 ... 257: (79) r1 = *(u64 *)(r10 -56)      ; R1_w=P0 R10=fp0 refs=404 | 258: (63) *(u32 *)(r7 +4) = r1        ; R1_w=P0 | 259: (79) r1 = *(u64 *)(r10 -80) | invalid read from stack R10 off=-80 size=8 | verification time 285624 usec";
        assert_eq!(
            key_line(why),
            "259: (79) r1 = *(u64 *)(r10 -80) -> invalid read from stack R10 off=-80 size=8"
        );
        assert_eq!(
            key_line("sched_process_exit passes (struct task_struct *)"),
            "sched_process_exit passes (struct task_struct *)"
        );
    }

    #[test]
    fn test_output_is_counted() {
        let log = "running 3 tests\ntest a ... Killed\nok\ntest b ... FAILED\ntest c ... ignored\n\nfailures:\n\n---- b stdout ----\npanic\n\nfailures:\n    b\n\ntest result: FAILED. 1 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        let (p, f, t, done) = parse_suite(log);
        assert_eq!((p, f, t, done), (1, vec!["b".to_string()], 3, true));
        // Cut short (a timeout): not finished, the tests that started counted.
        assert_eq!(
            parse_suite("test a ... ok\ntest b ... "),
            (0, vec![], 2, false)
        );
    }

    #[test]
    fn a_failed_tests_panic_is_quoted() {
        let log = "failures:\n\n---- b stdout ----\n[watch] x\n\nthread 'b' (9) panicked at t.rs:1:2:\ngot 3\nnote: run with `RUST_BACKTRACE=1`\n\n---- c stdout ----\n";
        assert_eq!(
            panic_of(log, "b"),
            "\n      thread 'b' (9) panicked at t.rs:1:2:\n      got 3"
        );
        assert_eq!(panic_of(log, "zz"), "");
    }

    #[test]
    fn only_a_clean_second_run_of_the_one_test_is_flaky() {
        let ok = "running 1 test\ntest b ... ok\n\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 11 filtered out; finished in 1.00s\n";
        assert!(passed_alone(ok, "0\n"));
        assert!(!passed_alone(ok, "101\n"));
        assert!(!passed_alone("", ""), "no second run");
        assert!(!passed_alone("running 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 12 filtered out; finished in 0.00s\n", "0"), "the name matched nothing");
        assert!(!passed_alone("running 1 test\ntest b ... FAILED\n\nfailures:\n    b\n\ntest result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 11 filtered out; finished in 1.00s\n", "101"));
    }
}
