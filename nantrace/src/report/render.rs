//! The report as text (report.md / report.txt), and loading a bundle to report on.
use serde_json::{json, Value};

use super::{analyze, Analysis};

/// Untrusted text (log lines, process names, kernel lines, command lines) inside report.md:
/// one line, no HTML, no Markdown structure (headings, images, links, emphasis), no
/// control characters (redteam 3.3, 3.4).
pub fn md(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in crate::term::clean(s).chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            // Links and images need `[`; emphasis needs `*` (`_` inside words is literal, and
            // escaping it would garble process names such as pt_data_worker).
            '\\' | '`' | '*' | '[' | ']' | '~' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// report.md (also report.txt): the answer first, then suspects, what was checked, the facts.
/// The agent's record of which job this is, in words (Slurm job/step/user, pod, process tree).
pub fn job_identity(id: &Value) -> Option<String> {
    let sch = &id["scheduler"];
    let s = |k: &str| {
        sch[k]
            .as_str()
            .map(str::to_string)
            .or_else(|| sch[k].as_u64().map(|v| v.to_string()))
    };
    let text = match sch["kind"].as_str()? {
        "slurm" => format!(
            "Slurm job {}{}{}",
            s("job_id")?,
            s("step_id").map_or(String::new(), |x| format!(", step {x}")),
            s("user").map_or(String::new(), |u| format!(", user {u}"))
        ),
        "kubernetes" => format!(
            "Kubernetes pod {}{} (uid {}){}",
            s("namespace").map_or(String::new(), |n| format!("{n}/")),
            s("pod").unwrap_or_else(|| "?".into()),
            s("pod_uid")?,
            s("container_id").map_or(String::new(), |c| format!(
                ", container {}",
                &c[..c.len().min(12)]
            ))
        ),
        _ => format!(
            "process tree of pid {}{}",
            s("root_pid")?,
            s("user").map_or(String::new(), |u| format!(", user {u}"))
        ),
    };
    Some(format!(
        "{text} (watched by the agent, found by {})",
        id["found_by"].as_str().unwrap_or("?")
    ))
}

pub fn markdown(a: &Analysis, timeline: &Value) -> String {
    let mut s = String::new();
    s.push_str("# nantrace incident report\n\n");
    s.push_str(&format!("**{}**\n\n", md(&a.verdict)));
    s.push_str(&format!(
        "- trigger: {} at {} — {}\n",
        md(timeline["trigger"]["kind"].as_str().unwrap_or("?")),
        md(timeline["trigger"]["time"].as_str().unwrap_or("?")),
        md(timeline["trigger"]["reason"].as_str().unwrap_or(""))
    ));
    s.push_str(&format!("- {}\n", md(&a.reference)));
    s.push_str(&format!(
        "- host {} (kernel {})\n",
        md(timeline["host"]["hostname"].as_str().unwrap_or("?")),
        md(timeline["host"]["kernel"].as_str().unwrap_or("?"))
    ));
    if let Some(line) = job_identity(&timeline["job"]["identity"]) {
        s.push_str(&format!("- job: {}\n", md(&line)));
    }
    if let Some(i) = a.facts["injected"].as_str() {
        s.push_str(&format!("- NOTE: {i} (this incident was staged)\n"));
    }
    if let Some(o) = &a.order {
        s.push_str("\n## Cause and consequences\n\n");
        for l in order_lines(o) {
            s.push_str(&format!("- {}\n", md(&l)));
        }
    }
    s.push_str("\n## Ranked suspects\n\n");
    if a.suspects.is_empty() {
        s.push_str("None: no signal in the table fired.\n");
    }
    for (i, f) in a.suspects.iter().enumerate() {
        s.push_str(&format!(
            "{}. [{}, severity {}{}] {}\n",
            i + 1,
            f.family.label(),
            f.severity,
            if f.touches_job {
                ", touches the job"
            } else {
                ""
            },
            md(&f.text)
        ));
        if let Some(act) = f.action {
            s.push_str(&format!("   - NVIDIA's recommended action: {act}\n"));
        }
    }
    s.push_str("\n## What was checked\n\n");
    for c in &a.checked {
        s.push_str(&format!("- {}\n", md(c)));
    }
    s.push_str("\n## Facts for the ML team\n\n");
    let (lines, losses) = facts_lines(&a.facts);
    for l in lines {
        s.push_str(&format!("- {}\n", md(&l)));
    }
    s.push_str("\nLast loss values before the end:\n\n| step | loss | t (s, vs trigger) |\n|---|---|---|\n");
    for (step, loss, t) in losses {
        s.push_str(&format!("| {} | {} | {t} |\n", md(&step), md(&loss)));
    }
    s
}

/// The incident's order in plain lines (the caller escapes them): the first failure, then
/// what followed from it. report.md and report.html say the same.
pub fn order_lines(o: &super::Order) -> Vec<String> {
    let rank = o
        .cause_rank
        .map_or(String::new(), |r| format!(" on rank {r}"));
    let mut out = vec![format!(
        "the job's first failure{rank}, {} ({}): \"{}\"",
        o.cause_what,
        super::when(o.cause_rel_s, o.reference),
        o.cause_line
    )];
    let gap = (o.first_consequence_rel_s - o.cause_rel_s).max(0.0);
    out.push(format!(
        "then, from {} later, on the other ranks or the same, its consequences (they do not set the verdict):",
        if gap < 1.0 { format!("{:.0} ms", gap * 1000.0) } else { format!("{gap:.1} s") }
    ));
    out.extend(o.consequences.iter().map(|c| format!("consequence: {c}")));
    out
}

/// The facts for the ML team as readable lines (plain text: the caller escapes them for its
/// format) and the last loss values as (step, loss, seconds vs the trigger): report.md and
/// report.html say the same.
pub fn facts_lines(fa: &Value) -> (Vec<String>, Vec<(String, String, String)>) {
    let mut out = Vec::new();
    let exit = match (
        fa["job"]["exit_code"].as_i64(),
        fa["job"]["exit_signal"].as_i64(),
    ) {
        (_, Some(sg)) if fa["job"]["exit_core_dumped"] == true => {
            format!("signal {sg} (core dumped)")
        }
        (_, Some(sg)) => format!("signal {sg}"),
        (Some(c), _) => format!("code {c}"),
        _ => "still running".into(),
    };
    out.push(format!(
        "command: {} (pid {}), exit: {exit}",
        fa["job"]["command"]
            .as_array()
            .map(|c| c
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(" "))
            .unwrap_or_default(),
        fa["job"]["root_pid"]
    ));
    out.push(format!(
        "NVIDIA driver: {}",
        fa["nvidia_driver"]
            .as_str()
            .unwrap_or("none")
            .lines()
            .next()
            .unwrap_or("")
    ));
    out.push(format!("CUDA driver: {}", or_none(&fa["cuda_driver"])));
    out.push(format!("nvcc: {}", fa["nvcc"].as_str().unwrap_or("none")));
    if let Some(l) = fa["libraries"].as_object() {
        for (k, v) in l {
            let pkg = v["package"]
                .as_str()
                .map_or(String::new(), |p| format!(" ({p})"));
            out.push(format!("{k}: {}{pkg}", v["versions"]));
        }
    }
    if let Some(fw) = fa["frameworks"].as_object() {
        for (k, v) in fw {
            out.push(format!("{k} {v}"));
        }
    }
    out.push(format!(
        "precision-related environment: {}",
        if fa["precision_env"]
            .as_object()
            .is_some_and(|m| !m.is_empty())
        {
            fa["precision_env"].to_string()
        } else {
            "none set".into()
        }
    ));
    out.push(format!(
        "scheduler: slurm={} kubernetes={} cgroup memory limit={}",
        or_none(&fa["scheduler"]["slurm"]["job_id"]),
        or_none(&fa["scheduler"]["kubernetes"]["pod_uid"]),
        memory_limit(&fa["scheduler"]["cgroup"]["memory"]["limit_bytes"])
    ));
    let losses = fa["last_losses"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|l| {
            (
                // "inf", "NaN" as the job printed them, not as JSON strings in quotes.
                or_none(&l["step"]),
                or_none(&l["loss"]),
                format!("{:.2}", l["offset_s"].as_f64().unwrap_or(0.0)),
            )
        })
        .collect();
    (out, losses)
}

/// A JSON value as report text: `none` for null/absent, strings without quotes.
fn or_none(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        Value::String(s) if s.is_empty() => "none".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A cgroup memory limit: `unlimited` for "max", absent, or the page-rounded i64::MAX that
/// cgroup v1 reports (9223372036854771712).
fn memory_limit(v: &Value) -> String {
    match v.as_u64() {
        Some(b) if b < 1 << 60 => {
            format!("{:.1} GiB ({b} bytes)", b as f64 / f64::from(1u32 << 30))
        }
        Some(_) => "unlimited".into(),
        None => match v.as_str() {
            Some("max") | None => "unlimited".into(),
            Some(s) => s.to_string(),
        },
    }
}

/// The report for a bundle directory on disk (`nantrace report BUNDLE`).
pub fn for_bundle(dir: &std::path::Path) -> anyhow::Result<(Analysis, Value, Value)> {
    let (t, mut snap) = crate::bundle::load(dir)?;
    // A silent-data-corruption check added to the bundle (`nantrace gpucheck --bundle`).
    if let Some(g) = std::fs::read(dir.join("gpucheck.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    {
        if snap.is_object() {
            snap["gpucheck"] = g;
        } else {
            snap = json!({ "gpucheck": g });
        }
    }
    anyhow::ensure!(
        t["schema"] == crate::bundle::SCHEMA || t["schema"] == crate::bundle::MERGED_SCHEMA,
        "{}: unknown schema {}",
        dir.display(),
        t["schema"]
    );
    let snap = if snap.is_null() {
        json!({ "gpu": { "reason": "no snapshot.json in the bundle" } })
    } else {
        snap
    };
    Ok((analyze(&t, &snap), t, snap))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nulls_and_unlimited_limits_read_as_words() {
        assert_eq!(or_none(&Value::Null), "none");
        assert_eq!(or_none(&json!("12345")), "12345");
        assert_eq!(
            memory_limit(&json!(9_223_372_036_854_771_712u64)),
            "unlimited"
        );
        assert_eq!(memory_limit(&json!("max")), "unlimited");
        assert_eq!(memory_limit(&Value::Null), "unlimited");
        assert_eq!(
            memory_limit(&json!(1u64 << 30)),
            "1.0 GiB (1073741824 bytes)"
        );
    }
}
