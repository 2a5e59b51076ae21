//! The files rendered from a timeline (report, trace, HTML), and the summary printed when a
//! bundle is written.
pub mod html;
pub mod jobhtml;
pub mod perfetto;

use std::path::Path;

use crate::bundle::{first_nan, Incident};

use crate::classify::KmsgClass;
use crate::clock::rfc3339;
use crate::event::{Detail, Event};

/// report.md, report.txt, report.html and trace.json from a timeline (a bundle's digest at
/// its dump, or a bundle read back) and its snapshot, with the analysis they render, as work
/// in the order a bundle is written (`bundle::Derived`). The trace and the report read the
/// same timeline independently: the trace on a thread of its own (the dump of 100 k events
/// went from 1.1 s to under 1 s on 2 cores).
pub fn derived<'a>(
    t: &'a serde_json::Value,
    snapshot: &'a serde_json::Value,
) -> crate::bundle::Derived<'a, crate::report::Analysis> {
    crate::bundle::Derived {
        beside: Box::new(move || {
            vec![(
                "trace.json",
                serde_json::to_vec(&perfetto::trace(t)).unwrap_or_default(),
            )]
        }),
        answer: Box::new(move || {
            let a = crate::report::analyze(t, snapshot);
            let md = crate::report::markdown(&a, t);
            (
                a,
                vec![
                    ("report.md", md.clone().into_bytes()),
                    ("report.txt", md.into_bytes()),
                ],
            )
        }),
        views: Box::new(move |a| vec![("report.html", html::render(a, t, snapshot).into_bytes())]),
        summary: Box::new(move |a| crate::jobreport::summary::of(t, snapshot, a)),
    }
}

/// "ended by SIGINT", "exit code 3", "still running".
pub fn exit_text(code: Option<i32>, signal: Option<i32>, core_dumped: bool) -> String {
    match (code, signal) {
        (_, Some(s)) if core_dumped => {
            format!("ended by {} (core dumped)", crate::event::signal_name(s))
        }
        (_, Some(s)) => format!("ended by {}", crate::event::signal_name(s)),
        (Some(c), None) => format!("exit code {c}"),
        _ => "still running".into(),
    }
}

fn count(events: &[&Event], f: impl Fn(&Event) -> bool) -> usize {
    events.iter().filter(|e| f(e)).count()
}

/// The 5-line summary printed when a bundle is written.
pub fn summary(dir: &Path, inc: &Incident, verdict: Option<&str>) -> String {
    let t = &inc.triggers[0];
    let t0 = t.mono_ns;
    let rel = |m: u64| (m as f64 - t0 as f64) / 1e9;
    let ev = inc.events;
    let nan = first_nan(ev).map_or("no non-finite value in the log".to_string(), |e| {
        let Detail::Log(l) = &e.detail else {
            unreachable!()
        };
        let what = match crate::nanscan::describe(&l.text) {
            Some((w, true)) => format!("first NaN ({})", crate::term::clean(&w)),
            Some((w, false)) => format!(
                "first non-finite value ({}; no NaN yet)",
                crate::term::clean(&w)
            ),
            None => "first NaN".into(),
        };
        format!(
            "{what} at {:+.1} s{}: {}",
            rel(e.mono_ns),
            l.step.map_or(String::new(), |s| format!(" (step {s})")),
            crate::term::clean(&l.text.chars().take(80).collect::<String>())
        )
    });
    let xids: Vec<&Event> = ev.iter().copied().filter(|e| matches!(&e.detail, Detail::Kmsg(k) if matches!(k.class(), Some(KmsgClass::Xid { .. }) | Some(KmsgClass::GpuFallenOffBus { .. })))).collect();
    let worst = xids
        .iter()
        .max_by_key(|e| match &e.detail {
            Detail::Kmsg(k) => k.class().map(KmsgClass::severity),
            _ => None,
        })
        .map(|e| match &e.detail {
            Detail::Kmsg(k) => match k.class() {
                Some(KmsgClass::Xid {
                    xid, pci, severity, ..
                }) => format!(
                    " (worst: Xid {xid} {severity:?} on {pci}, {:+.1} s)",
                    rel(e.mono_ns)
                ),
                Some(KmsgClass::GpuFallenOffBus { pci, .. }) => {
                    format!(" (GPU {pci} fell off the bus, {:+.1} s)", rel(e.mono_ns))
                }
                _ => String::new(),
            },
            _ => String::new(),
        })
        .unwrap_or_default();
    let ooms = count(ev, |e| matches!(e.detail, Detail::Oom(_)));
    let aers = count(ev, |e| e.source() == "aer");
    let sigs = count(ev, |e| e.job() && matches!(e.detail, Detail::Signal { .. }));
    let forks = count(ev, |e| e.job() && matches!(e.detail, Detail::Fork { .. }));
    let exit = exit_text(
        inc.job.exit_code,
        inc.job.exit_signal,
        inc.job.exit_core_dumped,
    );
    let rs = &inc.accounting["recorder"];
    let drops: u64 = inc.accounting["kernel_drops"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
    let span = match (ev.first(), ev.last()) {
        (Some(a), Some(b)) => (b.mono_ns - a.mono_ns) as f64 / 1e9,
        _ => 0.0,
    };
    format!(
        "{}nantrace: incident bundle written: {}\n  trigger  {} at {}: {}\n  log      {}\n  kernel   {} Xid{}, {} OOM kill(s), {} AER, {} fatal signal(s) to the job\n  job      pid {} {}, {} fork(s); {} events over {:.1} s, {} drops, {} evictions",
        verdict.map_or(String::new(), |v| format!("nantrace: {}\n", crate::term::clean(&v.chars().take(220).collect::<String>()))),
        dir.display(),
        t.kind.name(),
        rfc3339(inc.clock.to_wall(t.mono_ns)),
        crate::term::clean(&t.reason.chars().take(100).collect::<String>()),
        nan,
        xids.len(),
        worst,
        ooms,
        aers,
        sigs,
        inc.job.root_pid.unwrap_or(0),
        exit,
        forks,
        ev.len(),
        span,
        drops,
        rs["evicted_by_time"].as_u64().unwrap_or(0) + rs["evicted_by_memory"].as_u64().unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::exit_text;

    #[test]
    fn the_exit_says_how_the_job_ended() {
        assert_eq!(exit_text(Some(1), None, false), "exit code 1");
        assert_eq!(exit_text(None, Some(9), false), "ended by SIGKILL");
        assert_eq!(
            exit_text(None, Some(11), true),
            "ended by SIGSEGV (core dumped)"
        );
        assert_eq!(exit_text(None, None, false), "still running");
    }
}
