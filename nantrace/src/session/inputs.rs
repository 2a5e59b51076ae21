//! What a session does with each input: kernel events and samples, the job's lines, its end,
//! triggers from outside. A trigger opens the incident (or joins the one open) and sets when
//! its post-window ends.
use super::{progress, Input, Mode, Session, JOB_WIDE_POST_S};
use crate::clock::monotonic_ns;
use crate::event::{Detail, Event};
use crate::trigger::{self, Fired, TriggerKind};

impl Session {
    fn fire(&mut self, f: Fired) {
        if !self.enabled.on(f.kind) {
            if !self.said_off.contains(&f.kind) {
                self.said_off.push(f.kind);
                self.say(&format!(
                    "nantrace: trigger {} is turned off, nothing written: {}",
                    f.kind.name(),
                    crate::term::clean(&f.reason.chars().take(160).collect::<String>())
                ));
            }
            return;
        }
        self.say(&format!(
            "nantrace: trigger {}: {}",
            f.kind.name(),
            crate::term::clean(&f.reason.chars().take(160).collect::<String>())
        ));
        self.rec.push(Event::new(
            f.mono_ns,
            0,
            0,
            crate::event::Comm::NONE,
            false,
            Detail::Trigger {
                kind: f.kind.name(),
                reason: Box::new(f.reason.clone()),
            },
        ));
        // Another node's incident (a job-wide dump): what this node holds is what it recorded
        // until now and what is in flight; the aftermath is the opening node's. A short
        // window, so the job report has every node soon (issue 30). This node's own trigger
        // during it gets its whole post-window (its own aftermath is its evidence).
        let post_s = if f.kind == TriggerKind::JobWide {
            self.opts.post_s.min(JOB_WIDE_POST_S)
        } else {
            self.opts.post_s
        };
        let own_after_job_wide = !self.incident.is_empty()
            && f.kind != TriggerKind::JobWide
            && self.incident.iter().all(|t| t.kind == TriggerKind::JobWide);
        if own_after_job_wide {
            let until = monotonic_ns() + (post_s * 1e9) as u64;
            self.deadline = Some(self.deadline.map_or(until, |d| d.max(until)));
            self.post_used_s = post_s;
        }
        if self.incident.is_empty() {
            self.post_used_s = post_s;
            self.deadline = Some(monotonic_ns() + (post_s * 1e9) as u64);
            if let Some(h) = &self.on_open {
                h(f.kind.name(), &f.reason);
            }
        }
        self.incident.push(f);
    }

    /// A kernel event or a sample of this job.
    pub fn on_event(&mut self, e: Event) {
        *self.counts.entry(e.source()).or_default() += 1;
        if let Some(f) = trigger::from_event(&e, self.seen_nan) {
            self.fire(f);
        }
        if self.mode == Mode::Follow {
            if let (
                Detail::Exit {
                    code,
                    signal,
                    core_dumped,
                    ..
                },
                Some(root),
            ) = (&e.detail, self.info.root_pid)
            {
                if e.pid == root {
                    self.info.exit_code = (*code >= 0).then_some(*code);
                    self.info.exit_signal = (*signal > 0).then_some(*signal);
                    self.info.exit_core_dumped = *core_dumped;
                }
            }
        }
        self.rec.push(e);
    }

    /// A line of the job's output.
    pub fn on_log(&mut self, e: Event) {
        *self.counts.entry("log").or_default() += 1;
        if let Detail::Log(l) = &e.detail {
            if l.step.is_some() || l.loss.is_some() {
                self.last_progress = Some(monotonic_ns());
                self.stalled = false;
                self.stall_busy_said = false;
            }
        }
        if let (Some(f), Detail::Log(l)) = (&self.on_fault, &e.detail) {
            if let Some(fault) = l.fault.as_deref() {
                f(fault.family);
            }
        }
        if let Some(f) = trigger::from_event_seen(&e, self.seen_nan, self.seen_job_error) {
            self.seen_nan |= f.kind == TriggerKind::Nan;
            if f.kind == TriggerKind::JobError {
                self.seen_job_error = true;
                self.last_job_error = monotonic_ns();
            }
            self.fire(f);
        }
        self.rec.push(e);
    }

    /// The job has ended (`code`/`signal`/`core_dumped` from `wait` in spawn mode; from the
    /// kernel otherwise).
    pub fn on_exit(&mut self, code: Option<i32>, signal: Option<i32>, core_dumped: bool) {
        self.job_done = true;
        if self.mode == Mode::Spawn {
            self.info.exit_code = code;
            self.info.exit_signal = signal;
            self.info.exit_core_dumped = core_dumped;
        }
        let now = monotonic_ns();
        let (code, signal) = (self.info.exit_code, self.info.exit_signal);
        let root = self.info.root_pid.unwrap_or(0);
        if self.quiet_exit && self.incident.is_empty() {
            self.say(&format!(
                "nantrace: the job ended ({}) after the signal that the last bundle answered",
                crate::export::exit_text(code, signal, self.info.exit_core_dumped)
            ));
        } else if let Some(s) = signal {
            self.fire(Fired {
                kind: TriggerKind::Signal,
                mono_ns: now,
                reason: format!("job {root} ended by {}", crate::event::signal_name(s)),
            });
        } else if let Some(c) = code.filter(|c| *c != 0) {
            self.fire(Fired {
                kind: TriggerKind::Exit,
                mono_ns: now,
                reason: format!("job {root} exited with code {c}"),
            });
        }
        if self.incident.is_empty() {
            self.finish = true;
        } else {
            self.deadline = Some(self.deadline.unwrap_or(now).min(now + 500_000_000));
        }
    }

