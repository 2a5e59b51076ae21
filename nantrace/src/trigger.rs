//! Triggers: what makes nantrace dump a bundle. Each can be turned off with `--no-trigger KIND`.
use serde::Serialize;

use crate::classify::{KmsgClass, Severity};
use crate::event::{Detail, Event};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum TriggerKind {
    /// First non-finite loss-like value in the job's output.
    Nan,
    /// The job exited with a non-zero code.
    Exit,
    /// The job was ended by a fatal signal.
    Signal,
    /// The OOM killer chose a job process.
    Oom,
    /// An Xid (or fallen-off-the-bus) of critical severity.
    Xid,
    /// A fatal failure line in the job's output of a family that can be the machine (GPU,
    /// network, host memory, storage) or a collective hang: the job is about to die, dump now.
    #[serde(rename = "job-error")]
    JobError,
    /// SIGUSR1 sent to nantrace.
    Usr1,
    /// `nantrace ctl dump` (the agent).
    Ctl,
    /// The `--trigger-file` appeared.
    File,
    /// SIGINT/SIGTERM to nantrace: dump what there is, then exit.
    Manual,
    /// Another node's agent opened an incident of this job (the agent's `job_dir`).
    #[serde(rename = "job-wide")]
    JobWide,
    /// The job stopped making training progress: no step or loss line for `hang_after_s`
    /// while it runs (off unless set: below the job's collective timeout, the hung ranks are
    /// still there to be looked at).
    Stall,
}

impl TriggerKind {
    pub const ALL: [TriggerKind; 12] = [
        TriggerKind::Nan,
        TriggerKind::Exit,
        TriggerKind::Signal,
        TriggerKind::Oom,
        TriggerKind::Xid,
        TriggerKind::JobError,
        TriggerKind::Usr1,
        TriggerKind::Ctl,
        TriggerKind::File,
        TriggerKind::Manual,
        TriggerKind::JobWide,
        TriggerKind::Stall,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TriggerKind::Nan => "nan",
            TriggerKind::Exit => "exit",
            TriggerKind::Signal => "signal",
            TriggerKind::Oom => "oom",
            TriggerKind::Xid => "xid",
            TriggerKind::JobError => "job-error",
            TriggerKind::Usr1 => "usr1",
            TriggerKind::Ctl => "ctl",
            TriggerKind::File => "file",
            TriggerKind::Manual => "manual",
            TriggerKind::JobWide => "job-wide",
            TriggerKind::Stall => "stall",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// One trigger that fired.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Fired {
    pub kind: TriggerKind,
    pub mono_ns: u64,
    pub reason: String,
}

/// Which triggers are on.
#[derive(Clone, Debug)]
pub struct Enabled(Vec<TriggerKind>);

impl Enabled {
    pub fn all_but(off: &[TriggerKind]) -> Self {
        Self(
            TriggerKind::ALL
                .into_iter()
                .filter(|k| !off.contains(k))
                .collect(),
        )
    }

