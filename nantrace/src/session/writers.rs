//! Who wrote the window's kernel log lines, checked at the dump (redteam4 D-14, for the
//! verdict as for a drain): a line `/dev/kmsg` records as written from user space (facility
//! other than 0: a test's or an attacker's `echo > /dev/kmsg`, journald's `ForwardToKMsg`) is
//! listed in the bundle's `accounting.kernel_writers`, and the report takes it for words
//! anyone could write (at most POSSIBLY, never a drain, never the history). A line that could
//! not be checked (no longer in the buffer, the clock not fitted) is said as such and read as
//! before.
use serde_json::{json, Value};

use crate::event::{Detail, Event};

/// Classified kernel log lines checked per dump, at most.
const LINES_MAX: usize = 64;

/// `accounting.kernel_writers` for the window `order`, or `None` without a classified kernel
/// log line. One bounded read of `/dev/kmsg` (`klog::who_wrote`). Which lines, when there
/// are more than [`LINES_MAX`]: the most severe classes first, each distinct text by its
/// first and last line (a flood of copies of one forged line is checked by two of them); a
/// line left unchecked is counted (`not_checked`), and the report reads a finding with such
/// a line and none the kernel's as unverified (a flood cannot hide a forgery in the middle).
pub(super) fn check(order: &[&Event]) -> Option<Value> {
    let mut all: Vec<(crate::classify::Severity, usize, crate::klog::Line)> = Vec::new();
    for (i, e) in order.iter().enumerate() {
        if let Detail::Kmsg(k) = &e.detail {
            if let Some(c) = k.class() {
                all.push((
                    c.severity(),
                    i,
                    crate::klog::Line::new(k.text.as_ref(), e.mono_ns, k.seq()),
                ));
            }
        }
    }
    if all.is_empty() {
        return None;
    }
    let n = all.len();
    let lines = pick(all);
    let checked = lines.len();
    Some(match crate::klog::who_wrote(&lines) {
        Ok(writers) => {
            use crate::klog::Writer;
            let entry = |l: &crate::klog::Line, w: &Writer| json!({ "mono_ns": l.mono_ns, "text": l.text, "writer": w.describe() });
            let of = |f: &dyn Fn(&Writer) -> bool| -> Vec<Value> {
                lines
                    .iter()
                    .zip(&writers)
                    .filter(|(_, w)| f(w))
                    .map(|(l, w)| entry(l, w))
                    .collect()
            };
            let user = of(&|w| matches!(w, Writer::UserSpace { .. }));
            let kernel: Vec<Value> = of(&|w| *w == Writer::Kernel)
                .into_iter()
                .map(|mut v| {
                    v.as_object_mut().map(|m| m.remove("writer"));
                    v
                })
                .collect();
            let unknown = checked - user.len() - kernel.len();
            json!({ "checked": checked, "not_checked": n - checked, "unknown": unknown, "the_kernels": kernel, "not_the_kernels": user })
        }
        Err(e) => json!({ "checked": 0, "not_checked": n, "error": format!("/dev/kmsg: {e}") }),
    })
}

/// At most [`LINES_MAX`] lines, in window order: by severity, then each distinct text's
/// first and last line, then the rest.
fn pick(
    mut all: Vec<(crate::classify::Severity, usize, crate::klog::Line)>,
) -> Vec<crate::klog::Line> {
    if all.len() <= LINES_MAX {
        return all.into_iter().map(|x| x.2).collect();
    }
    // Per text: its first and last index.
    let mut ends: std::collections::HashMap<&str, (usize, usize)> =
        std::collections::HashMap::new();
    for (_, i, l) in &all {
        let e = ends.entry(l.text.as_str()).or_insert((*i, *i));
        e.0 = e.0.min(*i);
        e.1 = e.1.max(*i);
    }
    let end_of: std::collections::HashSet<usize> =
        ends.values().flat_map(|(a, b)| [*a, *b]).collect();
    all.sort_by_key(|(sev, i, _)| (std::cmp::Reverse(*sev), !end_of.contains(i), *i));
    all.truncate(LINES_MAX);
    all.sort_by_key(|(_, i, _)| *i);
    all.into_iter().map(|x| x.2).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Severity;

    fn l(i: usize, sev: Severity, text: &str) -> (Severity, usize, crate::klog::Line) {
        (sev, i, crate::klog::Line::new(text, i as u64, None))
    }

    #[test]
    fn a_forged_line_cannot_be_hidden_in_a_flood() {
        // 200 copies of a forged Xid between 40 segfaults on each side: the Xid's first and
        // last copies are checked before any warning.
        let mut all = Vec::new();
        for i in 0..40 {
            all.push(l(i, Severity::Warning, &format!("segfault {i}")));
        }
        for i in 40..240 {
            all.push(l(i, Severity::Critical, "NVRM: Xid (PCI:0000:3b:00): 79, forged"));
        }
        for i in 240..280 {
            all.push(l(i, Severity::Warning, &format!("segfault {i}")));
        }
        let got = pick(all);
        assert_eq!(got.len(), LINES_MAX);
        assert!(got.iter().any(|x| x.mono_ns == 40) && got.iter().any(|x| x.mono_ns == 239));
        // One distinct critical line among 100 others: checked.
        let mut all: Vec<_> = (0..100).map(|i| l(i, Severity::Error, &format!("hung task {i}"))).collect();
        all.insert(50, l(1000, Severity::Critical, "MCE forged"));
        assert!(pick(all).iter().any(|x| x.mono_ns == 1000));
    }
}
