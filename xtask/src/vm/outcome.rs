//! One kernel's run read back from the files its guest left (scripts/vm/guest.sh): doctor's
//! report against what [`Kernel`] expects, libtest's output of each suite, the second run
//! alone of a failed test.
use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use super::{console, read, Kernel, SUITES};

/// One suite's result in a guest: (path, name, passed, failures, flaky, seconds, finished).
pub(super) type Suite = (String, String, usize, Vec<String>, usize, f64, bool);

/// What one kernel's run gave.
#[derive(Default)]
pub(super) struct Outcome {
    pub(super) package: String,
    pub(super) uname: String,
    pub(super) boot_s: String,
    pub(super) wall_s: f64,
    pub(super) doctor: Value,
    /// (path, suite) -> (passed, failed names, total, seconds, finished)
    pub(super) suites: Vec<Suite>,
    pub(super) problems: Vec<String>,
    /// Tests that failed once and passed when run again alone (guest.sh): reported, with
    /// their first failure, in the table and on stderr; not problems.
    pub(super) flaky: Vec<String>,
    /// The guest ran to its end (`done`): false after a guest kernel panic or a hang.
    pub(super) finished: bool,
}

impl Outcome {
    /// What the guest left in `dir` after its boot: whether it finished, doctor's report against
    /// what `k` expects, each suite's result.
    pub(super) fn read_guest(&mut self, k: &Kernel, dir: &Path) {
        self.finished = dir.join("done").exists();
        if !self.finished {
            let serial = read(&dir.join("serial.log"));
            self.problems.push(format!(
                "the guest did not finish{}{}",
                running_test(dir),
                console::story(&serial)
            ));
        }
        self.uname = read(&dir.join("uname")).trim().to_string();
        self.boot_s = read(&dir.join("boot_to_init_s")).trim().to_string();
        self.doctor = serde_json::from_str(&read(&dir.join("doctor.json"))).unwrap_or(Value::Null);
        check_doctor(k, &self.doctor, &mut self.problems);
        for (path, t) in SUITES {
            self.read_suite(dir, path, t);
        }
    }

    /// One suite's result: its libtest log, its time, a second run alone of each failed test.
    fn read_suite(&mut self, dir: &Path, path: &str, t: &str) {
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
            self.problems.push(format!(
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
                self.problems.push(format!(
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
                self.problems.push(format!(
                    "{t} ({path}): {f} FAILED{}{second}",
                    panic_of(&log, f)
                ));
            }
        }
        self.suites.push((
            path.to_string(),
            t.to_string(),
            passed,
            failed,
            total,
            secs,
            finished,
        ));
    }
}

/// The verifier's key line out of a fallback reason: the failing instruction and its error.
pub(super) fn key_line(why: &str) -> String {
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

#[cfg(test)]
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
