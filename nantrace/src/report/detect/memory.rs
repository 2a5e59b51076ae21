//! Host memory: OOM kills (kernel line and oom:mark_victim are one kill), swap thrash, memory pressure.

use super::{kernel_events, Acc, Ctx};
use crate::report::rules::signal;
use crate::source::Source;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    for (rel, e) in kernel_events(ctx)
        .iter()
        .filter(|(_, e)| e["class"] == "oom_kill")
    {
        let v = e["victim_pid"].as_u64().unwrap_or(0);
        // The oom:mark_victim probe saw the same kill: one kill, two witnesses.
        if ctx
            .src(Source::Oom)
            .any(|(_, o)| o["victim_pid"].as_u64() == Some(v))
        {
            continue;
        }
        let job = ctx.job_pids.contains(&v);
        let sig = if job {
            signal("oom_kill_job")
        } else {
            signal("oom_kill_other")
        };
        acc.add(sig, &v.to_string(), *rel, job, || {
            format!(
                "OOM kill of {} {v}{}",
                e["victim_comm"].as_str().unwrap_or("?"),
                if job { " (job)" } else { "" }
            )
        });
        acc.witness(sig, &v.to_string(), e);
    }
    for (rel, e) in ctx.src(Source::Oom) {
        let v = e["victim_pid"].as_u64().unwrap_or(0);
        let job = e["victim_job"] == true || ctx.job_pids.contains(&v);
        let sig = if job {
            signal("oom_kill_job")
        } else {
            signal("oom_kill_other")
        };
        acc.add(sig, &v.to_string(), *rel, job, || {
            format!(
                "OOM kill of {} {v}{}, RSS {} MB",
                e["victim_comm"].as_str().unwrap_or("?"),
                if job { " (job)" } else { "" },
                e["anon_rss_kb"].as_u64().unwrap_or(0) / 1024
            )
        });
    }
    for (rel, e) in ctx.src(Source::System).filter(|(r, _)| *r > -60.0) {
        if let Some(s) =
            crate::report::f(&e["swap_in_kb_s"]).filter(|s| *s >= signal("swap_thrash").threshold)
        {
            acc.add(signal("swap_thrash"), "swap", *rel, false, || {
                format!("swap-in {:.0} MB/s", s / 1024.0)
            });
        }
        if let Some(p) = crate::report::f(&e["psi_memory_some_avg10"])
            .filter(|p| *p >= signal("memory_pressure").threshold)
        {
            acc.add(signal("memory_pressure"), "psi", *rel, false, || {
                format!("memory pressure (PSI some avg10) {p:.0}%")
            });
        }
    }
}
