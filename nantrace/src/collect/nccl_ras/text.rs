//! NCCL RAS's text output (`VERBOSE STATUS`), read into a [`View`]. Written from the format
//! strings of `rasClientRunInit`, `rasClientRunComms` and `rasClientBreakDownErrors` in
//! src/ras/client_support.cc of NVIDIA/nccl v2.30.7-1 (73cf1122; the same strings from 2.26
//! on), and of v2.24.3-1 (6aae3792; 2.24 and 2.25): `UNKNOWN` for `NOCOMM`, `The missing
//! ranks: 1,2` and `The unknown ranks: ...` without processes, `different collective operation
//! counts` without the operation's name, `(%.2fs)`. Not yet checked on a real NCCL's output.
//!
//! The layout: a header (version, CUDA versions), `Job summary` (a table), `Communicators...
//! (0.012s)` with a table of communicator groups, then `Errors` (`INCOMPLETE` and `DEAD`
//! processes; per communicator `#<group>-<index> (<hash>) INCOMPLETE` and `ERROR`) and
//! `Warnings` (`TIMEOUT`; per communicator `MISMATCH`). A rank is printed with its GPU,
//! process and node only when its group is an outlier (`rasCountIsOutlier`: verbose, under half
//! the communicator), so a count without ranks is kept as a count.
use std::sync::LazyLock;

use regex::Regex;

use super::view::{
    host, word, Comm, Format, Kind, ProcessIssue, RankIssue, View, Why, PROCESSES_MAX,
};

/// A line longer than this is cut before it is read (NCCL's lines are short).
const LINE_MAX: usize = 4096;

macro_rules! re {
    ($name:ident, $pat:expr) => {
        static $name: LazyLock<Regex> = LazyLock::new(|| Regex::new($pat).unwrap());
    };
}

re!(VERSION, r"^NCCL version (\S+) compiled with CUDA (\S+)$");
re!(
    CUDA,
    r"^CUDA runtime version (-?\d+), driver version (-?\d+)$"
);
re!(NUMBERS, r"^\s*\d+(?:\s+\d+)*\s*$");
re!(COLLECTED, r"\.\.\. \((\d+(?:\.\d+)?)s\)$");
re!(
    GROUP,
    r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$"
);
re!(
    COMM,
    r"^#(\d+)-(\d+) \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)$"
);
re!(
    PROCESS,
    r"^  Process (\d+) on node (\S*) managing GPUs? (.+)$"
);
re!(
    MISSING_PROCS,
    r"^  Missing communicator data from (\d+) job process(?:es)?$"
);
re!(
    DEAD_PROCS,
    r"^  (\d+) job process(?:es are| is) considered dead"
);
re!(
    TIMEOUTS,
    r"^  Encountered (\d+) communication timeouts? while gathering"
);
re!(
    MISSING_RANKS,
    r"^  Missing communicator data from (\d+) ranks?$"
);
re!(RANK_LIST, r"^  The (missing|unknown) ranks?: ([\d,]*)$");
re!(RANK_LIST_STATUS, r"^  Rank ([\d,]+) has status (\S+)$");
re!(
    RANK,
    r"^  Rank (\d+)(?: (?:has launched up to operation (\d+)|(has not launched any operations)|has status (\S+)|reported (.+?)))? -- (?:GPU (\d+)(?: \(NVML (\d+)\))? managed by process (\d+) on node (\S*)|\[process information not found\])$"
);
re!(
    GROUP_OPS,
    r"^  (\d+) ranks have (?:launched up to operation (\d+)|(not launched any operations))$"
);
re!(GROUP_STATUS, r"^  (\d+) ranks have status (\S+)$");
re!(GROUP_ERROR, r"^  (\d+) ranks reported (.+)$");
re!(
    DIFF_OPS,
    r"^  Communicator ranks have different (?:(\S+) )?operation counts$"
);
re!(
    PHASE,
    r"^  (Initialization|Asynchronous) errors? on \d+ ranks?$"
);

/// What the rank lines under the current heading are about.
#[derive(Clone, Debug, Default)]
enum Sub {
    #[default]
    None,
    /// A communicator's missing ranks.
    Missing,
    /// `different status`: the value of the current group, every group's (value, count).
    Status(Option<String>, Vec<(String, u32)>),
    /// `different <op> operation counts`.
    Ops(Option<String>, Option<u64>, Vec<(u64, u32)>),
    /// `Initialization errors` / `Asynchronous errors`, the current group's error.
    Error(String, Option<String>),
}

