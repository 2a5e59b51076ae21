//! Secret redaction for everything nantrace copies out of other people's processes. Applied
//! always, to names that look secret and to values that look like credentials.
use std::sync::LazyLock;

use regex::Regex;

pub const REDACTED: &str = "<redacted>";

static SECRET_NAME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(token|secret|passw(or)?d|pwd|passphrase|api[_-]?key|access[_-]?key|private[_-]?key|credential|auth|cookie|session[_-]?id|signature|webhook|(^|_)key$|^key_|_dsn$|^dsn$|conn(ection)?_?str)").unwrap()
});

static SECRET_VALUE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"(hf_[A-Za-z0-9]{20,}",               // Hugging Face
        r"|gh[pousr]_[A-Za-z0-9]{20,}",        // GitHub
        r"|github_pat_[A-Za-z0-9_]{20,}",
        r"|sk-[A-Za-z0-9_-]{20,}",             // OpenAI-style
        r"|xox[abposr]-[A-Za-z0-9-]{10,}",     // Slack
        r"|AKIA[0-9A-Z]{16}",                  // AWS access key id
        r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*", // JWT
        r"|-----BEGIN [A-Z ]*PRIVATE KEY-----",
        r")"
    ))
    .unwrap()
});

/// `scheme://user:password@host` → `scheme://user:<redacted>@host`.
static URL_CRED: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]+):([^@\s]+)@").unwrap());

pub fn is_secret_name(name: &str) -> bool {
    SECRET_NAME.is_match(name)
}

/// Redact a value of a variable called `name`.
pub fn value(name: &str, v: &str) -> String {
    if is_secret_name(name) && !v.is_empty() {
        return REDACTED.to_string();
    }
    text(v)
}

/// Redact credentials inside free text (command lines, log lines, URLs).
pub fn text(v: &str) -> String {
    let v = URL_CRED.replace_all(v, format!("$1:{REDACTED}@"));
    SECRET_VALUE.replace_all(&v, REDACTED).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names_are_redacted() {
        for n in ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "NCCL_PASSWORD", "DB_PASSWD", "GITHUB_TOKEN", "MY_PRIVATE_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "HUGGING_FACE_HUB_TOKEN", "API_KEY", "OPENAI_API_KEY", "SLACK_WEBHOOK_URL", "SENTRY_DSN", "KEY", "AUTH_HEADER"] {
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
            ("CUDA_VISIBLE_DEVICES", "GPU-8f3e1c2a-1b2c-4d5e-9f00-123456789abc"),
            ("MONKEYPATCH_AMP", "1"),
        ] {
            assert_eq!(value(n, v), v, "{n}");
        }
    }

    #[test]
    fn credential_values_are_redacted_anywhere() {
        assert_eq!(value("MASTER_URL", "https://alice:s3cr3t@example.com/x"), "https://alice:<redacted>@example.com/x");
        assert_eq!(text("--hub hf_abcdefghijklmnopqrstuvwxyz123"), "--hub <redacted>");
        assert_eq!(text("AKIAIOSFODNN7EXAMPLE"), "<redacted>");
        assert_eq!(text("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abc"), "Bearer <redacted>");
        assert_eq!(text("ghp_0123456789abcdefghijABCDEFGHIJ"), "<redacted>");
        assert_eq!(text("redis://localhost:6379/0"), "redis://localhost:6379/0");
        assert_eq!(text("python train.py --lr 3e-4"), "python train.py --lr 3e-4");
    }
}
