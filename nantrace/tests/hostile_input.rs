//! The hostile test suite, second part (see `hostile.rs`): secrets in the job's environment,
//! argv and log lines, numeric flags, unusable log paths, untrusted text in reports and on the
//! terminal, absurd times in a bundle. Root is needed; run single-threaded:
//! `cargo test -p nantrace --test hostile_input -- --test-threads=1`.
mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    bundles, chown_nobody, make_bundle, nantrace, privileged, sh, sh_ok, text, Scratch, BIN,
};

// ---------------------------------------------------------------------------------------------
// Secrets (4.2, 4.4, 4.5)
// ---------------------------------------------------------------------------------------------

/// 60 planted values across the job's environment, its argv and its log lines.
#[test]
fn r4_2_r4_4_r4_5_secret_corpus_never_leaves_the_process() {
    if !privileged("r4_2_r4_4_r4_5_secret_corpus") {
        return;
    }
    let d = Scratch::new("secrets");
    let out = d.join("o");
    // (where, the line or value that carries it, the secret itself)
    let env: Vec<(&str, String, String)> = vec![
        (
            "AWS_SECRET_ACCESS_KEY",
            "HstAwsSecretKey01wJalrXUtnFEMIK7MDENG".into(),
            "HstAwsSecretKey01".into(),
        ),
        (
            "AWS_ACCESS_KEY_ID",
            "AKIAHOSTILE0ENV00001".into(),
            "AKIAHOSTILE0ENV00001".into(),
        ),
        (
            "HF_TOKEN",
            "hf_HstEnvHfToken0123456789abcdef".into(),
            "HstEnvHfToken".into(),
        ),
        (
            "WANDB_API_KEY",
            "HstWandbKey0123456789".into(),
            "HstWandbKey0123456789".into(),
        ),
        (
            "OPENAI_API_KEY",
            "sk-HstOpenAiEnv0123456789abcdef".into(),
            "HstOpenAiEnv".into(),
        ),
        (
            "GITHUB_TOKEN",
            "ghp_HstGithubEnv0123456789abcdefABCD".into(),
            "HstGithubEnv".into(),
        ),
        (
            "DATABASE_URL",
            "postgres://u:HstDbUrlPw@db/x".into(),
            "HstDbUrlPw".into(),
        ),
        (
            "MY_PASSWORD",
            "HstMyPassword1".into(),
            "HstMyPassword1".into(),
        ),
        (
            "HF_DATASETS_URL",
            "redis://:HstRedisPw2@cache:6379/0".into(),
            "HstRedisPw2".into(),
        ),
        (
            "TORCH_HOME_AT",
            "HstUserPart3:HstPwPart3@h".into(),
            "HstPwPart3".into(),
        ),
        (
            "CUDA_LAUNCH_EXTRA",
            "--password HstLaunchPw4".into(),
            "HstLaunchPw4".into(),
        ),
        (
            "SLURM_JOB_COMMENT",
            "pw=HstCommentPw5".into(),
            "HstCommentPw5".into(),
        ),
        ("HF_HUB_AUTHTOK", "HstAuthTok6".into(), "HstAuthTok6".into()),
        ("NVIDIA_NGC_KEY", "HstNgcKey7".into(), "HstNgcKey7".into()),
        (
            "NCCL_COMM_URL",
            "https://u:HstNcclPw8@nccl.example/x".into(),
            "HstNcclPw8".into(),
        ),
        (
            "NCCL_DEBUG_OPAQUE",
            "Zq8xW2mLp4Tn7Rv1Ks9Bd3Hf6Jc0HstRand9".into(),
            "Zq8xW2mLp4Tn7Rv1Ks9Bd3Hf6Jc0HstRand9".into(),
        ),
        (
            "TORCH_EXTRA_ARGS",
            "--api-key HstExtraKey10".into(),
            "HstExtraKey10".into(),
        ),
        (
            "CUDA_NOTE",
            "Authorization: Bearer HstEnvBearer11xyz".into(),
            "HstEnvBearer11xyz".into(),
        ),
        (
            "PYTORCH_SLACK",
            "xoxb-HstSlack12-0123456789".into(),
            "HstSlack12".into(),
        ),
        (
            "NCCL_JWT",
            "eyJhbGciOiJIUzI1NiJ9.eyJIc3RKd3QxMyI6MX0.HstJwtSig13".into(),
            "HstJwtSig13".into(),
        ),
    ];
    let argv: Vec<(String, String)> = vec![
        (
            "--api-key sk-live-HstArgApiKey0123456789abcdef".into(),
            "HstArgApiKey".into(),
        ),
        ("--password HstArgPw21".into(), "HstArgPw21".into()),
        (
            "--db postgres://u:HstArgDbPw22@h/db".into(),
            "HstArgDbPw22".into(),
        ),
        ("--token=HstArgTok23".into(), "HstArgTok23".into()),
        ("--hf-token hf_short".into(), "hf_short".into()),
        (
            "--aws AKIAHOSTILE0ARG00025".into(),
            "AKIAHOSTILE0ARG00025".into(),
        ),
        ("--secret HstArgSecret26".into(), "HstArgSecret26".into()),
        ("db_password=HstArgKv27".into(), "HstArgKv27".into()),
        (
            "--cache redis://:HstArgRedis28@r:6379".into(),
            "HstArgRedis28".into(),
        ),
        ("--wandb-key HstArgWandb29".into(), "HstArgWandb29".into()),
        (
            "--gh ghp_HstArgGh30abcdefghijklmnopqrstuv".into(),
            "HstArgGh30".into(),
        ),
        (
            "--gho gho_HstArgGho31abcdefghijklmnopqrstu".into(),
            "HstArgGho31".into(),
        ),
        (
            "--pat github_pat_HstArgPat32_abcdefghijklmnop".into(),
            "HstArgPat32".into(),
        ),
        (
            "--slack xoxp-HstArgSlack33-012345".into(),
            "HstArgSlack33".into(),
        ),
        (
            "--jwt eyJhbGciOiJIUzI1NiJ9.eyJIc3RBcmczNCI6MX0.HstArgJwt34".into(),
            "HstArgJwt34".into(),
        ),
        (
            "--header=Authorization:HstArgAuth35".into(),
            "HstArgAuth35".into(),
        ),
        (
            "--passphrase HstArgPhrase36".into(),
            "HstArgPhrase36".into(),
        ),
        (
            "--mirror https://me:HstArgMirror37@mirror.example/x".into(),
            "HstArgMirror37".into(),
        ),
        ("api_key=HstArgKv38".into(), "HstArgKv38".into()),
        ("--private-key HstArgPriv39".into(), "HstArgPriv39".into()),
    ];
    let log: Vec<(String, String)> = vec![
        (
            "logging in with token hf_HstLogHf40abcdefghijklmnop".into(),
            "HstLogHf40".into(),
        ),
        (
            "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJIc3RMb2c0MSI6MX0.HstLogJwt41".into(),
            "HstLogJwt41".into(),
        ),
        (
            "connecting postgres://loguser:HstLogDb42@db.example/db".into(),
            "HstLogDb42".into(),
        ),
        ("password=HstLogPlain43".into(), "HstLogPlain43".into()),
        (
            "aws key AKIAHOSTILE0LOG00044 in use".into(),
            "AKIAHOSTILE0LOG00044".into(),
        ),
        (
            "aws secret HstLog45wJalrXUtnFEMIK7MDENGbPxRfiCYEXAM ok".into(),
            "HstLog45wJalrXUtnFEMIK7MDENGbPxRfiCYEXAM".into(),
        ),
        (
            "openai sk-HstLogOpenai46abcdefghijklmn".into(),
            "HstLogOpenai46".into(),
        ),
        (
            "gh ghp_HstLogGh47abcdefghijklmnopqrstuv".into(),
            "HstLogGh47".into(),
        ),
        (
            "gho gho_HstLogGho48abcdefghijklmnopqrst".into(),
            "HstLogGho48".into(),
        ),
        (
            "pat github_pat_HstLogPat49_abcdefghijklmnop".into(),
            "HstLogPat49".into(),
        ),
        (
            "slack xoxb-HstLogSlack50-0123456789".into(),
            "HstLogSlack50".into(),
        ),
        (
            "slack xoxa-HstLogSlack51-0123456789".into(),
            "HstLogSlack51".into(),
        ),
        (
            "curl -H 'Authorization: Bearer HstLogBearer52xyz'".into(),
            "HstLogBearer52xyz".into(),
        ),
        (
            "redis://:HstLogRedis53@cache:6379 connected".into(),
            "HstLogRedis53".into(),
        ),
        (
            "config {\"api_key\": \"HstLogJson54\"}".into(),
            "HstLogJson54".into(),
        ),
        (
            "retrying with secret=HstLogSecret55".into(),
            "HstLogSecret55".into(),
        ),
        ("wandb: token: HstLogWandb56".into(), "HstLogWandb56".into()),
        (
            "mirror user:HstLogMirror57@mirror.example".into(),
            "HstLogMirror57".into(),
        ),
        (
            "basic auth Basic SHN0TG9nQmFzaWM1OA==".into(),
            "SHN0TG9nQmFzaWM1OA".into(),
        ),
        (
            "--password HstLogFlag59 given".into(),
            "HstLogFlag59".into(),
        ),
    ];
    let script = d.join("job.sh");
    let mut body = String::from("#!/bin/sh\n");
    for (l, _) in &log {
        body.push_str(&format!("printf '%s\\n' '{}'\n", l.replace('\'', "'\\''")));
    }
    body.push_str("echo 'HOSTILE-secrets step 1 | loss: nan'\nsleep 1\nexit 1\n");
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args([
        "run",
        "--no-probes",
        "--post",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--",
        script.to_str().unwrap(),
    ]);
    for (a, _) in &argv {
        cmd.args(a.split(' '));
    }
    for (k, v, _) in &env {
        cmd.env(k, v);
    }
    let o = cmd.stdin(Stdio::null()).output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let b = bundles(&out);
    assert_eq!(b.len(), 1);
    // Also `snapshot --pid` of a process with the same environment and argv, to stdout
    // (`sleep` refuses extra operands: sh keeps them as its own argv).
    let mut s = Command::new("sh");
    s.arg("-c").arg("sleep 30").arg("sh");
    for (a, _) in &argv {
        s.args(a.split(' '));
    }
    for (k, v, _) in &env {
        s.env(k, v);
    }
    let mut sleeper = s.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let snap = nantrace(&["snapshot", "--pid", &sleeper.id().to_string()], &[]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let mut haystack: Vec<(String, Vec<u8>)> = vec![
        ("stderr".into(), o.stderr.clone()),
        ("snapshot stdout".into(), snap.stdout.clone()),
    ];
    for f in std::fs::read_dir(&b[0]).unwrap().flatten() {
        haystack.push((
            f.file_name().to_string_lossy().into_owned(),
            std::fs::read(f.path()).unwrap(),
        ));
    }
    let secrets: Vec<&str> = env
        .iter()
        .map(|e| e.2.as_str())
        .chain(argv.iter().map(|a| a.1.as_str()))
        .chain(log.iter().map(|l| l.1.as_str()))
        .collect();
    assert!(secrets.len() >= 50);
    let mut found = Vec::new();
    for s in &secrets {
        for (name, data) in &haystack {
            if String::from_utf8_lossy(data).contains(s) {
                found.push(format!("{s} in {name}"));
            }
        }
    }
    assert!(found.is_empty(), "{} leaks: {found:#?}", found.len());
    // Sanity: the log and the command line are there, only redacted.
    let app = std::fs::read_to_string(b[0].join("app.log")).unwrap();
    assert!(app.contains("HOSTILE-secrets step 1") && app.contains("<redacted>"));
}

// ---------------------------------------------------------------------------------------------
// Bad command-line input (1.10, 1.11, 1.12, 1.14, 1.25-1.37, 1.43) and outputs (3.3, 3.4, 5.19-5.22)
// ---------------------------------------------------------------------------------------------

#[test]
fn r1_25_to_1_43_numeric_flags_are_validated() {
    for args in [
        &["run", "--window", "-1", "--", "true"][..],
        &["run", "--window", "0", "--", "true"],
        &["run", "--window", "nan", "--", "true"],
        &["run", "--window", "inf", "--", "true"],
        &["run", "--post=-5", "--", "true"],
        &["run", "--post", "nan", "--", "true"],
        &["run", "--mem-cap-mb", "0", "--", "true"],
        &["run", "--mem-cap-mb", "17592186044416", "--", "true"],
        &["run", "--sample", "nan", "--", "true"],
        &["run", "--sample", "1e300", "--", "true"],
        &["run", "--sample", "0", "--", "true"],
        &["run", "--sample=-1", "--", "true"],
        &["run", "--slow-io-ms", "nan", "--", "true"],
        &["run", "--nan-pattern", "", "--", "true"],
        &["run", "--nan-pattern", "x*", "--", "true"],
        &["watch", "--duration=-1"],
        &["watch", "--duration", "nan"],
        &["watch", "--duration", "inf"],
        &["watch", "--duration", "1e300"],
    ] {
        let o = nantrace(args, &[]);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?}: a clap error, not a panic or a silent run: {:?}",
            text(&o)
        );
    }
}

