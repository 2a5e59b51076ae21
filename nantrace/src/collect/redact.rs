//! Secret redaction for everything nantrace copies out of other people's processes. Applied
//! always, to names that look secret and to values that look like credentials.
use std::sync::LazyLock;

use regex::Regex;

pub const REDACTED: &str = "<redacted>";

static SECRET_NAME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(token|secret|passw(or)?d|pwd|passphrase|api[_-]?key|access[_-]?key|private[_-]?key|credential|auth|cookie|session[_-]?id|signature|webhook|(^|_)key$|^key_|_dsn$|^dsn$|conn(ection)?_?str)").unwrap()
});

/// The words that make a key, a flag or a variable name secret, as the last word of a key
/// (`password=`, `--api-key X`, `db_pw:`), so `num_tokens=1024` stays readable.
const SECRET_WORD: &str = r"(?:token|secret|password|passwd|pwd|pass|passphrase|api[_-]?key|apikey|access[_-]?key|secret[_-]?key|private[_-]?key|credentials?|cookie|pw|key|auth|authorization|dsn|sig|signature)";

/// Token shapes that are secrets wherever they appear (log lines, argv, any value).
static SECRET_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"(hf_[A-Za-z0-9]{8,}",         // Hugging Face
        r"|gh[pousr]_[A-Za-z0-9]{20,}", // GitHub
        r"|github_pat_[A-Za-z0-9_]{20,}",
        r"|glpat-[A-Za-z0-9_-]{20,}",      // GitLab
        r"|sk-[A-Za-z0-9_-]{20,}",         // OpenAI-style, Stripe sk-live-
        r"|xox[abposr]-[A-Za-z0-9-]{10,}", // Slack
        r"|(?:AKIA|ASIA)[0-9A-Z]{16}",     // AWS access key id
        r"|AIza[0-9A-Za-z_-]{35}",         // Google API key
        r"|npm_[A-Za-z0-9]{36}",
        r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*", // JWT
        r"|-----BEGIN [A-Z ]*PRIVATE KEY-----",
        r")"
    ))
    .unwrap()
});

/// `Bearer X`, `Basic X` (the Authorization header's credentials).
static BEARER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}").unwrap());

/// `scheme://user:password@host` and `scheme://:password@host` → the password redacted.
static URL_CRED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^\s]*@").unwrap());

/// `user:password@host` without a scheme → the whole user part redacted.
static BARE_CRED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(^|[\s=,;'\x22(])[^\s=,;'\x22(:/]*:[^\s/]*@([A-Za-z0-9][A-Za-z0-9.-]*)").unwrap()
});

/// `password=X`, `db_pw: X`, `--token=X`, `"api_key": "X"`.
static KEY_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(&format!(r#"(?i)(^|[^A-Za-z0-9])((?:[A-Za-z0-9]+[_.-])*{SECRET_WORD}["']?\s*[=:]\s*)("[^"]*"|'[^']*'|[^\s,;&]+)"#)).unwrap()
});

/// `--password X`, `--hf-token X`: a secret flag followed by its value as the next word.
static FLAG_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(&format!(
        r"(?i)((?:^|\s)--?(?:[A-Za-z0-9]+[_-])*{SECRET_WORD}\s+)(\S+)"
    ))
    .unwrap()
});

/// A whole argument that is a secret flag expecting a value (`--password`, `-pw`).
static SECRET_FLAG: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(&format!(r"(?i)^--?(?:[A-Za-z0-9]+[_-])*{SECRET_WORD}$")).unwrap());

/// One cheap pass over a log line: does anything above possibly match? (Most lines: no.)
static PREFILTER: LazyLock<regex::RegexSet> = LazyLock::new(|| {
    regex::RegexSet::new([
        r"hf_|gh[pousr]_|github_pat_|glpat-|sk-|xox[abposr]-|AKIA|ASIA|AIza|npm_|eyJ|PRIVATE KEY",
        r"(?i)bearer|basic\s",
        r"[:/]\S*@",
        &format!(r#"(?i){SECRET_WORD}["']?\s*[=:]"#),
        &format!(r"(?i)-{SECRET_WORD}\s"),
        r"[A-Za-z0-9/+]{40}",
    ])
    .unwrap()
});

static SHORT_SECRET_NAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)(^|[_.-])(pw|pass)($|[_.-])").unwrap());

pub fn is_secret_name(name: &str) -> bool {
    SECRET_NAME.is_match(name) || SHORT_SECRET_NAME.is_match(name)
}

/// A 40-character base64 word with upper case, lower case and digits (an AWS secret access
/// key and its kind); hex digests (git commits, sha1) are not matched.
static B64_40: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(^|[^A-Za-z0-9/+])([A-Za-z0-9/+]{40})($|[^A-Za-z0-9/+=])").unwrap()
});

