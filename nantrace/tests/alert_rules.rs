//! The Prometheus rules shipped in dist/prometheus/ (issue 25): `promtool check rules` and
//! `promtool test rules` on their unit tests, which make each alert fire on its case and stay
//! quiet on the case beside it. Not root. promtool comes from Debian's `prometheus` package
//! (scripts/prometheus-local.sh installs it as root): without it the test fails in CI and is
//! skipped, loudly, elsewhere. The same rules, loaded by a real Prometheus scraping a real
//! agent, fire on an injected Xid in agent_services.rs.
use std::path::PathBuf;
use std::process::Command;

fn dist() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dist/prometheus")
}

fn promtool() -> Option<&'static str> {
    if Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Some("promtool");
    }
    // SAFETY: geteuid has no failure mode.
    if unsafe { libc::geteuid() } == 0 {
        let st = Command::new("bash")
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/prometheus-local.sh"))
            .arg("install")
            .status();
        if st.is_ok_and(|s| s.success())
            && Command::new("promtool")
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        {
            return Some("promtool");
        }
    }
    if std::env::var_os("CI").is_some() {
        panic!("promtool is not installed (Debian: apt-get install prometheus); and scripts/prometheus-local.sh install could not install it");
    }
    eprintln!("SKIPPED the_shipped_alert_rules_pass_promtool: promtool not installed (apt-get install prometheus)");
    None
}

#[test]
fn the_shipped_alert_rules_pass_promtool() {
    let Some(tool) = promtool() else { return };
    for args in [
        &["check", "rules", "nantrace-rules.yml"][..],
        &["test", "rules", "nantrace-rules.test.yml"][..],
    ] {
        let o = Command::new(tool)
            .current_dir(dist())
            .args(args)
            .output()
            .unwrap();
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(o.status.success(), "promtool {}: {out}", args.join(" "));
        assert!(
            out.contains("SUCCESS"),
            "promtool {}: {out}",
            args.join(" ")
        );
    }
    // The Grafana dashboard's queries parse (promtool checks them as recording rules).
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dist().join("../grafana/nantrace-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut y = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, p) in dash["panels"].as_array().unwrap().iter().enumerate() {
        y.push_str(&format!(
            "      - record: dashboard:panel{i}\n        expr: {}\n",
            serde_json::to_string(p["targets"][0]["expr"].as_str().unwrap()).unwrap()
        ));
    }
    let tmp = std::env::temp_dir().join(format!("nt-dashboard-rules-{}.yml", std::process::id()));
    std::fs::write(&tmp, y).unwrap();
    let o = Command::new(tool)
        .arg("check")
        .arg("rules")
        .arg(&tmp)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&tmp);
    assert!(
        o.status.success(),
        "a dashboard query does not parse: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // Every alert is tested: its name appears in the unit tests.
    let rules = std::fs::read_to_string(dist().join("nantrace-rules.yml")).unwrap();
    let tests = std::fs::read_to_string(dist().join("nantrace-rules.test.yml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    for a in &alerts {
        assert!(
            tests.contains(&format!("alertname: {a}\n")),
            "alert {a} has no promtool test"
        );
        let block = rules
            .split(&format!("- alert: {a}\n"))
            .nth(1)
            .unwrap()
            .split("- alert: ")
            .next()
            .unwrap();
        assert!(
            block.contains("summary:") && block.contains("action:") && block.contains("severity:"),
            "alert {a} lacks a summary, an action or a severity"
        );
    }
}
