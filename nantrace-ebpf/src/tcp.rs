//! `tcp:tcp_retransmit_skb` (tested on 6.18): addresses, ports and state of each retransmit.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use nantrace_common::{EventKind, TcpRetransmitEvent, MISSING};

use crate::{conf, count_drop, fill_header, EVENTS};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

#[tracepoint(category = "tcp", name = "tcp_retransmit_skb")]
pub fn tcp_retransmit(ctx: TracePointContext) -> u32 {
    let fam_off = conf!(off.tcp_family);
    let Some(mut entry) = EVENTS.reserve::<TcpRetransmitEvent>(0) else {
        count_drop(EventKind::TcpRetransmit);
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: fresh reservation; field reads go through probe_read.
    unsafe {
        fill_header(&raw mut (*p).hdr, EventKind::TcpRetransmit);
        // `family` is not in 5.10's record (the kernel matrix found it); there an IPv4
        // socket's addresses are also stored v4-mapped (::ffff:a.b.c.d) in saddr_v6.
        let family = if fam_off == MISSING {
            let v6 = ctx.read_at::<[u8; 16]>(conf!(off.tcp_saddr_v6) as usize).unwrap_or([0; 16]);
            let mapped = v6[..10].iter().all(|b| *b == 0) && v6[10] == 0xff && v6[11] == 0xff;
            if mapped { AF_INET } else { AF_INET6 }
        } else {
            ctx.read_at::<u16>(fam_off as usize).unwrap_or(0)
        };
        (*p).family = family;
        (*p)._pad = [0; 3];
        (*p).state = ctx.read_at::<i32>(conf!(off.tcp_state) as usize).unwrap_or(0);
        (*p).sport = ctx.read_at::<u16>(conf!(off.tcp_sport) as usize).unwrap_or(0);
        (*p).dport = ctx.read_at::<u16>(conf!(off.tcp_dport) as usize).unwrap_or(0);
        (*p).saddr = [0; 16];
        (*p).daddr = [0; 16];
        if family == AF_INET {
            let s = ctx.read_at::<[u8; 4]>(conf!(off.tcp_saddr) as usize).unwrap_or([0; 4]);
            let d = ctx.read_at::<[u8; 4]>(conf!(off.tcp_daddr) as usize).unwrap_or([0; 4]);
            let (mut s16, mut d16) = ([0u8; 16], [0u8; 16]);
            s16[..4].copy_from_slice(&s);
            d16[..4].copy_from_slice(&d);
            (*p).saddr = s16;
            (*p).daddr = d16;
        } else {
            (*p).saddr = ctx.read_at::<[u8; 16]>(conf!(off.tcp_saddr_v6) as usize).unwrap_or([0; 16]);
            (*p).daddr = ctx.read_at::<[u8; 16]>(conf!(off.tcp_daddr_v6) as usize).unwrap_or([0; 16]);
        }
    }
    crate::submit(entry);
    0
}
