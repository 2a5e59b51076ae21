//! Software environment at the trigger: kernel, NVIDIA driver, CUDA driver (NVML), nvcc,
//! CUDA runtime / cuDNN / NCCL / cuBLAS versions actually loaded by the job (from
//! /proc/PID/maps), Python and framework versions when visible, and the job's environment
//! variables that matter for numerics, redacted.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use regex::Regex;
use serde_json::{json, Value};

use super::redact;

static ENV_NAME: LazyLock<Regex> = LazyLock::new(|| {
    // TensorFlow's own TF_* variables (the seed's intent), not every TF_ prefix: Terraform's
    // TF_CLI_CONFIG_FILE, TF_VAR_*, TF_TOKEN_* are not numerics (and may hold secrets).
    Regex::new(r"^(CUDA|NCCL|TORCH|PYTORCH|TF_(?:CPP_|FORCE_|ENABLE_|XLA_|GPU_|CUDNN_|DETERMINISTIC|FP16|CONFIG$|NUM_|USE_|SYNC_|AUTOTUNE|KERAS|MKL|DISABLE_|ROCM|TRT|TENSORRT|NEED_|CUDA_|AUTO_MIXED|INTER_OP|INTRA_OP|MIXED)|XLA|NVIDIA|CUBLAS|CUDNN|OMP|HF_|HUGGING|TRANSFORMERS|ACCELERATE|DEEPSPEED|DS_|MEGATRON|NVTE|APEX|JAX|MKL|KMP|LD_LIBRARY_PATH|PYTHONPATH|SLURM_|KUBERNETES|POD_|WORLD_SIZE|RANK|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|NODE_RANK)|AMP|FP16|BF16|FP8|TF32|PRECISION|MIXED|DTYPE|HALF").unwrap()
});

/// Libraries whose loaded versions matter: (label, file-name regex capturing the version).
static LIBS: LazyLock<Vec<(&'static str, Regex)>> = LazyLock::new(|| {
    [
        ("cuda_runtime", r"libcudart\.so\.([0-9.]+)"),
        ("cuda_driver_lib", r"libcuda\.so\.([0-9.]+)"),
        ("cudnn", r"libcudnn(?:_[a-z_]+)?\.so\.([0-9.]+)"),
        ("nccl", r"libnccl\.so\.([0-9.]+)"),
        ("cublas", r"libcublas\.so\.([0-9.]+)"),
        ("cublasLt", r"libcublasLt\.so\.([0-9.]+)"),
        ("nvidia_ml", r"libnvidia-ml\.so\.([0-9.]+)"),
        ("python", r"libpython([0-9.]+)\.so"),
        ("torch", r"(libtorch_cuda|libtorch_cpu|libtorch)\.so"),
        ("tensorflow", r"libtensorflow_framework\.so\.([0-9.]+)"),
    ]
    .into_iter()
    .map(|(k, r)| (k, Regex::new(r).unwrap()))
    .collect()
});

/// Versions of the interesting libraries mapped into a process, from its maps lines.
pub fn libraries_from_maps(maps: &str) -> BTreeMap<String, Value> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut paths: BTreeMap<String, String> = BTreeMap::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let file = path.rsplit('/').next().unwrap_or(path);
        for (label, re) in LIBS.iter() {
            if let Some(c) = re.captures(file) {
                let v = c.get(1).map_or("", |m| m.as_str());
                let v = if *label == "torch" {
                    "loaded".to_string()
                } else {
                    v.to_string()
                };
                out.entry((*label).to_string()).or_default().insert(v);
                paths
                    .entry((*label).to_string())
                    .or_insert_with(|| path.to_string());
            }
        }
    }
    out.into_iter()
        .map(|(k, v)| {
            let path = paths.get(&k).cloned().unwrap_or_default();
            (k, json!({ "versions": v, "path": path }))
        })
        .collect()
}