#[test]
fn r1_11_r1_12_r1_14_unusable_log_paths() {
    if !privileged("r1_11_r1_12_r1_14_unusable_log_paths") {
        return;
    }
    let d = Scratch::new("log");
    let mut sleeper = Command::new("sleep").arg("20").spawn().unwrap();
    let pid = sleeper.id().to_string();
    let adir = d.join("adir");
    std::fs::create_dir(&adir).unwrap();
    let o = nantrace(
        &[
            "attach",
            "--no-probes",
            "--pid",
            &pid,
            "--log",
            adir.to_str().unwrap(),
            "--out",
            d.join("o").to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("is a directory"), "{:?}", text(&o));
    // Unreadable for uid 65534.
    let unreadable = d.join("unreadable.log");
    std::fs::write(&unreadable, "HOSTILE-log loss nan\n").unwrap();
    std::fs::set_permissions(&unreadable, std::fs::Permissions::from_mode(0o600)).unwrap();
    let outn = d.join("on");
    std::fs::create_dir(&outn).unwrap();
    chown_nobody(&outn);
    let o = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "attach",
            "--no-probes",
            "--pid",
            &pid,
            "--log",
            unreadable.to_str().unwrap(),
            "--out",
            outn.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(text(&o).1.contains("cannot be read"), "{:?}", text(&o));
    // Missing: said, then waited for.
    let missing = d.join("later.log");
    let c = Command::new(BIN)
        .args([
            "attach",
            "--no-probes",
            "--post",
            "0",
            "--pid",
            &pid,
            "--log",
            missing.to_str().unwrap(),
            "--out",
            d.join("o").to_str().unwrap(),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&missing, "HOSTILE-later loss nan\n").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    let se = String::from_utf8_lossy(&c.wait_with_output().unwrap().stderr).into_owned();
    assert!(se.contains("does not exist yet: waiting for it"), "{se}");
    assert!(
        se.contains("trigger nan"),
        "the NaN in the file that appeared later is seen: {se}"
    );
}

#[test]
fn r1_10_attach_to_a_process_whose_leader_thread_exited() {
    if !privileged("r1_10_attach_to_a_process_whose_leader_thread_exited") {
        return;
    }
    let d = Scratch::new("zleader");
    let src = d.join("z.c");
    std::fs::write(&src, "#include <pthread.h>\n#include <unistd.h>\nstatic void *run(void *a) { (void)a; sleep(4); return 0; }\nint main(void) { pthread_t t; pthread_create(&t, 0, run, 0); pthread_exit(0); }\n").unwrap();
    let exe = d.join("z");
    if !sh(&format!(
        "cc -pthread -o '{}' '{}'",
        exe.display(),
        src.display()
    ))
    .status
    .success()
    {
        eprintln!("SKIPPED r1_10: no C compiler");
        return;
    }
    let mut z = Command::new(&exe).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pid = z.id().to_string();
    let t0 = Instant::now();
    let o = nantrace(
        &[
            "attach",
            "--no-probes",
            "--pid",
            &pid,
            "--out",
            d.join("o").to_str().unwrap(),
        ],
        &[],
    );
    let _ = z.kill();
    let _ = z.wait();
    let (_, se) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(0),
        "a live process with a zombie leader is alive: {se}"
    );
    assert!(!se.contains("does not exist"), "{se}");
    assert!(
        t0.elapsed() > Duration::from_secs(2),
        "followed until its last thread ended: {:?}",
        t0.elapsed()
    );
}

#[test]
fn r3_3_r3_4_report_md_and_the_terminal_escape_untrusted_text() {
    if !privileged("r3_3_r3_4_report_md_and_the_terminal_escape_untrusted_text") {
        return;
    }
    let d = Scratch::new("inject");
    let out = d.join("o");
    let job = "printf '%s\\n' '<script>alert(1)</script> ![i](http://evil.example/x.png) [l](javascript:alert(1)) HOSTILE-inject loss nan'; printf 'x\\033[2J\\n'; exit 3";
    let o = nantrace(
        &[
            "run",
            "--no-probes",
            "--post",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            job,
        ],
        &[],
    );
    let se = o.stderr.clone();
    assert!(
        !se.contains(&0x1b),
        "no raw ESC from nantrace on stderr (the job's own stderr is not used here)"
    );
    let b = bundles(&out);
    assert_eq!(b.len(), 1);
    let md = std::fs::read_to_string(b[0].join("report.md")).unwrap();
    for bad in ["<script>", "![i](", "[l](javascript"] {
        assert!(!md.contains(bad), "{bad} in report.md:\n{md}");
    }
    assert!(
        md.contains("HOSTILE-inject"),
        "the text is still there, escaped"
    );
    // A process name with newlines and ESC (needs the probes: the name comes from the kernel).
    let py = "import ctypes, os, time\nlibc = ctypes.CDLL(None)\npid = os.fork()\nif pid == 0:\n    libc.prctl(15, ctypes.c_char_p(b'\\n# PWNED\\n\\x1b[2J'), 0, 0, 0)\n    os._exit(3)\nos.waitpid(pid, 0)\ntime.sleep(0.2)\nprint('HOSTILE-comm step 1 | loss nan', flush=True)\n";
    let f = d.join("comm_nl.py");
    std::fs::write(&f, py).unwrap();
    let out2 = d.join("o2");
    let o = nantrace(
        &[
            "run",
            "--post",
            "1",
            "--out",
            out2.to_str().unwrap(),
            "--",
            "python3",
            f.to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        !o.stderr.contains(&0x1b),
        "no raw ESC on stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r = nantrace(&["report", bundles(&out2)[0].to_str().unwrap()], &[]);
    assert!(
        !r.stdout.contains(&0x1b),
        "no raw ESC from `nantrace report`"
    );
    let md = std::fs::read_to_string(bundles(&out2)[0].join("report.md")).unwrap();
    assert!(!md.lines().any(|l| l.starts_with("# PWNED")), "{md}");
}

fn edit_timeline(b: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = b.join("timeline.json");
    let mut t: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut t);
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, serde_json::to_vec(&t).unwrap()).unwrap();
}

#[test]
fn r5_19_to_5_22_absurd_times_and_junk_events_are_bounded() {
    if !privileged("r5_19_to_5_22_absurd_times_and_junk_events_are_bounded") {
        return;
    }
    let d = Scratch::new("absurd");
    let b = make_bundle(&d, "b");
    for (i, off) in [1e15, 1e300, -1e300].into_iter().enumerate() {
        let c = d.join(&format!("c{i}"));
        sh_ok(&format!("cp -a '{}' '{}'", b.display(), c.display()));
        edit_timeline(&c, |t| t["events"][0]["offset_s"] = serde_json::json!(off));
        let t0 = Instant::now();
        let o = nantrace(&["report", "--write", c.to_str().unwrap()], &[]);
        assert_eq!(o.status.code(), Some(0), "{off}: {:?}", text(&o));
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{off}: {:?}",
            t0.elapsed()
        );
        assert!(std::fs::metadata(c.join("report.html")).unwrap().len() < 5 << 20);
    }
    // A node on a 1970 clock, and one with correction_s 1e300.
    for (tag, edit) in [("epoch", 0), ("corr", 1)] {
        let c = d.join(tag);
        sh_ok(&format!("cp -a '{}' '{}'", b.display(), c.display()));
        edit_timeline(&c, |t| {
            if edit == 0 {
                for e in t["events"].as_array_mut().unwrap() {
                    e["time"] = serde_json::json!("1970-01-01T00:00:05.000000000Z");
                }
                t["trigger"]["time"] = serde_json::json!("1970-01-01T00:00:05.000000000Z");
            } else {
                t["clock"]["correction_s"] = serde_json::json!(1e300);
            }
        });
        let m = d.join(&format!("m-{tag}"));
        let t0 = Instant::now();
        let o = nantrace(
            &[
                "merge",
                b.to_str().unwrap(),
                c.to_str().unwrap(),
                "--out",
                m.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(o.status.code(), Some(0), "{tag}: {:?}", text(&o));
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{tag}: {:?}",
            t0.elapsed()
        );
        assert!(
            std::fs::metadata(m.join("report.html")).unwrap().len() < 5 << 20,
            "{tag}"
        );
    }
    // 5.22: junk events.
    let j = d.join("junk");
    sh_ok(&format!("cp -a '{}' '{}'", b.display(), j.display()));
    edit_timeline(&j, |t| {
        t["events"] = serde_json::json!([1, "x", null, [], {}])
    });
    let o = nantrace(
        &[
            "merge",
            b.to_str().unwrap(),
            j.to_str().unwrap(),
            "--out",
            d.join("mj").to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
}

// ---------------------------------------------------------------------------------------------
// Block-buffered Python (2.14) and non-root wording (6.14a)
// ---------------------------------------------------------------------------------------------

#[test]
fn r2_14_python_output_is_unbuffered_unless_told_otherwise() {
    if !privileged("r2_14_python_output_is_unbuffered") {
        return;
    }
    let d = Scratch::new("buf");
    let f = d.join("buffered.py");
    std::fs::write(&f, "import os, sys, time\nprint(os.environ.get('PYTHONUNBUFFERED', 'unset'))\nprint('HOSTILE-buffered step 1 loss nan')\ntime.sleep(3)\n").unwrap();
    let run = |extra: &[&str]| -> (Duration, String) {
        let t0 = Instant::now();
        let mut args = vec![
            "run",
            "--no-probes",
            "--post",
            "1",
            "--out",
            d.0.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        args.extend(["--", "python3", f.to_str().unwrap()]);
        let mut c = Command::new(BIN)
            .args(&args)
            .env_remove("PYTHONUNBUFFERED")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = c.stderr.take().unwrap();
        use std::io::BufRead as _;
        let mut at = None;
        for l in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if l.contains("trigger nan") && at.is_none() {
                at = Some(t0.elapsed());
            }
        }
        let o = c.wait_with_output().unwrap();
        (
            at.expect("the NaN was seen"),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        )
    };
    let (at, so) = run(&[]);
    assert!(so.starts_with('1'), "PYTHONUNBUFFERED=1 is set: {so}");
    assert!(
        at < Duration::from_millis(2500),
        "the NaN arrives when printed, not at exit: {at:?}"
    );
    let (at, so) = run(&["--no-unbuffered"]);
    assert!(so.starts_with("unset"), "{so}");
    assert!(
        at >= Duration::from_millis(2900),
        "with --no-unbuffered python block-buffers: {at:?}"
    );
}

#[test]
fn r6_14a_non_root_is_told_tracefs_is_unreadable_not_unmounted() {
    if !privileged("r6_14a_non_root_tracefs_wording") {
        return;
    }
    if !Path::new("/sys/kernel/tracing/events").is_dir() {
        eprintln!("SKIPPED r6_14a: tracefs not mounted here");
        return;
    }
    let o = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "doctor",
        ])
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if all.contains("tracefs       /sys/kernel/tracing") {
        eprintln!("SKIPPED r6_14a: tracefs is readable by uid 65534 here");
        return;
    }
    assert!(!all.contains("NOT MOUNTED"), "{all}");
    assert!(
        all.contains("is mounted at") && all.contains("root is needed"),
        "{all}"
    );
}
