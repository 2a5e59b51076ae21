//! torch's collective watchdog lines, read for where each rank stood when a collective hung:
//! the collective it timed out in, the last one it enqueued and the last one it completed,
//! its process group, and what torch's own desync report said. One line gives one rank's
//! [`Progress`]; `report::hang` compares the ranks.
//!
//! The formats, as torch prints them (2.0 to 2.9; `ProcessGroupNCCL.cpp`, the newer
//! `<backend>` wordings too; tests/corpus holds real ones from public threads):
//! - `[rank2]:[E109 ...] [Rank 2] Watchdog caught collective operation timeout:
//!   WorkNCCL(SeqNum=493, OpType=ALLGATHER, NumelIn=1, NumelOut=4, Timeout(ms)=60000) ran for
//!   60044 milliseconds before timing out.`
//! - `[PG ID 0 PG GUID 0(default_pg) Rank 2]  failure detected by watchdog at work sequence id:
//!   493 PG status: last enqueued work: 493, last completed work: 492`
//! - `[PG 1 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 1580,
//!   last enqueued NCCL work: 1582, last completed NCCL work: 1579.`
//! - `[PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump signal due to a collective timeout
//!   from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41,
//!   last completed NCCL work: 41.`
//! - `TORCH_NCCL_DESYNC_DEBUG`'s report: `[1] joined but didn't finish collective #42`,
//!   `[3] finished collective #41, but didn't join collective #42`, `ranks [1] are the lagging
//!   ranks`.
//! - gloo's collective timeout (no counters: gloo has no watchdog), as torch 2.15 raises it on
//!   every rank that waited (tests/torch_job.rs, a real job): `[rank0]: RuntimeError:
//!   [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation
//!   to complete` (`send` on the other side of the ring).
//!
//! These are the job's own words (any process can print them): they locate a hang, they are
//! never machine evidence.
use std::sync::LazyLock;

use regex::Regex;

/// Where one rank stood, as one of its lines says. `None`: the line does not say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// The rank that printed it (its prefix `[rank3]:`, or torch's `[PG ... Rank 3]`).
    pub rank: Option<u32>,
    /// Its process group: torch's PG id (`0` is the default group).
    pub pg: Option<String>,
    /// The PG's name where torch prints one (`default_pg`).
    pub pg_name: Option<String>,
    /// The collective it timed out in (`SeqNum=`, `at work:`).
    pub waits_in: Option<i64>,
    pub op: Option<String>,
    pub numel: Option<(u64, u64)>,
    pub timeout_ms: Option<u64>,
    /// The last collective it enqueued and the last it completed (-1: none yet).
    pub enqueued: Option<i64>,
    pub completed: Option<i64>,
    /// The rank whose timeout made this one dump (`a collective timeout from rank R`).
    pub signalled_by: Option<u32>,
    /// torch's desync report: ranks that never joined collective `#n` (the CPU side) ...
    pub not_joined: Option<(Vec<u32>, i64)>,
    /// ... and ranks that joined it but did not finish it (the GPU, NCCL or link side).
    pub not_finished: Option<(Vec<u32>, i64)>,
    /// Ranks the report names as lagging, without saying which way.
    pub lagging: Vec<u32>,
    /// It timed out waiting in a collective the line does not number (gloo's timeout).
    pub timed_out: bool,
    /// The line's words that say it (its counters, else its collective), a short quote.
    pub quote: String,
}

/// At most this many characters are quoted.
const QUOTE_MAX: usize = 200;

/// The part of `line` that ends with the match at `start..end`: up to [`QUOTE_MAX`]
/// characters of it, cut at the front (`…`) where longer, control characters dropped.
fn quote(line: &str, start: usize, end: usize) -> String {
    let head: Vec<char> = line[..start].chars().collect();
    let body: String = line[start..end].chars().take(QUOTE_MAX).collect();
    let room = QUOTE_MAX.saturating_sub(body.chars().count());
    let lead: String = head[head.len().saturating_sub(room)..].iter().collect();
    let cut = if lead.chars().count() < head.len() {
        "…"
    } else {
        ""
    };
    format!("{cut}{lead}{body}")
        .chars()
        .filter(|c| !c.is_control())
        .collect::<String>()
        .trim()
        .to_string()
}