/// A framework's version next to its loaded library, e.g. site-packages/torch/version.py.
fn framework_version(lib_path: &str, pkg: &str) -> Option<String> {
    // The last `/torch/` of `/opt/torch/.venv/.../site-packages/torch/lib/libtorch_cuda.so`.
    let idx = lib_path.rfind(&format!("/{pkg}/"))?;
    let dir = &lib_path[..idx + pkg.len() + 1];
    let text = std::fs::read_to_string(format!("{dir}/version.py")).ok()?;
    let re = Regex::new(r#"__version__\s*=\s*['"]([^'"]+)['"]"#).ok()?;
    re.captures(&text).map(|c| c[1].to_string())
}

/// pip wheels ship libraries by SONAME only (`libcudart.so.13`): the full version is in the
/// wheel's dist-info directory name next to them (`nvidia_cuda_runtime_cu13-13.0.96.dist-info`).
fn wheel_version(lib_path: &str, label: &str) -> Option<String> {
    let prefix = match label {
        "cuda_runtime" => "nvidia_cuda_runtime",
        "cudnn" => "nvidia_cudnn",
        "nccl" => "nvidia_nccl",
        "cublas" | "cublasLt" => "nvidia_cublas",
        "torch" => "torch-",
        _ => return None,
    };
    let site = &lib_path[..lib_path.find("site-packages/")? + "site-packages".len()];
    let mut found: Vec<String> = std::fs::read_dir(site)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .filter(|n| n.starts_with(prefix) && n.ends_with(".dist-info"))
        .collect();
    found.sort();
    let name = found.pop()?;
    let stem = name.trim_end_matches(".dist-info");
    let (pkg, ver) = stem.rsplit_once('-')?;
    Some(format!("{} {ver}", pkg.replace('_', "-")))
}

/// The job's relevant environment variables, redacted.
pub fn job_env(environ: &[u8]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for kv in environ.split(|&b| b == 0) {
        let s = String::from_utf8_lossy(kv);
        let Some((k, v)) = s.split_once('=') else {
            continue;
        };
        if ENV_NAME.is_match(k) || redact::is_secret_name(k) && ENV_NAME.is_match(k) {
            out.insert(k.to_string(), redact::value(k, v));
        }
    }
    out
}

/// `cmd`'s output when it ran and succeeded. A command not in PATH is not spawned: the failed
/// exec would end a child with 127, an abnormal exit on the machine-wide timeline of `run`.
fn cmd_output(cmd: &str, args: &[&str]) -> Option<String> {
    let path = std::env::var_os("PATH")?;
    let exe = std::env::split_paths(&path)
        .map(|d| d.join(cmd))
        .find(|p| p.is_file())?;
    let o = std::process::Command::new(exe).args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

pub fn snapshot(pid: Option<u32>, nvml_driver: Option<(String, Option<i32>)>) -> Value {
    let r = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let mut libs = BTreeMap::new();
    let mut frameworks = BTreeMap::new();
    let mut env = BTreeMap::new();
    let mut cmdline = None;
    let mut errors = Vec::new();
    if let Some(pid) = pid {
        // The root is often a launcher (bash, torchrun): the CUDA libraries live in its
        // descendants, so every process of the job is looked at.
        let mut maps = String::new();
        for p in crate::correlate::descendants(&[pid]) {
            match std::fs::read_to_string(format!("/proc/{p}/maps")) {
                Ok(m) => maps.push_str(&m),
                Err(e) if p == pid => errors.push(format!("/proc/{p}/maps: {e}")),
                Err(_) => {}
            }
        }
        libs = libraries_from_maps(&maps);
        for (label, v) in libs.iter_mut() {
            if let Some(w) = v["path"].as_str().and_then(|p| wheel_version(p, label)) {
                v["package"] = json!(w);
            }
        }
        for (label, pkg) in [("torch", "torch"), ("tensorflow", "tensorflow")] {
            if let Some(p) = libs.get(label).and_then(|v| v["path"].as_str()) {
                if let Some(v) = framework_version(p, pkg).or_else(|| {
                    wheel_version(p, label).map(|w| w.rsplit(' ').next().unwrap_or("").to_string())
                }) {
                    frameworks.insert(pkg.to_string(), v);
                }
            }
        }
        match std::fs::read(format!("/proc/{pid}/environ")) {
            Ok(e) => env = job_env(&e),
            Err(e) => errors.push(format!(
                "/proc/{pid}/environ: {e} (root needed for other users' processes)"
            )),
        }
        cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok().map(|b| {
            redact::argv(
                &b.split(|&c| c == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect::<Vec<_>>(),
            )
            .join(" ")
        });
    }
    json!({
        "kernel": r("/proc/sys/kernel/osrelease"),
        "kernel_version": r("/proc/version"),
        "os": r("/etc/os-release").and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()))),
        "nvidia_driver": r("/proc/driver/nvidia/version").unwrap_or_else(|| "absent (/proc/driver/nvidia/version: no NVIDIA kernel module loaded)".into()),
        "nvml_driver_version": nvml_driver.as_ref().map(|d| d.0.clone()),
        "cuda_driver_version": nvml_driver.as_ref().and_then(|d| d.1).map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)),
        "nvcc": cmd_output("nvcc", &["--version"]).map(|s| s.lines().last().unwrap_or("").to_string()).unwrap_or_else(|| "not installed".into()),
        "job_pid": pid,
        "job_cmdline": cmdline,
        "libraries_loaded_by_job": libs,
        "frameworks": frameworks,
        "env": env,
        "errors": errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_runs_from_path_and_a_missing_one_is_not_spawned() {
        assert_eq!(
            cmd_output("echo", &["nvcc-like"]).as_deref(),
            Some("nvcc-like")
        );
        assert_eq!(cmd_output("nantrace-no-such-tool", &["--version"]), None);
        assert_eq!(cmd_output("false", &[]), None);
    }

    const MAPS: &str = "\
7f1c00000000-7f1c00200000 r-xp 00000000 fd:01 123 /usr/local/cuda-12.1/lib64/libcudart.so.12.1.105
7f1c00200000-7f1c00400000 r-xp 00000000 fd:01 124 /opt/venv/lib/python3.10/site-packages/nvidia/cudnn/lib/libcudnn.so.8.9.2
7f1c00400000-7f1c00600000 r-xp 00000000 fd:01 125 /opt/venv/lib/python3.10/site-packages/nvidia/nccl/lib/libnccl.so.2.18.1
7f1c00600000-7f1c00800000 r-xp 00000000 fd:01 126 /opt/venv/lib/python3.10/site-packages/torch/lib/libtorch_cuda.so
7f1c00800000-7f1c00a00000 r-xp 00000000 fd:01 127 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1c00a00000-7f1c00c00000 r-xp 00000000 fd:01 128 /usr/lib/x86_64-linux-gnu/libpython3.10.so.1.0
7f1c00c00000-7f1c00e00000 rw-p 00000000 00:00 0
";

    #[test]
    fn library_versions_from_maps() {
        let l = libraries_from_maps(MAPS);
        assert_eq!(l["cuda_runtime"]["versions"], json!(["12.1.105"]));
        assert_eq!(l["cudnn"]["versions"], json!(["8.9.2"]));
        assert_eq!(l["nccl"]["versions"], json!(["2.18.1"]));
        assert_eq!(l["cuda_driver_lib"]["versions"], json!(["550.54.15"]));
        assert_eq!(l["python"]["versions"], json!(["3.10"]));
        assert!(l["torch"]["path"]
            .as_str()
            .unwrap()
            .ends_with("torch/lib/libtorch_cuda.so"));
        assert!(!l.contains_key("cublas"));
    }

    #[test]
    fn wheel_versions_and_framework_version_from_site_packages() {
        // The layout seen on a real H200 node: torch in a venv under /opt/torch.
        let root = std::env::temp_dir().join(format!(
            "nt-site-{}/opt/torch/.venv/lib/python3.12/site-packages",
            std::process::id()
        ));
        for d in [
            "nvidia/cu13/lib",
            "nvidia_cuda_runtime_cu13-13.0.96.dist-info",
            "torch/lib",
            "torch-2.9.1.dist-info",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(
            root.join("torch/version.py"),
            "__version__ = '2.9.1+cu130'\n",
        )
        .unwrap();
        let cudart = format!("{}/nvidia/cu13/lib/libcudart.so.13", root.display());
        assert_eq!(
            wheel_version(&cudart, "cuda_runtime").as_deref(),
            Some("nvidia-cuda-runtime-cu13 13.0.96")
        );
        let torch = format!("{}/torch/lib/libtorch_cuda.so", root.display());
        assert_eq!(
            framework_version(&torch, "torch").as_deref(),
            Some("2.9.1+cu130")
        );
        assert_eq!(
            wheel_version(&torch, "torch").as_deref(),
            Some("torch 2.9.1")
        );
        assert_eq!(
            wheel_version("/usr/lib/x86_64-linux-gnu/libcudart.so.12", "cuda_runtime"),
            None
        );
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("nt-site-{}", std::process::id())),
        );
    }

    #[test]
    fn job_env_keeps_numerics_and_redacts_secrets() {
        let env = b"PATH=/usr/bin\0CUDA_VISIBLE_DEVICES=0,1\0NCCL_DEBUG=INFO\0HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz\0WANDB_API_KEY=abc\0TORCH_CUDNN_V8_API_ENABLED=1\0USE_AMP=1\0MIXED_PRECISION=bf16\0HOME=/root\0NVIDIA_TF32_OVERRIDE=0\0HF_HUB_URL=https://u:pw@hub/x\0";
        let e = job_env(env);
        assert_eq!(e["CUDA_VISIBLE_DEVICES"], "0,1");
        assert_eq!(e["NCCL_DEBUG"], "INFO");
        assert_eq!(e["HF_TOKEN"], "<redacted>");
        assert_eq!(e["USE_AMP"], "1");
        assert_eq!(e["MIXED_PRECISION"], "bf16");
        assert_eq!(e["NVIDIA_TF32_OVERRIDE"], "0");
        assert_eq!(e["HF_HUB_URL"], "https://u:<redacted>@hub/x");
        assert!(
            !e.contains_key("PATH") && !e.contains_key("HOME") && !e.contains_key("WANDB_API_KEY")
        );
        // TensorFlow's variables, not Terraform's.
        let e = job_env(b"TF_CLI_CONFIG_FILE=/home/u/.terraformrc\0TF_VAR_region=eu\0TF_LOG=DEBUG\0TF_CPP_MIN_LOG_LEVEL=2\0TF_FORCE_GPU_ALLOW_GROWTH=true\0TF_ENABLE_AUTO_MIXED_PRECISION=1\0TF_CONFIG={}\0");
        assert!(
            !e.contains_key("TF_CLI_CONFIG_FILE")
                && !e.contains_key("TF_VAR_region")
                && !e.contains_key("TF_LOG"),
            "{e:?}"
        );
        assert!(
            e.contains_key("TF_CPP_MIN_LOG_LEVEL")
                && e.contains_key("TF_FORCE_GPU_ALLOW_GROWTH")
                && e.contains_key("TF_ENABLE_AUTO_MIXED_PRECISION")
                && e.contains_key("TF_CONFIG"),
            "{e:?}"
        );
    }

    #[test]
    fn snapshot_of_this_process() {
        let s = snapshot(Some(std::process::id()), None);
        assert!(s["kernel"].as_str().unwrap().len() > 3);
        assert!(s["job_cmdline"].as_str().is_some());
        assert!(
            s["errors"].as_array().unwrap().is_empty(),
            "{}",
            s["errors"]
        );
    }
}
