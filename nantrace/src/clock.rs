//! Kernel time (CLOCK_MONOTONIC, what `bpf_ktime_get_ns` returns) to wall time.
use serde::Serialize;
use time::{format_description::well_known::Rfc3339, OffsetDateTime};

fn clock_ns(id: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(id, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC) as u64
}

pub fn realtime_ns() -> i128 {
    clock_ns(libc::CLOCK_REALTIME)
}

/// REALTIME − MONOTONIC, sampled tightly (the smallest bracket of three tries). NTP moves
/// REALTIME, so callers re-sample periodically.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct ClockMap {
    pub offset_ns: i128,
    /// Width of the sampling bracket: the uncertainty of the mapping itself.
    pub error_ns: u64,
    pub sampled_at_mono_ns: u64,
}

impl ClockMap {
    pub fn sample() -> Self {
        let mut best = None::<(u64, i128, u64)>;
        for _ in 0..3 {
            let m1 = monotonic_ns();
            let r = realtime_ns();
            let m2 = monotonic_ns();
            let width = m2 - m1;
            let mid = m1 + width / 2;
            if best.is_none_or(|b| width < b.0) {
                best = Some((width, r - i128::from(mid), mid));
            }
        }
        let (error_ns, offset_ns, at) = best.unwrap_or((0, 0, 0));
        Self {
            offset_ns,
            error_ns,
            sampled_at_mono_ns: at,
        }
    }

    pub fn to_wall(&self, mono_ns: u64) -> i128 {
        i128::from(mono_ns) + self.offset_ns
    }
}

/// RFC 3339 UTC with all nine digits of nanoseconds, e.g. `2026-11-30T09:55:07.123456789Z`.
/// The date-time part is cached per second: a dump formats 100 k timestamps.
pub fn rfc3339(wall_ns: i128) -> String {
    thread_local! {
        static LAST: std::cell::RefCell<(i128, String)> = const { std::cell::RefCell::new((i128::MIN, String::new())) };
    }
    let secs = wall_ns.div_euclid(1_000_000_000);
    let nanos = wall_ns.rem_euclid(1_000_000_000);
    LAST.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != secs {
            let Ok(t) = OffsetDateTime::from_unix_timestamp_nanos(secs * 1_000_000_000) else {
                return wall_ns.to_string();
            };
            let full = t.format(&Rfc3339).unwrap_or_default();
            // `2026-11-30T09:55:07Z` without the zone, the fraction is ours.
            *c = (secs, full.trim_end_matches('Z').to_string());
        }
        format!("{}.{nanos:09}Z", c.1)
    })
}

/// Nanoseconds since the epoch of an RFC 3339 time; `None` when it is not one.
pub fn parse_rfc3339_ns(s: &str) -> Option<i128> {
    OffsetDateTime::parse(s, &Rfc3339)
        .ok()
        .map(OffsetDateTime::unix_timestamp_nanos)
}

/// `20261130T095507Z`, for directory names.
pub fn compact_utc(wall_ns: i128) -> String {
    let t =
        OffsetDateTime::from_unix_timestamp_nanos(wall_ns).unwrap_or(OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_puts_now_at_now() {
        let m = ClockMap::sample();
        let wall = m.to_wall(monotonic_ns());
        let diff = (wall - realtime_ns()).abs();
        assert!(
            diff < 50_000_000,
            "mapped monotonic now is {diff} ns off realtime"
        );
    }

    #[test]
    fn formats_rfc3339_with_nanoseconds() {
        assert_eq!(
            rfc3339(1_764_496_507_123_456_789),
            "2025-11-30T09:55:07.123456789Z"
        );
        assert_eq!(
            rfc3339(1_764_496_507_500_000_000),
            "2025-11-30T09:55:07.500000000Z"
        );
        assert_eq!(
            rfc3339(1_764_496_508_000_000_001),
            "2025-11-30T09:55:08.000000001Z"
        );
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999999999Z");
        // Parses back with the time crate.
        let t = OffsetDateTime::parse(&rfc3339(1_764_496_507_000_000_000), &Rfc3339).unwrap();
        assert_eq!(t.unix_timestamp(), 1_764_496_507);
        assert_eq!(compact_utc(1_764_496_507_123_456_789), "20251130T095507Z");
    }
}
