//! Scheduler context: Slurm (job, step, nodes; `scontrol show job` when present), Kubernetes
//! (pod UID and container id from the cgroup path, names from the environment), and the job's
//! cgroup: memory limit, usage, OOM counters, CPU quota (cgroup v1 and v2).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;
use serde_json::{json, Value};

/// The pod's own cgroup directory: `pod<uid>` (cgroupfs driver) or
/// `[kubelet-]kubepods[-<qos>]-pod<uid>.slice` (systemd driver), the whole path component.
static POD_UID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:(?:kubelet-)?kubepods(?:-[a-z]+)?-)?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$").unwrap()
});
static CONTAINER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?:cri-containerd-|docker-|crio-|containerd-)?([0-9a-f]{64})(?:\.scope)?$")
        .unwrap()
});

/// One line of /proc/PID/cgroup: (hierarchy id, controllers, path).
pub fn parse_cgroup_file(text: &str) -> Vec<(String, String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            Some((
                it.next()?.to_string(),
                it.next()?.to_string(),
                it.next()?.to_string(),
            ))
        })
        .collect()
}

/// Kubernetes identity from a cgroup path: only under the kubelet's own cgroup roots
/// (`/kubepods...`, or `/kubelet.slice/kubelet-kubepods...` with a kubelet `--cgroup-root`),
/// which only root can create. A `pod<uid>` anywhere else (a user's delegated
/// `user@UID.service` subtree, where any user can `mkdir kubepods-pod<victim>.slice`: D-2 of
/// the third adversarial test) is not a pod.
pub fn kubernetes_from_cgroup(path: &str) -> Option<Value> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let start = match parts.first() {
        Some(p) if p.starts_with("kubepods") => 0,
        Some(&"kubelet.slice")
            if parts
                .get(1)
                .is_some_and(|p| p.starts_with("kubelet-kubepods")) =>
        {
            1
        }
        _ => return None,
    };
    if parts
        .iter()
        .any(|p| *p == "user.slice" || p.starts_with("user@") || p.starts_with("user-"))
    {
        return None;
    }
    let uid = parts[start..].iter().find_map(|p| POD_UID.captures(p))?[1].replace('_', "-");
    let container = path
        .rsplit('/')
        .find_map(|seg| CONTAINER.captures(seg).map(|c| c[1].to_string()));
    Some(json!({ "pod_uid": uid, "container_id": container }))
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn kv_file(p: &Path) -> BTreeMap<String, u64> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The job's cgroup limits and OOM counters.
pub fn cgroup(pid: u32) -> Value {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return json!({ "error": format!("/proc/{pid}/cgroup unreadable (process gone?)") });
    };
    let lines = parse_cgroup_file(&text);
    let v2_path = lines
        .iter()
        .find(|l| l.0 == "0" && l.1.is_empty())
        .map(|l| l.2.clone());
    let v1_mem = lines
        .iter()
        .find(|l| l.1.split(',').any(|c| c == "memory"))
        .map(|l| l.2.clone());
    let v1_cpu = lines
        .iter()
        .find(|l| l.1.split(',').any(|c| c == "cpu"))
        .map(|l| l.2.clone());
    let mut out = json!({ "paths": lines.iter().map(|l| format!("{}:{}:{}", l.0, l.1, l.2)).collect::<Vec<_>>() });
    let v2_root = Path::new("/sys/fs/cgroup");
    let v2_unified = if v2_root.join("cgroup.controllers").exists() {
        Some(v2_root.to_path_buf())
    } else if Path::new("/sys/fs/cgroup/unified/cgroup.controllers").exists() {
        Some(PathBuf::from("/sys/fs/cgroup/unified"))
    } else {
        None
    };
    if let Some(mem) = v1_mem {
        let d = Path::new("/sys/fs/cgroup/memory").join(mem.trim_start_matches('/'));
        let oom = kv_file(&d.join("memory.oom_control"));
        out["version"] = json!(1);
        out["memory"] = json!({
            "path": d.display().to_string(),
            "limit_bytes": read_trim(&d.join("memory.limit_in_bytes")).and_then(|s| s.parse::<u64>().ok()),
            "usage_bytes": read_trim(&d.join("memory.usage_in_bytes")).and_then(|s| s.parse::<u64>().ok()),
            "max_usage_bytes": read_trim(&d.join("memory.max_usage_in_bytes")).and_then(|s| s.parse::<u64>().ok()),
            "failcnt": read_trim(&d.join("memory.failcnt")).and_then(|s| s.parse::<u64>().ok()),
            "oom_kill": oom.get("oom_kill"),
            "under_oom": oom.get("under_oom"),
        });
        if let Some(cpu) = v1_cpu {
            let c = Path::new("/sys/fs/cgroup/cpu").join(cpu.trim_start_matches('/'));
            out["cpu"] = json!({
                "cfs_quota_us": read_trim(&c.join("cpu.cfs_quota_us")).and_then(|s| s.parse::<i64>().ok()),
                "cfs_period_us": read_trim(&c.join("cpu.cfs_period_us")).and_then(|s| s.parse::<u64>().ok()),
            });
        }
    } else if let (Some(p), Some(root)) = (v2_path.as_ref(), v2_unified) {
        let d = root.join(p.trim_start_matches('/'));
        let ev = kv_file(&d.join("memory.events"));
        out["version"] = json!(2);
        out["memory"] = json!({
            "path": d.display().to_string(),
            "limit_bytes": read_trim(&d.join("memory.max")).map(|s| if s == "max" { json!("max") } else { json!(s.parse::<u64>().ok()) }),
            "usage_bytes": read_trim(&d.join("memory.current")).and_then(|s| s.parse::<u64>().ok()),
            "peak_bytes": read_trim(&d.join("memory.peak")).and_then(|s| s.parse::<u64>().ok()),
            "swap_max": read_trim(&d.join("memory.swap.max")),
            "oom": ev.get("oom"),
            "oom_kill": ev.get("oom_kill"),
            "max_events": ev.get("max"),
        });
        out["cpu"] = json!({ "max": read_trim(&d.join("cpu.max")) });
    }
    out
}

