//! `oom:mark_victim` (tested on 6.18; older kernels carry only `pid`): the OOM killer's victim.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use nantrace_common::{EventKind, OomEvent, MISSING};

use crate::{conf, count_drop, fill_header, is_job, read_data_loc, EVENTS};

#[inline(always)]
fn field_u64(ctx: &TracePointContext, off: u32) -> u64 {
    if off == MISSING {
        return 0;
    }
    // SAFETY: offset from the format file; probe_read tolerates faults.
    unsafe { ctx.read_at::<u64>(off as usize) }.unwrap_or(0)
}

#[tracepoint(category = "oom", name = "mark_victim")]
pub fn oom_mark_victim(ctx: TracePointContext) -> u32 {
    let pid_off = conf!(off.oom_pid);
    if pid_off == MISSING {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<OomEvent>(0) else {
        count_drop(EventKind::Oom);
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation; field reads go through probe_read.
    unsafe {
        fill_header(&raw mut (*p).hdr, EventKind::Oom);
        let victim = ctx.read_at::<i32>(pid_off as usize).unwrap_or(0) as u32;
        (*p).victim_pid = victim;
        (*p).victim_job = u32::from(is_job(victim));
        let uid_off = conf!(off.oom_uid);
        (*p).uid = if uid_off == MISSING { u32::MAX } else { ctx.read_at::<u32>(uid_off as usize).unwrap_or(u32::MAX) };
        (*p).total_vm = field_u64(&ctx, conf!(off.oom_total_vm));
        (*p).anon_rss = field_u64(&ctx, conf!(off.oom_anon_rss));
        (*p).file_rss = field_u64(&ctx, conf!(off.oom_file_rss));
        (*p).shmem_rss = field_u64(&ctx, conf!(off.oom_shmem_rss));
        (*p).pgtables = field_u64(&ctx, conf!(off.oom_pgtables));
        let adj_off = conf!(off.oom_score_adj);
        (*p).oom_score_adj = if adj_off == MISSING { 0 } else { i32::from(ctx.read_at::<i16>(adj_off as usize).unwrap_or(0)) };
        (*p).victim_comm = [0; 16];
        let comm_off = conf!(off.oom_comm);
        if comm_off != MISSING {
            read_data_loc(&ctx, comm_off, &mut (*p).victim_comm);
        }
    }
    crate::submit(entry);
    0
}