/// Where the reader stands.
#[derive(Default)]
struct State {
    /// In the table of communicator groups: their (ranks per comm, status) by group number.
    in_groups: bool,
    groups: Vec<(u32, String)>,
    /// The job summary's header (the next line of numbers belongs to it).
    summary_header: Option<String>,
    /// The block: a job-level section (`INCOMPLETE`, `DEAD`, `TIMEOUT`) or a communicator's.
    block: Option<Kind>,
    comm: Option<Comm>,
    sub: Sub,
    /// Rank issues of the current sub-heading, before the majority is known.
    pending: Vec<RankIssue>,
}

fn n<T: std::str::FromStr>(s: Option<regex::Match<'_>>) -> Option<T> {
    s.and_then(|m| m.as_str().parse().ok())
}

/// The job summary's numbers, by the header above them.
fn summary(view: &mut View, header: &str, line: &str) {
    let v: Vec<u32> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if header.contains("per node  per process    (total)") && v.len() == 5 {
        (view.nodes, view.processes, view.gpus) = (Some(v[0]), Some(v[3]), Some(v[4]));
    } else if header.starts_with("(total)    (total)") && v.len() == 3 {
        (view.nodes, view.processes, view.gpus) = (Some(v[0]), Some(v[1]), Some(v[2]));
    }
}

/// A `Rank ...` line's issue under the current sub-heading.
fn rank_line(st: &State, c: &regex::Captures<'_>) -> Option<RankIssue> {
    let (kind, why) = if let Some(l) = n::<u64>(c.get(2)) {
        (
            Kind::Mismatch,
            Why::Ops {
                op: None,
                launched: l,
                most: None,
            },
        )
    } else if c.get(3).is_some() {
        (
            Kind::Mismatch,
            Why::Ops {
                op: None,
                launched: 0,
                most: None,
            },
        )
    } else if let Some(s) = c.get(4) {
        (Kind::Mismatch, status_why(s.as_str()))
    } else if let Some(e) = c.get(5) {
        let phase = match &st.sub {
            Sub::Error(p, _) => p.clone(),
            _ => "?".into(),
        };
        (
            Kind::Error,
            Why::Error {
                phase,
                error: word(e.as_str(), 64),
            },
        )
    } else {
        // A member of a group whose heading said what the group has.
        match &st.sub {
            Sub::Missing => (Kind::Incomplete, Why::NoAnswer),
            Sub::Status(Some(s), _) => (Kind::Mismatch, status_why(s)),
            Sub::Ops(_, Some(l), _) => (
                Kind::Mismatch,
                Why::Ops {
                    op: None,
                    launched: *l,
                    most: None,
                },
            ),
            Sub::Error(p, Some(e)) => (
                Kind::Error,
                Why::Error {
                    phase: p.clone(),
                    error: e.clone(),
                },
            ),
            _ => return None,
        }
    };
    Some(RankIssue {
        rank: n(c.get(1))?,
        kind,
        why,
        host: c.get(9).map(|h| host(h.as_str())),
        pid: n(c.get(8)),
        cuda_dev: n(c.get(6)),
        nvml_dev: n(c.get(7)).or(n(c.get(6))),
    })
}

fn status_why(s: &str) -> Why {
    match s {
        "NOCOMM" | "UNKNOWN" => Why::NotMember,
        s => Why::Status {
            status: word(s, 16),
            most: None,
        },
    }
}

/// The sub-heading's ranks, now that every group of it is known: the most frequent value is
/// what the others differ from.
fn flush(st: &mut State) {
    let sub = std::mem::take(&mut st.sub);
    let pending = std::mem::take(&mut st.pending);
    let Some(comm) = st.comm.as_mut() else { return };
    let (most_status, most_ops, op) = match &sub {
        Sub::Status(_, g) => (top(g).cloned(), None, None),
        Sub::Ops(op, _, g) => (None, top(g).copied(), op.clone()),
        _ => (None, None, None),
    };
    for mut r in pending {
        match &mut r.why {
            Why::Status { most, .. } => most.clone_from(&most_status),
            Why::Ops { op: o, most, .. } => {
                o.clone_from(&op);
                *most = most_ops;
            }
            _ => {}
        }
        comm.push(r);
    }
}