/// The Slurm job a process's cgroup puts it in (the first `job_N` under Slurm's own
/// hierarchy: v1 `/slurm/uid_U/job_N/...`, v2 `.../slurmstepd.scope/job_N/...`): the kernel's
/// word, which the job's environment cannot change (redteam4 D-11).
pub fn slurm_job_from_cgroup(cgroup_text: &str) -> Option<String> {
    static JOB: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?:^|/)slurm(?:stepd\.scope)?/(?:uid_\d+/)?job_(\d{1,20})(?:/|$)")
            .unwrap()
    });
    parse_cgroup_file(cgroup_text)
        .iter()
        .find_map(|l| JOB.captures(&l.2).map(|c| c[1].to_string()))
}

/// `NodeList=` of `scontrol show job` (Slurm's word, not the job's environment).
pub fn node_list_of(scontrol: &str) -> Option<String> {
    scontrol.split_whitespace().find_map(|w| {
        w.strip_prefix("NodeList=")
            .filter(|v| !v.is_empty() && *v != "(null)" && v.len() <= 4096)
            .map(String::from)
    })
}

pub fn snapshot(pid: Option<u32>, env: &BTreeMap<String, String>) -> Value {
    let cg_text = pid
        .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).ok())
        .unwrap_or_default();
    slurm_snapshot(&cg_text, env, &|id: &str| {
        std::process::Command::new("scontrol")
            .args(["show", "job", id])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    })
    .map_or_else(
        || scheduler_rest(pid, &cg_text, env, Value::Null),
        |s| scheduler_rest(pid, &cg_text, env, s),
    )
}

