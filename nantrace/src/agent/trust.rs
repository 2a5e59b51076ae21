//! What may act on a kernel log line: a drain, and the history's count of a GPU, rest only on
//! a record the kernel wrote (facility 0 in `/dev/kmsg`, at a record's start, the line's own
//! record) or on NVML's or a tracepoint's (redteam4 D-1, D-2, D-14; `klog::who_wrote`).

/// Whether the top suspect's evidence is the kernel's own, before a drain acts on it: seen by
/// a witness no user writes (NVML, a tracepoint's fields), or kernel log lines that
/// `/dev/kmsg` records as the kernel's (facility 0, at a record's start: `klog::Writer`).
/// Text a user wrote into the log through a relay (journald's `ForwardToKMsg`), a line
/// after a newline inside another record, or a line no longer in the kernel's buffer to
/// check never drains (redteam4 D-1, D-2, D-14). `user_written_ok` also accepts lines root's
/// processes wrote into `/dev/kmsg` (`trust_user_written_kmsg`). `who` is
/// `klog::who_wrote` (a parameter for the tests).
pub fn check_writer(
    lines: &[crate::klog::Line],
    unforgeable: bool,
    user_written_ok: bool,
    who: impl Fn(&[crate::klog::Line]) -> std::io::Result<Vec<crate::klog::Writer>>,
) -> Result<(), String> {
    if unforgeable {
        return Ok(());
    }
    if lines.is_empty() {
        return Err("the evidence has neither a kernel log line nor an NVML or tracepoint record to check its writer by".into());
    }
    let writers = who(lines)
        .map_err(|e| format!("who wrote the kernel log line cannot be checked (/dev/kmsg: {e})"))?;
    judge_writers(lines, &writers, user_written_ok)
}

/// `check_writer`'s answer from the writers `klog::who_wrote` found for `lines`: one line the
/// kernel wrote is enough (the fault is real); else why not, with the first line.
pub fn judge_writers(
    lines: &[crate::klog::Line],
    writers: &[crate::klog::Writer],
    user_written_ok: bool,
) -> Result<(), String> {
    use crate::klog::Writer;
    if writers.contains(&Writer::Kernel)
        || (user_written_ok
            && writers
                .iter()
                .any(|w| matches!(w, Writer::UserSpace { .. })))
    {
        return Ok(());
    }
    let w = writers.first().copied().unwrap_or(Writer::NotFound);
    let line: String = crate::term::clean(&lines[0].text)
        .chars()
        .take(160)
        .collect();
    Err(format!(
        "the kernel log line \"{line}\" was {}",
        w.describe()
    ))
}

/// The GPUs of `d` whose faults rest on no record the kernel, NVML or a tracepoint wrote
/// (a kernel log line written into /dev/kmsg from user space, or one no longer in the buffer
/// to check), with why: the history never counts them (redteam4 D-14; the drain's rule,
/// `check_writer`). `who` is `klog::who_wrote`.
pub fn doubtful_gpus(
    d: &crate::session::Dumped,
    trust_user_written: bool,
    who: impl Fn(&[crate::klog::Line]) -> std::io::Result<Vec<crate::klog::Writer>>,
) -> Vec<(String, String)> {
    // One look at /dev/kmsg for every GPU's lines (each look writes a marker and reads the
    // whole buffer).
    let to_check: Vec<&crate::report::GpuWitness> =
        d.gpu_witnesses.iter().filter(|w| !w.unforgeable).collect();
    let all: Vec<crate::klog::Line> = to_check.iter().flat_map(|w| w.lines.clone()).collect();
    let writers = if all.is_empty() {
        Ok(Vec::new())
    } else {
        who(&all)
    };
    let mut at = 0;
    let mut out = Vec::new();
    for w in to_check {
        let why = match &writers {
            _ if w.lines.is_empty() => Err("the evidence has neither a kernel log line nor an NVML or tracepoint record to check its writer by".to_string()),
            Ok(ws) => judge_writers(
                &w.lines,
                ws.get(at..at + w.lines.len()).unwrap_or(&[]),
                trust_user_written,
            ),
            Err(e) => Err(format!(
                "who wrote the kernel log line cannot be checked (/dev/kmsg: {e})"
            )),
        };
        at += w.lines.len();
        if let Err(why) = why {
            out.push((w.pci.clone(), why));
        }
    }
    out
}

/// A trigger of the node's own events (not a watched job's): a fatal Xid, say.
pub(super) struct NodeFire {
    pub kind: crate::trigger::TriggerKind,
    pub reason: String,
    /// The GPU's minor number, where the trigger names a GPU of the node.
    pub minor: Option<u32>,
    /// The kernel log line behind it (none: a record no user writes, NVML or a tracepoint).
    pub line: Option<crate::klog::Line>,
}

/// The node-wide triggers whose kernel log line the kernel wrote (`trust::check_writer`,
/// as a drain checks; `trust_user_written_kmsg` lets root's processes' lines act); the
/// others are said on stderr and counted (`nantrace_node_triggers_total{result}`), their
/// events kept in the node's window for the next dump to show.
pub(super) fn verified(
    fires: Vec<NodeFire>,
    user_written_ok: bool,
    metrics: &super::metrics::Metrics,
) -> Vec<NodeFire> {
    // One read of /dev/kmsg for the batch's lines (at most 64: a flood of forged lines
    // costs one bounded read, the rest are not acted on).
    let lines: Vec<crate::klog::Line> = fires
        .iter()
        .filter_map(|f| f.line.clone())
        .take(64)
        .collect();
    let writers = if lines.is_empty() {
        Ok(Vec::new())
    } else {
        crate::klog::who_wrote(&lines)
    };
    let mut i = 0;
    let mut seen = std::collections::BTreeSet::new();
    fires
        .into_iter()
        .filter(|f| {
            let ok = match &f.line {
                None => Ok(()),
                Some(l) => {
                    i += 1;
                    match (&writers, lines.get(i - 1)) {
                        (Ok(w), Some(_)) => match w.get(i - 1) {
                            Some(w) => judge_writers(
                                std::slice::from_ref(l),
                                std::slice::from_ref(w),
                                user_written_ok,
                            ),
                            None => Err("its kernel log line was not looked up".into()),
                        },
                        (Err(e), Some(_)) => Err(format!(
                            "who wrote the kernel log line cannot be checked (/dev/kmsg: {e})"
                        )),
                        (_, None) => Err("more than 64 node-wide triggers at once: the rest are not checked".into()),
                    }
                }
            };
            let result = if ok.is_ok() { "fired" } else { "unverified" };
            metrics
                .add("nantrace_node_triggers_total", &[("result", result)], 1.0);
            if let Err(why) = &ok {
                crate::say!(
                    "nantrace agent: node-wide trigger not acted on (no job dumped for it): {}: {why}",
                    crate::term::clean(&f.reason)
                );
            }
            ok.is_ok()
        })
        // One fire per (trigger, GPU) acted on: the same jobs would be dumped again.
        .filter(|f| seen.insert((format!("{:?}", f.kind), f.minor)))
        .collect()
}
