//! The ranks' Flight Recorder dumps read at the dump (`report::flight`): the rank that never
//! joined a collective the others entered, a collective of different sizes across ranks, the
//! ranks with no dump. The job's own records: a hang located, never machine evidence. Where
//! they name a rank, the job's socket timeouts and resets (gloo's `Timed out waiting ...
//! for recv`) are what that rank's stop did to its peers: consequences, not the network.
use serde_json::Value;

use super::{Acc, Ctx};
use crate::report::flight::{dumps, judge, Flight};
use crate::report::hang::Kind;
use crate::report::rules::signal;
use crate::report::Finding;

/// What this node's dumps say (its ranks only: another node's are in its bundle).
pub(crate) fn of(section: &Value) -> Option<Flight> {
    let (read, not) = dumps(section, None);
    judge(&read, &not, None)
}

/// The finding's sentence.
fn clause(f: &Flight) -> String {
    format!(
        "the job's Flight Recorder (torch's own record of its collectives, read at the dump): {}",
        f.hang(&|_| None).sentence(&|_| None)
    )
}

pub(super) fn detect(ctx: &Ctx<'_>, acc: &mut Acc) {
    let Some(f) = of(ctx.flight) else { return };
    // Dumps that agree and a rank without one: said only in a hang.
    if f.kind.is_none() && !ctx.hung {
        return;
    }
    acc.add(signal("flight_recorder_ranks"), &f.pg, 0.0, true, || {
        clause(&f)
    });
}

/// Where the dumps name the rank that stopped (or a mismatch), the job's own socket
/// timeouts and resets are its consequences; an IB or NCCL network failure is not.
pub(in crate::report) fn explains(ctx: &Ctx<'_>, suspects: &mut [Finding]) {
    let named =
        of(ctx.flight).is_some_and(|f| matches!(f.kind, Some(Kind::CpuSide | Kind::Mismatch)));
    if !named {
        return;
    }
    let network_lines = ctx
        .by_src
        .get("log")
        .into_iter()
        .flatten()
        .filter(|(_, e)| {
            e["fault"]["family"].as_str() == Some(crate::joblog::JobFamily::Network.as_str())
        });
    let sockets_only = network_lines
        .map(|(_, e)| e["fault"]["kind"].as_str())
        .all(|k| k == Some("socket_reset"));
    if !sockets_only {
        return;
    }
    for s in suspects
        .iter_mut()
        .filter(|s| matches!(s.signal, "joblog_network" | "joblog_network_generic"))
    {
        s.consequence = true;
    }
}