/// The Slurm section: the job the cgroup says (else the environment's claim), `scontrol`'s
/// node list for it (else the environment's), and what the environment claimed when it
/// differs.
fn slurm_snapshot(
    cg_text: &str,
    env: &BTreeMap<String, String>,
    scontrol: &dyn Fn(&str) -> Option<String>,
) -> Option<Value> {
    let from_cg = slurm_job_from_cgroup(cg_text);
    let claimed = env.get("SLURM_JOB_ID").cloned();
    let id = from_cg.clone().or(claimed.clone())?;
    let shown = scontrol(&id);
    let env_nodes = env
        .get("SLURM_JOB_NODELIST")
        .or(env.get("SLURM_NODELIST"))
        .cloned();
    let nodes = shown.as_deref().and_then(node_list_of);
    let mut v = json!({
        "job_id": id,
        "job_id_from": if from_cg.is_some() { "cgroup" } else { "environment (the job's claim)" },
        "step_id": env.get("SLURM_STEP_ID"),
        "user": env.get("SLURM_JOB_USER"),
        "partition": env.get("SLURM_JOB_PARTITION"),
        "node_list": nodes.clone().or(env_nodes.clone()),
        "node_list_from": if nodes.is_some() { "scontrol" } else { "environment (the job's claim)" },
        "nodes": env.get("SLURM_JOB_NUM_NODES"),
        "procid": env.get("SLURM_PROCID"),
        "scontrol_show_job": shown.map_or_else(|| "scontrol not available".into(), |t| super::redact::text(&t)),
    });
    if claimed
        .as_ref()
        .is_some_and(|c| Some(c) != from_cg.as_ref())
        && from_cg.is_some()
    {
        v["claimed_job_id"] = json!(claimed);
    }
    if nodes.is_some() && env_nodes.is_some() && env_nodes != nodes {
        v["claimed_node_list"] = json!(env_nodes);
    }
    Some(v)
}

fn scheduler_rest(
    pid: Option<u32>,
    cg_text: &str,
    env: &BTreeMap<String, String>,
    slurm: Value,
) -> Value {
    let cg_text = cg_text.to_string();
    let k8s = parse_cgroup_file(&cg_text)
        .iter()
        .find_map(|l| kubernetes_from_cgroup(&l.2))
        .map(|mut k| {
            k["namespace"] = json!(env.get("POD_NAMESPACE"));
            k["pod_name"] = json!(env.get("POD_NAME").or(env.get("HOSTNAME")));
            k
        });
    json!({
        "slurm": slurm,
        "kubernetes": k8s,
        "cgroup": pid.map(cgroup),
        "note": "restarts/migrations: compare kubernetes.container_id and slurm step across bundles of the same job",
    })
}

