//! The detectors, one file per evidence family. Each evaluates its rows of the signal table
//! (`super::rules`) over the incident window and adds what fired to the suspects.
mod flight;
pub(super) use flight::explains as flight_explains;
pub(crate) use flight::of as flight_of;
mod gpu;
mod gpumem;
mod host;
mod joblog;
pub(crate) use joblog::excerpt;
mod memory;
mod network;
pub(crate) use network::loopback;
mod numerics;
mod pcie;
mod process;
mod ras;
pub(crate) use ras::{clause as ras_clause, view as ras_view};
mod stacks;
pub(crate) use stacks::{node_rank_groups, rank_groups_by, rank_pgs, rank_state};
#[cfg(test)]
pub(crate) use stacks::{PG_FROM_BOTH, PG_FROM_WATCHDOG};
mod storage;

use serde_json::Value;

use super::{Acc, Ctx};
use crate::source::Source;

/// Kernel log lines (every class) and the AER tracepoint, before the reference.
fn kernel_events<'a>(ctx: &'a Ctx<'_>) -> Vec<(f64, &'a Value)> {
    [Source::Kmsg, Source::Xid, Source::Aer]
        .into_iter()
        .flat_map(|s| ctx.src(s))
        .map(|(r, e)| (*r, *e))
        .collect()
}

/// Every detector, in an order where later ones may read what earlier ones found (NVML's Xid
/// events after the kernel's lines, the job's own lines after everything they corroborate).
pub(super) fn all(ctx: &Ctx<'_>, acc: &mut Acc) {
    gpu::detect(ctx, acc);
    pcie::detect(ctx, acc);
    memory::detect(ctx, acc);
    host::detect(ctx, acc);
    storage::detect(ctx, acc);
    network::detect(ctx, acc);
    process::detect(ctx, acc);
    stacks::detect(ctx, acc);
    ras::detect(ctx, acc);
    flight::detect(ctx, acc);
    numerics::detect(ctx, acc);
    joblog::detect(ctx, acc, f64::INFINITY);
}