fn mixed(w: &str) -> bool {
    w.bytes().any(|b| b.is_ascii_uppercase())
        && w.bytes().any(|b| b.is_ascii_lowercase())
        && w.bytes().any(|b| b.is_ascii_digit())
}

/// A whole value that looks random enough to be a credential: 24+ characters of a token
/// alphabet with upper case, lower case and digits, and no separators a path or list has.
pub fn looks_random(v: &str) -> bool {
    if v.len() < 24 || v.len() > 512 || !mixed(v) || v.starts_with('/') || v.contains("//") {
        return false;
    }
    if !v
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'+' | b'/' | b'='))
    {
        return false;
    }
    // UUIDs and UUID-like ids (`GPU-8f3e1c2a-...`, `MIG-...`): hex groups after a prefix.
    let mut parts = v.split('-');
    parts.next();
    let rest: Vec<&str> = parts.collect();
    if rest.len() >= 4
        && rest
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return false;
    }
    // Shannon entropy per character: random base62/64 is near log2(len); words and paths lower.
    let mut counts = [0u32; 256];
    for b in v.bytes() {
        counts[b as usize] += 1;
    }
    let n = v.len() as f64;
    let h: f64 = counts
        .iter()
        .filter(|c| **c > 0)
        .map(|&c| -(f64::from(c) / n) * (f64::from(c) / n).log2())
        .sum();
    h >= 3.9
}

/// Redact a value of a variable called `name`.
pub fn value(name: &str, v: &str) -> String {
    if is_secret_name(name) && !v.is_empty() {
        return REDACTED.to_string();
    }
    if looks_random(v) {
        return REDACTED.to_string();
    }
    text(v)
}

/// Redact credentials inside free text (command lines, log lines, URLs, values).
pub fn text(v: &str) -> String {
    let v = BEARER.replace_all(v, format!("$1 {REDACTED}"));
    let v = URL_CRED.replace_all(&v, format!("$1:{REDACTED}@"));
    let v = BARE_CRED.replace_all(&v, format!("$1{REDACTED}@$2"));
    let v = FLAG_VALUE.replace_all(&v, format!("$1{REDACTED}"));
    let v = KEY_VALUE.replace_all(&v, format!("$1$2{REDACTED}"));
    let v = SECRET_VALUE.replace_all(&v, REDACTED);
    let v = B64_40.replace_all(&v, |c: &regex::Captures| {
        if mixed(&c[2]) {
            format!("{}{REDACTED}{}", &c[1], &c[3])
        } else {
            c[0].to_string()
        }
    });
    v.into_owned()
}

/// A log line: unchanged (and not copied) unless the prefilter sees something to redact.
pub fn log_line(line: String) -> String {
    if PREFILTER.is_match(&line) {
        let r = text(&line);
        if r != line {
            return r;
        }
    }
    line
}

