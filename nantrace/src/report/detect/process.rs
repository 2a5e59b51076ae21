//! The job's processes: its own crashes (software), fatal signals from outside, long-lived workers that exited non-zero.

use super::{Acc, Ctx};
use crate::report::rules::signal;
use crate::source::Source;

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    for (rel, e) in ctx.src(Source::Signal) {
        let name = e["signal"].as_str().unwrap_or("");
        let target = e["target_pid"].as_u64().unwrap_or(0);
        let sender = e["pid"].as_u64().unwrap_or(0);
        // The event's `job` flag says the *target* is in the job; the sender is judged by its
        // own pid. A fault the kernel raised (si_code > 0: SEGV_MAPERR, BUS_ADRERR...) is the
        // process's own; one sent with kill(2)/tgkill (si_code <= 0) came from its sender.
        let sender_in_job = ctx.job_pids.contains(&sender);
        let kernel_fault = e["si_code"].as_i64().is_some_and(|c| c > 0);
        if !ctx.job_pids.contains(&target)
            || matches!(
                name,
                "SIGTERM"
                    | "SIGINT"
                    | "SIGHUP"
                    | "SIGPIPE"
                    | "SIGCHLD"
                    | "SIGUSR1"
                    | "SIGUSR2"
                    | "signal"
            )
        {
            continue;
        }
        let crash = matches!(name, "SIGSEGV" | "SIGABRT" | "SIGFPE" | "SIGILL" | "SIGBUS");
        if crash && (kernel_fault || sender == target || sender_in_job) {
            // The job crashed by itself: software, unless a hardware signal corroborates it.
            acc.add(
                signal("job_crash"),
                &format!("{name}/{target}"),
                *rel,
                true,
                || {
                    format!(
                        "{name} in job process {} {target} (raised by the job itself)",
                        e["target_comm"].as_str().unwrap_or("?")
                    )
                },
            );
        } else if !sender_in_job {
            // The job stopping its own workers is housekeeping; a kill from outside is not.
            acc.add(
                signal("job_fatal_signal"),
                &format!("{name}/{target}"),
                *rel,
                true,
                || {
                    format!(
                        "{name} to {} {target} (job) from {} {sender} (outside the job)",
                        e["target_comm"].as_str().unwrap_or("?"),
                        e["comm"].as_str().unwrap_or("?")
                    )
                },
            );
        }
    }
    let forked: std::collections::HashMap<u64, f64> = ctx
        .all(Source::Fork)
        .filter_map(|(r, e)| Some((e["child_pid"].as_u64()?, *r)))
        .collect();
    for (rel, e) in ctx.src(Source::Exit) {
        let pid = e["pid"].as_u64();
        // A helper that lived less than the threshold (`grep -q`, a pyenv shim) is not a worker.
        let lived = pid
            .and_then(|p| forked.get(&p))
            .map_or(f64::INFINITY, |f| rel - f);
        if e["job"] == true
            && pid != ctx.root
            && e["exit_code"].as_i64().is_some_and(|c| c != 0)
            && lived >= signal("worker_exit").threshold
        {
            acc.add(
                signal("worker_exit"),
                &pid.unwrap_or(0).to_string(),
                *rel,
                true,
                || {
                    format!(
                        "job process {} {} exited with code {}",
                        e["comm"].as_str().unwrap_or("?"),
                        pid.unwrap_or(0),
                        e["exit_code"]
                    )
                },
            );
        }
    }
}
