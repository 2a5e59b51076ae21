//! Host kernel and CPU: hung tasks, soft lockups, RCU stalls, machine checks (corrected or not), CPU thermal throttling.

use super::{kernel_events, Acc, Ctx};
use crate::report::rules::signal;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    for (rel, e) in &kernel_events(ctx) {
        match e["class"].as_str().unwrap_or("") {
            "hung_task" => {
                let key = e["task"].as_str().unwrap_or("");
                acc.add(signal("hung_task"), key, *rel, false, || {
                    format!(
                        "hung task {}:{} blocked {} s",
                        e["task"].as_str().unwrap_or("?"),
                        e["task_pid"],
                        e["seconds"]
                    )
                });
                acc.witness(signal("hung_task"), key, e);
            }
            "machine_check" => {
                let sig = if e["uncorrected"] == true {
                    signal("machine_check")
                } else {
                    signal("machine_check_corrected")
                };
                acc.add(sig, "mce", *rel, false, || {
                    format!(
                        "machine check: {}",
                        e["message"]
                            .as_str()
                            .unwrap_or("")
                            .chars()
                            .take(100)
                            .collect::<String>()
                    )
                });
                acc.witness(sig, "mce", e);
            }
            "soft_lockup" => {
                acc.add(signal("soft_lockup"), "lockup", *rel, false, || {
                    format!("soft lockup: CPU#{} stuck for {} s", e["cpu"], e["seconds"])
                });
                acc.witness(signal("soft_lockup"), "lockup", e);
            }
            "rcu_stall" => {
                acc.add(signal("rcu_stall"), "rcu", *rel, false, || {
                    "RCU stall reported by the kernel".to_string()
                });
                acc.witness(signal("rcu_stall"), "rcu", e);
            }
            "cpu_thermal" => {
                let key = e["scope"].as_str().unwrap_or("");
                acc.add(signal("cpu_thermal"), key, *rel, false, || {
                    format!(
                        "CPU{} {} temperature above threshold, clock throttled",
                        e["cpu"],
                        e["scope"].as_str().unwrap_or("?")
                    )
                });
                acc.witness(signal("cpu_thermal"), key, e);
            }
            _ => {}
        }
    }
}