/// torch's own `[rankN]:` prefix, anywhere in the line's first 200 bytes (after a launcher's
/// `[default3]:`, srun's `1: `, a timestamp or a progress bar).
static TORCH_RANK: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\[rank(\d{1,7})\]:").unwrap());
/// A launcher's prefix: torchrun's `[defaultN]:` is the *local* rank, srun's `N: ` the task;
/// used only when torch named no rank.
static PREFIX_RANK: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:\[\d+\]\s*)?(?:\[default(\d{1,7})\]:|(\d{1,6}): |\[\d+,(\d{1,7})\]<std(?:out|err)>:)").unwrap()
});
/// `[PG ID 0 PG GUID 0(default_pg) Rank 2]`, `[PG 1 Rank 0]`, torch 2.3's `[PG 0 (default_pg) Rank 12]`.
static PG: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\[PG (?:ID )?(\d{1,9})(?: PG GUID [^\s(\]]{0,64})?(?: ?\(([^)\]]{0,64})\))? Rank (\d{1,7})\]")
        .unwrap()
});
static RANK_TAG: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\[Rank (\d+)\]").unwrap());
static WORK: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"Work\w{0,8}\(SeqNum=(\d+), OpType=([A-Za-z_]{1,32})(?:, NumelIn=(\d+), NumelOut=(\d+))?(?:, Timeout\(ms\)=(\d+))?").unwrap()
});
static ENQ: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)last enqueued (?:\w{1,8} )?work: (-?\d+), last completed (?:\w{1,8} )?work: (-?\d+)",
    )
    .unwrap()
});
static AT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)(?:detected by watchdog at work(?: sequence id)?|Timeout at \w{1,8} work): (\d+)",
    )
    .unwrap()
});
static FROM: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"collective timeout from rank (\d+)").unwrap());
static NOT_FINISHED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\[([\d, ]+)\] joined but didn't finish collective #(\d+)").unwrap()
});
static NOT_JOINED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\[([\d, ]+)\] (?:finished collective #\d+, but )?didn't join collective #(\d+)")
        .unwrap()
});
/// gloo's timeout inside a collective: `[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed
/// out waiting 10000ms for recv operation to complete`.
static GLOO: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i:gloo|transport/tcp)[^\n]{0,200}?Timed out waiting (\d{1,12}) ?ms for (?:recv|send) operation").unwrap()
});
/// gloo's transport when a peer of the collective went away: `[.../gloo/transport/tcp/
/// pair.cc:534] Connection closed by peer [10.0.0.2]:52178` (or reset). The rank that prints
/// it was alive and in a collective: waiting, not silent.
static GLOO_PEER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i:gloo|transport/tcp)[^\n]{0,200}?Connection (?:closed|reset) by peer").unwrap()
});
static LAGGING: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)ranks? \[?([\d, ]+?)\]? (?:is|are) the lagging ranks?").unwrap()
});

/// Ranks listed in torch's `[1, 3]` form, at most 1024 of them.
fn rank_list(s: &str) -> Vec<u32> {
    s.split(',')
        .filter_map(|r| r.trim().parse().ok())
        .take(1024)
        .collect()
}

fn num<T: std::str::FromStr>(c: &regex::Captures<'_>, i: usize) -> Option<T> {
    c.get(i).and_then(|m| m.as_str().parse().ok())
}

