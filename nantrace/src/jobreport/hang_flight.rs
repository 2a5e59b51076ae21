//! The Flight Recorder's side of a hang across nodes: which entries are of the hang's
//! process group (a watchdog line names a group by torch's local id, the dumps compare
//! groups by their GUID), and the collective the dumps that agree end in when the lines
//! name none.
use crate::report::flight::RankDump;

/// The hang's process group as a Flight Recorder entry names it: a watchdog line's `PG ID`
/// is torch's local id, an entry's `pg_id`; the dumps' own comparison names a group by its
/// GUID, an entry's `pg_name` (they differ once a job makes a group before another or names
/// one).
pub(super) enum PgKey<'a> {
    Id(&'a str),
    Name(&'a str),
}

impl PgKey<'_> {
    pub(super) fn is(&self, e: &crate::collect::flight::view::Entry) -> bool {
        match self {
            PgKey::Id(id) => e.pg_id.is_some_and(|i| i.to_string() == *id),
            PgKey::Name(n) => e.pg_name == *n,
        }
    }
}

/// A silence the lines give no collective number for, where the dumps that agree all end in
/// one collective of the hang's group: that collective (the dumps name the group by its
/// GUID, a hang of the lines by its id).
pub(super) fn silent_in_the_dumps_collective(
    hang: &mut crate::report::hang::Hang,
    from_flight: bool,
    dumps_at: Option<(i64, Option<String>, String)>,
    dumps: &[RankDump],
) {
    let (crate::report::hang::Kind::Silent, None, Some((n, op, pg))) =
        (hang.kind, hang.collective, dumps_at)
    else {
        return;
    };
    let id = dumps
        .iter()
        .flat_map(|d| &d.dump.entries)
        .find(|e| e.pg_name == pg);
    let same = if from_flight {
        pg == hang.pg
    } else {
        id.is_some_and(|e| PgKey::Id(&hang.pg).is(e))
    };
    if same {
        hang.collective = Some(n);
        hang.op = op;
        hang.detail = format!("{}; their Flight Recorder dumps end in it", hang.detail);
    }
}