/// The value most ranks share (the first listed of the largest groups: NCCL sorts them so).
fn top<T>(groups: &[(T, u32)]) -> Option<&T> {
    let max = groups.iter().map(|g| g.1).max()?;
    groups.iter().find(|g| g.1 == max).map(|g| &g.0)
}

fn end_block(st: &mut State, view: &mut View) {
    flush(st);
    if let Some(mut c) = st.comm.take() {
        // The same communicator under Errors and again under Warnings: one entry.
        match view
            .comms
            .iter_mut()
            .find(|x| x.id == c.id && x.hash == c.hash)
        {
            Some(x) => {
                x.errors.append(&mut c.errors);
                x.missing_ranks = x.missing_ranks.or(c.missing_ranks);
                x.ranks_not_listed += c.ranks_not_listed;
                for r in c.ranks {
                    x.push(r);
                }
            }
            None => view.push_comm(c),
        }
    }
    st.block = None;
}

/// A line inside a job-level block or a communicator's.
fn block_line(st: &mut State, view: &mut View, l: &str) {
    if let Some(c) = PROCESS.captures(l) {
        if let (Some(kind), Some(pid)) = (st.block, n(c.get(1))) {
            if view.processes_listed.len() < PROCESSES_MAX {
                let gpus = word(&c[3], 64);
                view.processes_listed.push(ProcessIssue {
                    kind,
                    pid,
                    host: host(&c[2]),
                    gpus,
                });
            }
        }
    } else if let Some(c) = MISSING_PROCS.captures(l) {
        view.missing_processes = n(c.get(1));
    } else if let Some(c) = DEAD_PROCS.captures(l) {
        view.dead_processes = n(c.get(1));
    } else if let Some(c) = TIMEOUTS.captures(l) {
        view.timeouts = n(c.get(1));
    } else if let Some(c) = MISSING_RANKS.captures(l) {
        flush(st);
        st.sub = Sub::Missing;
        if let Some(comm) = st.comm.as_mut() {
            comm.missing_ranks = n(c.get(1));
        }
    } else if let Some((list, kind, why)) = rank_list(l) {
        // NCCL 2.24/2.25: rank numbers only.
        for r in list
            .split(',')
            .filter_map(|x| x.parse().ok())
            .take(super::view::RANKS_MAX)
        {
            let why = why.clone();
            st.pending.push(RankIssue {
                rank: r,
                kind,
                why,
                host: None,
                pid: None,
                cuda_dev: None,
                nvml_dev: None,
            });
        }
    } else if l == "  Communicator ranks have different status" {
        flush(st);
        st.sub = Sub::Status(None, Vec::new());
    } else if let Some(c) = DIFF_OPS.captures(l) {
        flush(st);
        let op = c
            .get(1)
            .map(|o| word(o.as_str(), 32))
            .filter(|o| o != "collective");
        st.sub = Sub::Ops(op, None, Vec::new());
    } else if let Some(c) = PHASE.captures(l) {
        flush(st);
        let phase = if &c[1] == "Initialization" {
            "initialization"
        } else {
            "asynchronous"
        };
        st.sub = Sub::Error(phase.into(), None);
    } else {
        group_or_rank(st, l);
    }
}

/// NCCL 2.24/2.25's lists of rank numbers: `The missing ranks: 21,22`, `The unknown ranks:
/// ...`, `Rank 3,4 has status UNKNOWN`.
fn rank_list(l: &str) -> Option<(String, Kind, Why)> {
    if let Some(c) = RANK_LIST.captures(l) {
        let (kind, why) = if &c[1] == "missing" {
            (Kind::Incomplete, Why::NoAnswer)
        } else {
            (Kind::Mismatch, Why::NotMember)
        };
        return Some((c[2].to_string(), kind, why));
    }
    let c = RANK_LIST_STATUS.captures(l)?;
    Some((c[1].to_string(), Kind::Mismatch, status_why(&c[2])))
}