/// A command line: each word redacted, and the word after a secret flag (`--password X`).
pub fn argv(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut next_is_secret = false;
    for a in args {
        if next_is_secret && !a.is_empty() {
            out.push(REDACTED.to_string());
            next_is_secret = false;
            continue;
        }
        next_is_secret = SECRET_FLAG.is_match(a);
        out.push(text(a));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names_are_redacted() {
        for n in [
            "HF_TOKEN",
            "WANDB_API_KEY",
            "AWS_SECRET_ACCESS_KEY",
            "NCCL_PASSWORD",
            "DB_PASSWD",
            "GITHUB_TOKEN",
            "MY_PRIVATE_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "HUGGING_FACE_HUB_TOKEN",
            "API_KEY",
            "OPENAI_API_KEY",
            "SLACK_WEBHOOK_URL",
            "SENTRY_DSN",
            "KEY",
            "AUTH_HEADER",
        ] {
            assert_eq!(value(n, "some-value"), REDACTED, "{n}");
        }
    }

    #[test]
    fn ordinary_names_are_kept() {
        for (n, v) in [
            ("CUDA_VISIBLE_DEVICES", "0,1,2,3"),
            ("NCCL_IB_HCA", "mlx5_0,mlx5_1"),
            ("NCCL_SOCKET_IFNAME", "eth0"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
            ("NVIDIA_TF32_OVERRIDE", "0"),
            ("HF_HOME", "/data/hf"),
            ("OMP_NUM_THREADS", "8"),
            ("TORCH_CUDNN_V8_API_ENABLED", "1"),
            (
                "CUDA_VISIBLE_DEVICES",
                "GPU-8f3e1c2a-1b2c-4d5e-9f00-123456789abc",
            ),
            ("MONKEYPATCH_AMP", "1"),
        ] {
            assert_eq!(value(n, v), v, "{n}");
        }
    }

    #[test]
    fn credential_values_are_redacted_anywhere() {
        assert_eq!(
            value("MASTER_URL", "https://alice:s3cr3t@example.com/x"),
            "https://alice:<redacted>@example.com/x"
        );
        assert_eq!(
            text("--hub hf_abcdefghijklmnopqrstuvwxyz123"),
            "--hub <redacted>"
        );
        assert_eq!(text("AKIAIOSFODNN7EXAMPLE"), "<redacted>");
        assert_eq!(
            text("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abc"),
            "Bearer <redacted>"
        );
        assert_eq!(text("ghp_0123456789abcdefghijABCDEFGHIJ"), "<redacted>");
        assert_eq!(text("redis://localhost:6379/0"), "redis://localhost:6379/0");
        assert_eq!(
            text("python train.py --lr 3e-4"),
            "python train.py --lr 3e-4"
        );
    }

    #[test]
    fn redteam_4_2_values_with_ordinary_names() {
        assert!(
            !value("HF_DATASETS_URL", "redis://:EnvRedisPw1@cache:6379/0").contains("EnvRedisPw1")
        );
        assert!(!value("TORCH_HOME_AT", "p@ss:EnvPw2@h").contains("EnvPw2"));
        assert!(!value("TORCH_HOME_AT", "p@ss:EnvPw2@h").contains("p@ss"));
        assert!(!value("CUDA_LAUNCH_EXTRA", "--password EnvPw3").contains("EnvPw3"));
        assert!(!value("SLURM_JOB_COMMENT", "pw=EnvPw4").contains("EnvPw4"));
        assert_eq!(
            value("RANDOM_LOOKING", "Zq8xW2mLp4Tn7Rv1Ks9Bd3Hf6Jc0"),
            REDACTED
        );
        for keep in [
            "expandable_segments:True",
            "GPU-8f3e1c2a-1b2c-4d5e-9f00-123456789abc",
            "/opt/conda/envs/Train2026/bin/python3.11",
            "mlx5_0:1,mlx5_1:1",
            "localhost:29500",
        ] {
            assert_eq!(value("X", keep), keep);
        }
    }

    #[test]
    fn redteam_4_4_argv() {
        let a: Vec<String> = [
            "train.py",
            "--api-key",
            "sk-live-ArgApiKey0123456789abcdefXYZ",
            "--password",
            "ArgHunter2pw",
            "--db",
            "postgres://u:ArgDbPw@h/db",
            "--token=ArgTok9",
            "--hf-token",
            "hf_short",
            "--aws",
            "AKIAIOSFODNN7EXAMPLE",
            "--lr",
            "3e-4",
            "--max_tokens",
            "512",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let r = argv(&a).join(" ");
        for s in [
            "ArgApiKey",
            "ArgHunter2pw",
            "ArgDbPw",
            "ArgTok9",
            "hf_short",
            "AKIAIOSFODNN7EXAMPLE",
        ] {
            assert!(!r.contains(s), "{s} in {r}");
        }
        assert!(
            r.contains("--lr 3e-4")
                && r.contains("--max_tokens 512")
                && r.contains("postgres://u:"),
            "{r}"
        );
    }

    #[test]
    fn redteam_4_5_log_lines() {
        for (line, secret) in [
            ("logging in with token hf_LoGhFaCeToKeN0123456789abcdefXYZ", "LoGhFaCe"),
            ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJsb2dqd3QifQ.c2lnbmF0dXJlLWxvZw", "eyJzdWIi"),
            ("connecting postgres://loguser:LogDbPw777@db.example/db password=LogPlainPw888", "LogDbPw777"),
            ("connecting postgres://loguser:LogDbPw777@db.example/db password=LogPlainPw888", "LogPlainPw888"),
            ("aws secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY ok", "wJalrXUtnFEMI"),
            ("slack xoxb-123456789012-abcdefghijkl", "abcdefghijkl"),
            ("gh token gho_0123456789abcdefghijABCDEFGHIJ", "gho_0123"),
            ("{\"api_key\": \"QuotedKey123\"}", "QuotedKey123"),
        ] {
            let r = log_line(line.to_string());
            assert!(!r.contains(secret), "{secret} in {r}");
        }
        for keep in [
            "step 1 | loss: nan",
            "epoch 3 step 120 loss=2.3412 lr=3.0e-4 tokens/s=51234 num_tokens=1024",
            "commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904",
        ] {
            assert_eq!(log_line(keep.to_string()), keep);
        }
    }

    #[test]
    fn the_log_path_stays_cheap() {
        let lines: Vec<String> = (0..100_000)
            .map(|i| {
                format!(
                    "step {i} | loss: {:.4} | lr 3.0e-4 | grad_norm 1.25 | 51234 tokens/s",
                    2.0 / f64::from(i + 1)
                )
            })
            .collect();
        let t = std::time::Instant::now();
        let mut n = 0usize;
        for l in lines {
            n += log_line(l).len();
        }
        let dt = t.elapsed();
        eprintln!("100k log lines redacted in {dt:?} ({n} bytes)");
        // Debug build on a shared 2-core machine: generous; release is ~10x faster.
        assert!(dt < std::time::Duration::from_secs(5), "{dt:?}");
    }
}