    pub fn on(&self, k: TriggerKind) -> bool {
        self.0.contains(&k)
    }
}

/// Does this event fire a trigger by itself? (Exit of the job and signals to nantrace are
/// decided by the session, which knows the job's root.)
pub fn from_event(e: &Event, seen_nan: bool) -> Option<Fired> {
    from_event_seen(e, seen_nan, false)
}

/// As [`from_event`], also told whether a job-error trigger already fired in this session
/// (the first failure line opens the incident; the many that follow it do not).
pub fn from_event_seen(e: &Event, seen_nan: bool, seen_job_error: bool) -> Option<Fired> {
    use crate::joblog::JobFamily as F;
    let fired = |kind, reason: String| {
        Some(Fired {
            kind,
            mono_ns: e.mono_ns,
            reason,
        })
    };
    match &e.detail {
        Detail::Log(l) if l.nonfinite && !seen_nan => fired(TriggerKind::Nan, l.text.to_string()),
        Detail::Log(l) if !seen_job_error => match l.fault.as_deref() {
            Some(f)
                if f.fatal
                    && !f.generic
                    && matches!(
                        f.family,
                        F::GpuHw
                            | F::GpuAmbiguous
                            | F::Network
                            | F::HostMemory
                            | F::Storage
                            | F::Hang
                    ) =>
            {
                fired(TriggerKind::JobError, format!("{}: {}", f.what, l.text))
            }
            _ => None,
        },
        Detail::Oom(o) if o.victim_job => fired(
            TriggerKind::Oom,
            format!(
                "OOM kill of job process {} ({})",
                o.victim_pid,
                crate::event::comm_str(&o.victim_comm)
            ),
        ),
        Detail::Kmsg(k) => match k.class() {
            Some(c @ (KmsgClass::Xid { .. } | KmsgClass::GpuFallenOffBus { .. }))
                if c.severity() == Severity::Critical =>
            {
                fired(TriggerKind::Xid, k.text.to_string())
            }
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kmsg, LogLine};

    fn log(text: &str, nonfinite: bool) -> Event {
        Event::new(
            7,
            1,
            1,
            crate::event::Comm::NONE,
            true,
            Detail::Log(Box::new(LogLine {
                text: text.into(),
                stream: 1,
                nonfinite,
                step: None,
                loss: None,
                loss_scale: None,
                overflow: false,
                fault: None,
            })),
        )
    }

    fn kmsg(text: &str) -> Event {
        Event::new(
            9,
            0,
            0,
            crate::event::Comm::NONE,
            false,
            Detail::Kmsg(Kmsg::new(text, crate::classify::classify(text), None)),
        )
    }

    #[test]
    fn first_nan_fires_once() {
        let f = from_event(&log("loss nan", true), false).unwrap();
        assert_eq!((f.kind, f.mono_ns), (TriggerKind::Nan, 7));
        assert!(from_event(&log("loss nan", true), true).is_none());
        assert!(from_event(&log("loss 1.0", false), false).is_none());
    }

    #[test]
    fn only_critical_xids_fire() {
        assert_eq!(
            from_event(
                &kmsg("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."),
                false
            )
            .unwrap()
            .kind,
            TriggerKind::Xid
        );
        assert!(from_event(
            &kmsg("NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception"),
            false
        )
        .is_none());
        assert!(from_event(
            &kmsg("NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=x, Ch 00000010"),
            false
        )
        .is_none());
    }

    #[test]
    fn a_machine_family_failure_line_fires_once_and_software_does_not() {
        let line = |t: &str| {
            let mut r = crate::session::LineReader::new(crate::nanscan::Scanner::default());
            Event::new(
                7,
                1,
                1,
                crate::event::Comm::NONE,
                true,
                Detail::Log(Box::new(r.read(t))),
            )
        };
        let ecc = line("RuntimeError: CUDA error: uncorrectable ECC error encountered");
        let f = from_event_seen(&ecc, false, false).unwrap();
        assert_eq!(f.kind, TriggerKind::JobError);
        assert!(
            f.reason
                .starts_with("uncorrectable ECC error: RuntimeError"),
            "{}",
            f.reason
        );
        assert_eq!(
            from_event_seen(&ecc, false, true),
            None,
            "only the first one"
        );
        assert_eq!(
            from_event_seen(
                &line("RuntimeError: CUDA error: device-side assert triggered"),
                false,
                false
            ),
            None
        );
        assert_eq!(
            from_event_seen(
                &line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
                false,
                false
            ),
            None
        );
        assert_eq!(from_event_seen(&line("NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1234> with status=12 opcode=0 len=0 vendor err 129"), false, false).map(|f| f.kind), Some(TriggerKind::JobError));
        assert_eq!(TriggerKind::parse("job-error"), Some(TriggerKind::JobError));
    }

    #[test]
    fn names_round_trip_and_disable() {
        for k in TriggerKind::ALL {
            assert_eq!(TriggerKind::parse(k.name()), Some(k));
        }
        let e = Enabled::all_but(&[TriggerKind::Xid]);
        assert!(!e.on(TriggerKind::Xid) && e.on(TriggerKind::Nan));
    }
}