/// A group heading (`26 ranks have ...`) or a rank of it.
fn group_or_rank(st: &mut State, l: &str) {
    if let Some(c) = GROUP_STATUS.captures(l) {
        if let Sub::Status(cur, g) = &mut st.sub {
            *cur = Some(word(&c[2], 16));
            g.push((word(&c[2], 16), n(c.get(1)).unwrap_or(0)));
        }
    } else if let Some(c) = GROUP_OPS.captures(l) {
        if let Sub::Ops(_, cur, g) = &mut st.sub {
            let v = n(c.get(2)).unwrap_or(0);
            *cur = Some(v);
            g.push((v, n(c.get(1)).unwrap_or(0)));
        }
    } else if let Some(c) = GROUP_ERROR.captures(l) {
        if let Sub::Error(_, cur) = &mut st.sub {
            *cur = Some(word(&c[2], 64));
        }
    } else if let Some(c) = RANK.captures(l) {
        // A rank alone in its group is a group of one.
        match (&mut st.sub, c.get(2), c.get(3), c.get(4)) {
            (Sub::Ops(_, _, g), Some(v), _, _) => g.push((v.as_str().parse().unwrap_or(0), 1)),
            (Sub::Ops(_, _, g), None, Some(_), _) => g.push((0, 1)),
            (Sub::Status(_, g), _, _, Some(s)) => g.push((word(s.as_str(), 16), 1)),
            _ => {}
        }
        if let Some(r) = rank_line(st, &c) {
            st.pending.push(r);
        }
    }
}

/// The text output, as far as it goes (a cut output gives what it holds).
pub fn from_text(s: &str) -> View {
    let mut view = View::empty(Format::Text);
    let mut st = State::default();
    for raw in s.lines() {
        let l: &str = match raw.char_indices().nth(LINE_MAX) {
            Some((i, _)) => &raw[..i],
            None => raw,
        };
        let l = l.trim_end_matches('\r');
        if let Some(c) = VERSION.captures(l) {
            view.nccl_version = Some(word(&c[1], 64));
        } else if let Some(c) = CUDA.captures(l) {
            view.cuda_runtime_version = n(c.get(1));
            view.cuda_driver_version = n(c.get(2));
        } else if l.starts_with("(total)") || l.starts_with("          per node") {
            st.summary_header = Some(l.to_string());
        } else if st.summary_header.is_some() && NUMBERS.is_match(l) && !st.in_groups {
            summary(&mut view, st.summary_header.as_deref().unwrap_or(""), l);
        } else if l.contains("Communicators...") || l.contains("NCCL communicators") {
            st.summary_header = None;
            view.collection_s = COLLECTED.captures(l).and_then(|c| c[1].parse().ok());
        } else if l.starts_with("Group     Comms") {
            st.in_groups = true;
        } else if st.in_groups && l.trim().is_empty() {
            st.in_groups = false;
        } else if let Some(c) = GROUP.captures(l).filter(|_| st.in_groups) {
            let comms: u32 = n(c.get(2)).unwrap_or(0);
            let ranks: u32 = n(c.get(6)).unwrap_or(0);
            view.communicators = Some(view.communicators.unwrap_or(0).saturating_add(comms));
            view.ranks = Some(view.ranks.unwrap_or(0).saturating_add(ranks));
            st.groups.push((n(c.get(5)).unwrap_or(0), word(&c[7], 16)));
        } else if let Some(c) = COMM.captures(l) {
            end_block(&mut st, &mut view);
            let g: usize = n(c.get(1)).unwrap_or(usize::MAX);
            st.comm = Some(Comm {
                id: Some(format!("#{}-{}", &c[1], &c[2])),
                hash: super::view::hash(&c[3]),
                size: st.groups.get(g).map(|x| x.0),
                status: st.groups.get(g).map(|x| x.1.clone()),
                errors: vec![c[4].to_string()],
                ..Comm::default()
            });
            st.block = None;
        } else if matches!(l, "INCOMPLETE" | "DEAD" | "TIMEOUT") {
            end_block(&mut st, &mut view);
            st.block = match l {
                "INCOMPLETE" => Some(Kind::Incomplete),
                "DEAD" => Some(Kind::Dead),
                _ => None,
            };
        } else if matches!(l, "Errors" | "Warnings") {
            end_block(&mut st, &mut view);
        } else if l.starts_with("  ") {
            block_line(&mut st, &mut view, l);
        }
    }
    end_block(&mut st, &mut view);
    view.mark_dead();
    view
}