/// What changed between two scheduler sections of the same job: the container (restart or
/// migration), the Slurm step, the cgroup's OOM kill counter.
pub fn changes(prev: &Value, cur: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let (a, b) = (
        &prev["kubernetes"]["container_id"],
        &cur["kubernetes"]["container_id"],
    );
    if !a.is_null() && !b.is_null() && a != b {
        out.push(format!(
            "container id changed from {} to {} (restart or migration of pod {})",
            a, b, cur["kubernetes"]["pod_uid"]
        ));
    }
    let (a, b) = (&prev["slurm"]["step_id"], &cur["slurm"]["step_id"]);
    if !a.is_null() && a != b {
        out.push(format!("Slurm step changed from {a} to {b}"));
    }
    let (a, b) = (
        prev["cgroup"]["memory"]["oom_kill"].as_u64(),
        cur["cgroup"]["memory"]["oom_kill"].as_u64(),
    );
    if let (Some(a), Some(b)) = (a, b) {
        if b > a {
            out.push(format!(
                "cgroup OOM kill counter +{} (limit {} bytes)",
                b - a,
                cur["cgroup"]["memory"]["limit_bytes"]
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_restart_and_cgroup_oom_are_changes() {
        let a = json!({ "kubernetes": { "pod_uid": "p1", "container_id": "aaa" }, "cgroup": { "memory": { "oom_kill": 0, "limit_bytes": 1024 } } });
        let b = json!({ "kubernetes": { "pod_uid": "p1", "container_id": "bbb" }, "cgroup": { "memory": { "oom_kill": 2, "limit_bytes": 1024 } } });
        assert_eq!(
            changes(&a, &b),
            vec![
                "container id changed from \"aaa\" to \"bbb\" (restart or migration of pod \"p1\")"
                    .to_string(),
                "cgroup OOM kill counter +2 (limit 1024 bytes)".to_string(),
            ]
        );
        assert!(changes(&b, &b).is_empty());
    }

    #[test]
    fn kubernetes_ids_from_cgroup_paths() {
        let v2 = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope";
        let l = parse_cgroup_file(v2);
        let k = kubernetes_from_cgroup(&l[0].2).unwrap();
        assert_eq!(k["pod_uid"], "1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d");
        assert_eq!(
            k["container_id"],
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
        );
        let v1 = "/kubepods/besteffort/pod8f3e1c2a-1b2c-4d5e-9f00-123456789abc/fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";
        assert_eq!(
            kubernetes_from_cgroup(v1).unwrap()["pod_uid"],
            "8f3e1c2a-1b2c-4d5e-9f00-123456789abc"
        );
        assert!(kubernetes_from_cgroup("/user.slice/user-0.slice/session-1.scope").is_none());
        // D-2 of the third adversarial test: a user's delegated subtree, or any place but the
        // kubelet's roots, is never a pod, however its directories are named.
        for forged in [
            "/user.slice/user-1001.slice/user@1001.service/kubepods-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/x.scope",
            "/user.slice/user-1001.slice/user@1001.service/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice",
            "/system.slice/evil-pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d.scope",
            "/kubepods.slice/user.slice/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d",
            "/kubepods/besteffort/xpod8f3e1c2a-1b2c-4d5e-9f00-123456789abc/c",
        ] {
            assert!(kubernetes_from_cgroup(forged).is_none(), "{forged}");
        }
        let rooted = "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope";
        assert_eq!(
            kubernetes_from_cgroup(rooted).unwrap()["pod_uid"],
            "1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"
        );
    }

    #[test]
    fn slurm_from_environment() {
        let mut env = BTreeMap::new();
        env.insert("SLURM_JOB_ID".to_string(), "4242".to_string());
        env.insert("SLURM_STEP_ID".to_string(), "0".to_string());
        env.insert("SLURM_JOB_NODELIST".to_string(), "gpu[01-04]".to_string());
        let s = snapshot(None, &env);
        assert_eq!(s["slurm"]["job_id"], "4242");
        assert_eq!(s["slurm"]["node_list"], "gpu[01-04]");
        assert_eq!(s["slurm"]["job_id_from"], "environment (the job's claim)");
        assert_eq!(s["kubernetes"], Value::Null);
    }

    /// redteam4 D-11 (F4, F6): a job that sets `SLURM_JOB_ID=15` inside its own job 16 and
    /// `SLURM_JOB_NODELIST='vm,gpu[0001-4000]'` got job 15's `scontrol show job` and 4000
    /// MISSING nodes. The cgroup says the job (the kernel's word), scontrol the node list.
    #[test]
    fn the_slurm_job_is_the_cgroups_and_its_nodes_scontrols() {
        let mut env = BTreeMap::new();
        env.insert("SLURM_JOB_ID".to_string(), "15".to_string());
        env.insert(
            "SLURM_JOB_NODELIST".to_string(),
            "vm,gpu[0001-4000]".to_string(),
        );
        let asked = std::cell::RefCell::new(Vec::new());
        let scontrol = |id: &str| {
            asked.borrow_mut().push(id.to_string());
            Some(format!(
                "JobId={id} JobName=train UserId=alice(1001)\n   NodeList=vm BatchHost=vm\n"
            ))
        };
        for cg in [
            "12:memory:/slurm/uid_1001/job_16/step_0\n11:cpu,cpuacct:/slurm/uid_1001/job_16/step_0/task_0\n",
            "0::/system.slice/slurmstepd.scope/job_16/step_0/user/task_0\n",
        ] {
            let s = slurm_snapshot(cg, &env, &scontrol).unwrap();
            assert_eq!(s["job_id"], "16", "{cg}");
            assert_eq!(s["job_id_from"], "cgroup");
            assert_eq!(s["claimed_job_id"], "15");
            assert_eq!(s["node_list"], "vm");
            assert_eq!(s["node_list_from"], "scontrol");
            assert_eq!(s["claimed_node_list"], "vm,gpu[0001-4000]");
        }
        assert_eq!(
            *asked.borrow(),
            ["16", "16"],
            "scontrol asked about the job's own id only"
        );
        // A cgroup of the user's own making that names another job, under its delegated
        // subtree: the first Slurm job on the path is the job's.
        let nested =
            "0::/system.slice/slurmstepd.scope/job_16/step_0/user/slurmstepd.scope/job_15\n";
        assert_eq!(slurm_job_from_cgroup(nested).as_deref(), Some("16"));
        assert_eq!(
            slurm_job_from_cgroup("0::/user.slice/user-1001.slice/job_15\n"),
            None
        );
    }
}