    /// The stall trigger: training progress (step or loss lines) seen, then none for
    /// `hang_after_s` while the job runs, and no I/O progress by the job's processes in the
    /// second half of that silence (a checkpoint being written is not a hang: the trigger
    /// waits until the writes stop, said once); once per stall. The job's counters are read
    /// on a thread of their own (`progress::ask`): a /proc read that does not answer within
    /// 5 s fires the stall without them, said.
    pub(super) fn check_stall(&mut self, now: u64) {
        let after = (self.opts.hang_after_s * 1e9) as u64;
        if after == 0 || self.stalled || self.job_done || !self.incident.is_empty() {
            return;
        }
        let Some(last) = self.last_progress else {
            return;
        };
        let silence = now.saturating_sub(last);
        if silence < after / 2 {
            self.stall_probe = None;
            // A sample still being taken is kept (its thread may be stuck in /proc): no second
            // thread is started while one has not answered.
            if self
                .stall_pending
                .as_ref()
                .is_some_and(|p| !matches!(p.rx.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty)))
            {
                self.stall_pending = None;
            }
            return;
        }
        let Some(root) = self.info.root_pid else {
            if silence >= after {
                self.fire_stall(now, silence, None);
            }
            return;
        };
        if let Some(p) = &self.stall_pending {
            match p.rx.try_recv() {
                Ok(s) => {
                    self.stall_pending = None;
                    self.on_progress_sample(now, silence, s);
                }
                // Not answered past its deadline: the stall is judged without it, and the
                // thread is left to answer (or not): never a second one beside it.
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if silence >= after
                        && now.saturating_sub(p.asked) >= progress::SAMPLE_DEADLINE_NS
                    {
                        self.fire_stall(now, silence, Some("the job's /proc counters did not answer within 5 s (a process stuck in the kernel)"));
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    // No thread could be started (or it died): judged without the counters.
                    self.stall_pending = None;
                    if silence >= after {
                        self.fire_stall(now, silence, Some("the job's /proc counters could not be read (no thread for them)"));
                    }
                }
            }
            return;
        }
        let due = self
            .stall_probe
            .as_ref()
            .is_none_or(|first| silence >= after && now.saturating_sub(first.at) >= after / 2);
        if due {
            self.stall_pending = Some(progress::ask(root, now));
        }
    }

    /// A sample of the job's counters: the first of a silence, or the one it is judged by.
    fn on_progress_sample(&mut self, now: u64, silence: u64, s: progress::Sample) {
        let Some(first) = self.stall_probe.take() else {
            self.stall_probe = Some(s);
            return;
        };
        let reading = progress::read(&first, &s, progress::ticks_per_s());
        if let progress::Reading::Busy { .. } = reading {
            if !self.stall_busy_said {
                self.stall_busy_said = true;
                self.say(&format!(
                    "nantrace: no step or loss line for {:.0} s, but {}: not a stall while the job reads or writes (hang_after_s {})",
                    silence as f64 / 1e9,
                    reading.clause(),
                    self.opts.hang_after_s
                ));
            }
            self.stall_probe = Some(s);
            return;
        }
        self.fire_stall(now, silence, Some(&reading.clause()));
    }

    fn fire_stall(&mut self, now: u64, silence: u64, io: Option<&str>) {
        self.stalled = true;
        let io = io.map_or(String::new(), |c| format!(", {c}"));
        self.fire(Fired {
            kind: TriggerKind::Stall,
            mono_ns: now,
            reason: format!(
                "no training progress for {:.0} s: no step or loss line since the last one{io} (hang_after_s {})",
                silence as f64 / 1e9,
                self.opts.hang_after_s
            ),
        });
    }

    /// A trigger from outside (a signal to nantrace, a trigger file, `ctl dump`, a node-wide
    /// event the agent routed here), received at `at`.
    pub fn on_fire(&mut self, kind: TriggerKind, reason: String, at: u64) {
        let now = monotonic_ns();
        let during_dump = at <= self.last_dump_end || self.dumping_since.is_some_and(|s| at >= s);
        if !during_dump {
            self.fire(Fired {
                kind,
                mono_ns: now,
                reason,
            });
        }
        if kind == TriggerKind::Manual {
            if self.mode == Mode::Spawn && !self.job_done {
                // The signal went on to the job: its end ends the session. Its death by a
                // signal that the last dump already answered is not a new incident.
                self.quiet_exit |= during_dump;
            } else {
                self.finish = true;
                if !self.incident.is_empty() {
                    self.deadline = Some(now + 300_000_000);
                }
            }
        }
    }

    pub fn on_input(&mut self, input: Input) {
        match input {
            Input::Kernel(batch) | Input::Samples(batch) => {
                batch.into_iter().for_each(|e| self.on_event(e))
            }
            Input::Log(e) => self.on_log(e),
            Input::JobExit {
                code,
                signal,
                core_dumped,
            } => self.on_exit(code, signal, core_dumped),
            Input::Fire(kind, reason, at) => self.on_fire(kind, reason, at),
            Input::Budget(bytes) => self.rec.set_cap(bytes),
        }
    }
}
