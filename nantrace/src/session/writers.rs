//! Who wrote the window's kernel log lines, checked at the dump (redteam4 D-14, for the
//! verdict as for a drain): a line `/dev/kmsg` records as written from user space (facility
//! other than 0: a test's or an attacker's `echo > /dev/kmsg`, journald's `ForwardToKMsg`) is
//! listed in the bundle's `accounting.kernel_writers`, and the report takes it for words
//! anyone could write (at most POSSIBLY, never a drain, never the history). A line that could
//! not be checked (no longer in the buffer, the clock not fitted) is said as such and read as
//! before.
use serde_json::{json, Value};

use crate::event::{Detail, Event};

/// Classified kernel log lines checked per dump, at most: the first and the last half.
const LINES_MAX: usize = 64;

/// `accounting.kernel_writers` for the window `order`, or `None` without a classified kernel
/// log line. One bounded read of `/dev/kmsg` (`klog::who_wrote`).
pub(super) fn check(order: &[&Event]) -> Option<Value> {
    let all: Vec<crate::klog::Line> = order
        .iter()
        .filter_map(|e| match &e.detail {
            Detail::Kmsg(k) if k.class().is_some() => Some(crate::klog::Line::new(
                k.text.as_ref(),
                e.mono_ns,
                k.seq(),
            )),
            _ => None,
        })
        .collect();
    if all.is_empty() {
        return None;
    }
    let n = all.len();
    let lines: Vec<crate::klog::Line> = if n > LINES_MAX {
        all[..LINES_MAX / 2]
            .iter()
            .chain(&all[n - LINES_MAX / 2..])
            .cloned()
            .collect()
    } else {
        all
    };
    let checked = lines.len();
    Some(match crate::klog::who_wrote(&lines) {
        Ok(writers) => {
            let not: Vec<Value> = lines
                .iter()
                .zip(&writers)
                .filter(|(_, w)| matches!(w, crate::klog::Writer::UserSpace { .. }))
                .map(|(l, w)| json!({ "mono_ns": l.mono_ns, "text": l.text, "writer": w.describe() }))
                .collect();
            let unchecked = writers
                .iter()
                .filter(|w| {
                    !matches!(
                        w,
                        crate::klog::Writer::Kernel | crate::klog::Writer::UserSpace { .. }
                    )
                })
                .count();
            json!({ "checked": checked, "not_checked": n - checked, "written_by_the_kernel": writers.iter().filter(|w| **w == crate::klog::Writer::Kernel).count(), "unknown": unchecked, "not_the_kernels": not })
        }
        Err(e) => json!({ "checked": 0, "not_checked": n, "error": format!("/dev/kmsg: {e}") }),
    })
}