/// Where the rank that printed `line` stood, when it is a watchdog line that says any of it.
pub fn parse(line: &str) -> Option<Progress> {
    // Cheap refusals first: most lines are not these.
    if !(line.contains("Work")
        || line.contains("work")
        || line.contains("collective")
        || line.contains("lagging")
        || line.contains("Timed out waiting")
        || line.contains("by peer"))
    {
        return None;
    }
    let line = &*super::strip_ansi(line);
    let mut p = Progress::default();
    if let Some(c) = WORK.captures(line) {
        p.waits_in = num(&c, 1);
        p.op = c.get(2).map(|m| m.as_str().to_string());
        p.numel = num(&c, 3).zip(num(&c, 4));
        p.timeout_ms = num(&c, 5);
    }
    if let Some(c) = ENQ.captures(line) {
        p.enqueued = num(&c, 1);
        p.completed = num(&c, 2);
    }
    if let Some(c) = AT.captures(line) {
        p.waits_in = p.waits_in.or(num(&c, 1));
    }
    p.signalled_by = FROM.captures(line).and_then(|c| num(&c, 1));
    p.not_finished = NOT_FINISHED
        .captures(line)
        .and_then(|c| Some((rank_list(c.get(1)?.as_str()), num(&c, 2)?)));
    p.not_joined = NOT_JOINED
        .captures(line)
        .and_then(|c| Some((rank_list(c.get(1)?.as_str()), num(&c, 2)?)));
    if let Some(c) = LAGGING.captures(line) {
        p.lagging = c.get(1).map(|m| rank_list(m.as_str())).unwrap_or_default();
    }
    if let Some(c) = GLOO.captures(line) {
        p.timed_out = true;
        p.timeout_ms = p.timeout_ms.or(num(&c, 1));
    }
    // Counted as a rank that waited in the unnumbered collective (review of 2026-12-04: a
    // rank that printed only this was taken for a silent one).
    p.timed_out |= GLOO_PEER.is_match(line);
    // The quote ends with the words that carry the most: the counters, the report's ranks,
    // the collective.
    let key = [
        &*ENQ,
        &*NOT_FINISHED,
        &*NOT_JOINED,
        &*LAGGING,
        &*WORK,
        &*AT,
        &*GLOO,
        &*GLOO_PEER,
    ]
    .iter()
    .find_map(|re| re.find(line));
    if let Some(m) = key {
        p.quote = quote(line, m.start(), m.end());
    }
    if p.waits_in.is_none()
        && p.enqueued.is_none()
        && p.not_finished.is_none()
        && p.not_joined.is_none()
        && p.lagging.is_empty()
        && !p.timed_out
    {
        return None;
    }
    let pg = PG.captures(line);
    p.pg = pg
        .as_ref()
        .and_then(|c| c.get(1))
        .map(|m| m.as_str().to_string());
    p.pg_name = pg
        .as_ref()
        .and_then(|c| c.get(2))
        .map(|m| m.as_str().to_string());
    let head = &line[..line.floor_char_boundary(200)];
    p.rank = TORCH_RANK
        .captures(head)
        .and_then(|c| num(&c, 1))
        .or_else(|| pg.as_ref().and_then(|c| num(c, 3)))
        .or_else(|| RANK_TAG.captures(line).and_then(|c| num(&c, 1)))
        .or_else(|| {
            PREFIX_RANK
                .captures(line)
                .and_then(|c| (1..=3).find_map(|i| num(&c, i)))
        })
        // Ranks past a million are not a job's (bounded work downstream).
        .filter(|r| *r < 1 << 20);
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdogs_lines_say_where_a_rank_stood() {
        // tests/corpus/incidents/006.log (NVIDIA-NeMo/Automodel#1038).
        let a = parse("[rank2]:[E109 22:46:25.933527530 ProcessGroupNCCL.cpp:632] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=493, OpType=ALLGATHER, NumelIn=1, NumelOut=4, Timeout(ms)=60000) ran for 60044 milliseconds before timing out.").unwrap();
        assert_eq!(a.rank, Some(2));
        assert_eq!(a.waits_in, Some(493));
        assert_eq!(a.op.as_deref(), Some("ALLGATHER"));
        assert_eq!(a.numel, Some((1, 4)));
        assert_eq!(a.timeout_ms, Some(60_000));
        assert_eq!(a.enqueued, None);
        let b = parse("[rank2]:[E109 22:46:25.933593122 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank 2]  failure detected by watchdog at work sequence id: 493 PG status: last enqueued work: 493, last completed work: 492").unwrap();
        assert_eq!(
            (b.rank, b.pg.as_deref(), b.pg_name.as_deref()),
            (Some(2), Some("0"), Some("default_pg"))
        );
        assert_eq!(
            (b.waits_in, b.enqueued, b.completed),
            (Some(493), Some(493), Some(492))
        );
        // hiyouga/LlamaFactory#7396: a pid before the rank, the short PG form.
        let c = parse("[80748] [rank0]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.").unwrap();
        assert_eq!((c.rank, c.pg.as_deref()), (Some(0), Some("1")));
        assert_eq!(
            (c.waits_in, c.enqueued, c.completed),
            (Some(1580), Some(1582), Some(1579))
        );
        // The rank that was signalled names the rank that timed out: not its own rank.
        let d = parse("[rank1]:[E1202 04:54:03.1 ProcessGroupNCCL.cpp:1590] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL work: 41.This is most likely caused by incorrect usages of collectives").unwrap();
        assert_eq!((d.rank, d.signalled_by), (Some(1), Some(0)));
        assert_eq!((d.enqueued, d.completed), (Some(41), Some(41)));
        assert!(
            d.quote
                .ends_with("Last enqueued NCCL work: 41, last completed NCCL work: 41"),
            "{}",
            d.quote
        );
        assert!(
            d.quote.starts_with('…') && d.quote.chars().count() <= 201,
            "{}",
            d.quote
        );
        // torchrun's local-rank prefix before torch's global rank (tests/corpus/joblog.tsv),
        // and torch 2.3's PG tag.
        let g = parse("[default0]:[rank12]:[E817 12:00:00.1 ProcessGroupNCCL.cpp:1664] [PG 0 (default_pg) Rank 12] Exception (either an error or timeout) detected by watchdog at work: 9, last enqueued NCCL work: 9, last completed NCCL work: 8.").unwrap();
        assert_eq!(
            (g.rank, g.pg.as_deref(), g.pg_name.as_deref()),
            (Some(12), Some("0"), Some("default_pg"))
        );
        let h = parse("1: [rank5]:[E817 12:00:00.1 ProcessGroupNCCL.cpp:632] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600100 milliseconds before timing out.").unwrap();
        assert_eq!(h.rank, Some(5));
        assert_eq!(parse("[rank4000000000]:[PG 0 Rank 4000000000] Exception (either an error or timeout) detected by watchdog at work: 1, last enqueued NCCL work: 1, last completed NCCL work: 0.").and_then(|p| p.rank), None);
        // The newer backend-neutral wording.
        let e = parse("[PG ID 0 PG GUID 0(default_pg) Rank 3] Received a dump signal from this local rank and will start to dump the debug info. Last enqueued XCCL work: 7, last completed XCCL work: 6.").unwrap();
        assert_eq!(
            (e.rank, e.enqueued, e.completed),
            (Some(3), Some(7), Some(6))
        );
    }

    #[test]
    fn the_desync_report_names_ranks() {
        let a = parse("[rank0]: - [1, 3] joined but didn't finish collective #42 (count from 1)")
            .unwrap();
        assert_eq!(a.not_finished, Some((vec![1, 3], 42)));
        let b = parse("[rank0]: - [2] finished collective #41, but didn't join collective #42")
            .unwrap();
        assert_eq!(b.not_joined, Some((vec![2], 42)));
        let c = parse("Desync report: ranks [5] are the lagging ranks").unwrap();
        assert_eq!(c.lagging, vec![5]);
    }

    #[test]
    fn gloos_timeout_is_a_rank_that_waited_in_a_collective() {
        // torch 2.15 with gloo, a real job (tests/torch_job.rs), and torchtune#2676.
        for (l, rank, ms) in [
            ("[rank0]: collective 6 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete", 0, 10_000),
            ("[rank2]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete", 2, 1_800_000),
            ("[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 8000ms for send operation to complete", 2, 8_000),
        ] {
            let p = parse(l).unwrap_or_else(|| panic!("{l}"));
            assert_eq!((p.rank, p.timed_out, p.timeout_ms, p.waits_in), (Some(rank), true, Some(ms), None), "{l}");
            assert!(p.quote.contains("Timed out waiting"), "{}", p.quote);
        }
        // gloo's transport when a peer went away: alive, in a collective, not silent.
        let p = parse("[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.214.0.3]:52178").unwrap();
        assert_eq!((p.rank, p.timed_out, p.waits_in), (Some(2), true, None));
        assert!(p.quote.contains("Connection closed by peer"), "{}", p.quote);
        assert!(parse("[rank0]: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [10.0.0.1]:1234: Connection reset by peer").unwrap().timed_out);
        // Not gloo's: a plain socket error names no collective.
        assert_eq!(parse("requests.exceptions.ConnectionError: Connection reset by peer"), None);
        // A store or socket timeout is not a collective's.
        assert_eq!(parse("[rank1]: torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 2/4 clients joined."), None);
    }

    #[test]
    fn other_lines_are_not_progress() {
        for l in [
            "step 42 loss 1.234",
            "NCCL WARN Timeout waiting for work",
            "[rank0]: the collective work is done",
            "",
        ] {
            assert_eq!(parse(l), None, "{l}");
        }
    }
}
