//! `ras:aer_event`: decoded PCIe AER errors. Only present with CONFIG_PCIEAER (absent on the
//! 6.18 test kernel, where the printk probe still sees the AER text).
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use nantrace_common::{AerEvent, EventKind, MISSING};

use crate::{conf, count_drop, fill_header, read_data_loc, EVENTS};

#[tracepoint(category = "ras", name = "aer_event")]
pub fn ras_aer_event(ctx: TracePointContext) -> u32 {
    if conf!(off.aer_status) == MISSING {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<AerEvent>(0) else {
        count_drop(EventKind::Aer);
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation; field reads go through probe_read.
    unsafe {
        fill_header(&raw mut (*p).hdr, EventKind::Aer);
        (*p).status = ctx.read_at::<u32>(conf!(off.aer_status) as usize).unwrap_or(0);
        (*p).severity = u32::from(ctx.read_at::<u8>(conf!(off.aer_severity) as usize).unwrap_or(0xff));
        let tlp_off = conf!(off.aer_tlp);
        let valid_off = conf!(off.aer_tlp_valid);
        (*p).tlp_header_valid = 0;
        (*p).tlp_header = [0; 4];
        if valid_off != MISSING && tlp_off != MISSING {
            (*p).tlp_header_valid = u32::from(ctx.read_at::<u8>(valid_off as usize).unwrap_or(0));
            (*p).tlp_header = ctx.read_at::<[u32; 4]>(tlp_off as usize).unwrap_or([0; 4]);
        }
        (*p)._pad = 0;
        (*p).dev_name = [0; 32];
        read_data_loc(&ctx, conf!(off.aer_dev_name), &mut (*p).dev_name);
    }
    crate::submit(entry);
    0
}
