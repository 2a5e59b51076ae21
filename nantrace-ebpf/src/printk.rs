//! `printk:console` (tested on 6.18): every kernel log record as it is written, so NVRM Xid,
//! AER, OOM, link and MCE lines reach userspace without polling /dev/kmsg.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use nantrace_common::{EventKind, PrintkEvent, FLAG_TRUNCATED, MISSING, PRINTK_MSG_LEN};

use crate::{conf, count_drop, fill_header, read_data_loc, EVENTS};

#[tracepoint(category = "printk", name = "console")]
pub fn printk_console(ctx: TracePointContext) -> u32 {
    let off = conf!(off.printk_msg);
    if off == MISSING {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<PrintkEvent>(0) else {
        count_drop(EventKind::Printk);
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: `p` is a fresh reservation of size_of::<PrintkEvent>().
    unsafe {
        fill_header(&raw mut (*p).hdr, EventKind::Printk);
        let n = read_data_loc(&ctx, off, &mut (*p).msg);
        (*p).len = n as u32;
        (*p)._pad = 0;
        if n >= PRINTK_MSG_LEN - 1 {
            (*p).hdr.flags |= FLAG_TRUNCATED;
        }
    }
    crate::submit(entry);
    0
}
