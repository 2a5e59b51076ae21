//! The lanes of job-report.html: one per node on the job's clock (seconds from its
//! reference), each node's trigger and evidence as marks, the named node highlighted. Every
//! node is drawn up to [`LANES_MAX`]; past it the named node, the nodes with evidence and the
//! named node's neighbours, and the page says how many are not drawn. For a hang, each node's
//! ranks are drawn under it on the same clock (`ranks.rs`).
use std::collections::{BTreeSet, HashMap, HashSet};

use serde_json::Value;

use super::ranks::{RankLane, Ranks};
use super::{cut, esc};
use crate::jobreport::JobReport;

/// Nodes drawn at most (a lane each).
pub const LANES_MAX: usize = 32;
/// Marks drawn in one lane at most, after one per kind per pixel column.
const MARKS_MAX: usize = 400;
/// A time further than this from the reference is drawn at this distance (a hostile or
/// broken bundle's offsets of 1e300 s keep the axis finite).
const SPAN_MAX: f64 = 1e7;
pub(super) const W: f64 = 1100.0;
pub(super) const LEFT: f64 = 190.0;
pub(super) const RIGHT: f64 = 20.0;
const LANE_H: f64 = 24.0;
const TOP: f64 = 34.0;

/// What an event is on a lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Kind {
    Gpu,
    Pcie,
    Kernel,
    Oom,
    Block,
    Net,
    Failure,
    Hang,
    Nan,
    Trigger,
}

impl Kind {
    pub(super) const ALL: [Kind; 10] = [
        Kind::Gpu,
        Kind::Pcie,
        Kind::Kernel,
        Kind::Oom,
        Kind::Block,
        Kind::Net,
        Kind::Failure,
        Kind::Hang,
        Kind::Nan,
        Kind::Trigger,
    ];

    pub(super) fn class(self) -> &'static str {
        match self {
            Kind::Gpu => "k-gpu",
            Kind::Pcie => "k-pcie",
            Kind::Kernel => "k-kernel",
            Kind::Oom => "k-oom",
            Kind::Block => "k-block",
            Kind::Net => "k-net",
            Kind::Failure => "k-fail",
            Kind::Hang => "k-hang",
            Kind::Nan => "k-nan",
            Kind::Trigger => "k-trigger",
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Kind::Gpu => "GPU / Xid",
            Kind::Pcie => "PCIe AER",
            Kind::Kernel => "kernel error",
            Kind::Oom => "OOM kill",
            Kind::Block => "block I/O error",
            Kind::Net => "TCP retransmit",
            Kind::Failure => "the job's failure line",
            Kind::Hang => "the job's watchdog / hang line",
            Kind::Nan => "the node's first NaN",
            Kind::Trigger => "the node's trigger",
        }
    }

    pub(super) fn colour(self) -> &'static str {
        match self {
            Kind::Gpu => "#c0392b",
            Kind::Pcie => "#e67e22",
            Kind::Kernel => "#a04000",
            Kind::Oom => "#c2185b",
            Kind::Block => "#6e2c00",
            Kind::Net => "#17a589",
            Kind::Failure => "#2e86c1",
            Kind::Hang => "#d4ac0d",
            Kind::Nan => "#000000",
            Kind::Trigger => "#8e44ad",
        }
    }

    /// The kernel's or the hardware's own evidence (not the job's words, not a trigger).
    fn kernel(self) -> bool {
        matches!(
            self,
            Kind::Gpu | Kind::Pcie | Kind::Kernel | Kind::Oom | Kind::Block | Kind::Net
        )
    }

    /// What an event is as a mark, if it is one.
    fn of(e: &Value) -> Option<Kind> {
        Some(match e["source"].as_str()? {
            "xid" | "nvml_xid" => Kind::Gpu,
            "aer" => Kind::Pcie,
            "kmsg" if matches!(e["severity"].as_str(), Some("critical" | "error")) => Kind::Kernel,
            "oom" => Kind::Oom,
            "block" if e["error"].as_i64().is_some_and(|x| x != 0) => Kind::Block,
            "tcp_retransmit" if !loopback(e) => Kind::Net,
            "log" if e["nonfinite"] == true => Kind::Nan,
            "log" if e["fault"]["family"] == "hang" => Kind::Hang,
            "log" if e["fault"].is_object() => Kind::Failure,
            "trigger" => Kind::Trigger,
            _ => return None,
        })
    }
}

fn loopback(e: &Value) -> bool {
    let d = e["daddr"].as_str().unwrap_or("");
    d.starts_with("127.") || d == "::1" || d.starts_with("::ffff:127.")
}

struct Mark<'a> {
    t: f64,
    kind: Kind,
    e: &'a Value,
}

/// Each node's marks (in the report's node order), seconds from the reference `zero`, in
/// one pass over the merged timeline; a node's first NaN only.
fn marks<'a>(r: &JobReport, merged: &'a Value, zero: f64) -> Vec<Vec<Mark<'a>>> {
    let index: HashMap<&str, usize> = r
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let mut out: Vec<Vec<Mark>> = (0..r.nodes.len()).map(|_| Vec::new()).collect();
    let mut nan_seen = vec![false; r.nodes.len()];
    for e in merged["events"].as_array().into_iter().flatten() {
        let Some(kind) = Kind::of(e) else { continue };
        let Some(&i) = e["node"].as_str().and_then(|n| index.get(n)) else {
            continue;
        };
        let Some(t) = e["offset_s"].as_f64().map(|t| t - zero) else {
            continue;
        };
        if t.is_nan() || (kind == Kind::Nan && std::mem::replace(&mut nan_seen[i], true)) {
            continue;
        }
        out[i].push(Mark {
            t: t.clamp(-SPAN_MAX, SPAN_MAX),
            kind,
            e,
        });
    }
    out
}

/// The nodes drawn, in the report's order: all of them up to [`LANES_MAX`]; past it, by
/// priority: the named node, nodes with the kernel's evidence (most first), nodes the report
/// names otherwise (`named`: an outlier, a hung rank's node, the first failure's, the first
/// NaN's), nodes with the job's failure lines, the named node's neighbours.
fn chosen(r: &JobReport, marks: &[Vec<Mark>], named: &BTreeSet<&str>) -> Vec<usize> {
    let n = r.nodes.len();
    if n <= LANES_MAX {
        return (0..n).collect();
    }
    let centre = r
        .nodes
        .iter()
        .position(|x| Some(&x.name) == r.node.as_ref())
        .or_else(|| r.nodes.iter().position(|x| named.contains(x.name.as_str())));
    let mut keyed: Vec<(u8, std::cmp::Reverse<usize>, usize)> = (0..n)
        .map(|i| {
            let kernel = marks[i].iter().filter(|m| m.kind.kernel()).count();
            let words = marks[i]
                .iter()
                .any(|m| matches!(m.kind, Kind::Failure | Kind::Hang | Kind::Nan));
            let prio = if Some(&r.nodes[i].name) == r.node.as_ref() {
                0
            } else if kernel > 0 {
                1
            } else if named.contains(r.nodes[i].name.as_str()) {
                2
            } else if words {
                3
            } else if centre.is_some_and(|c| c.abs_diff(i) <= 2) {
                4
            } else {
                5
            };
            (prio, std::cmp::Reverse(kernel), i)
        })
        .collect();
    keyed.sort_unstable();
    let mut drawn: Vec<usize> = keyed.iter().take(LANES_MAX).map(|k| k.2).collect();
    drawn.sort_unstable();
    drawn
}

/// Where a time falls on the page.
pub(super) struct Axis {
    pub(super) lo: f64,
    pub(super) hi: f64,
}

impl Axis {
    pub(super) fn x(&self, t: f64) -> f64 {
        LEFT + (t - self.lo) / (self.hi - self.lo).max(1e-9) * (W - LEFT - RIGHT)
    }
}

/// Around the reference, the lanes are drawn again when the whole span is longer than twice
/// this (seconds before, after): an Xid seconds before a NaN stays readable beside a window of
/// minutes.
const ZOOM: (f64, f64) = (-20.0, 10.0);

/// What the lanes drew: the SVG (and, for a long span, the same lanes around the reference),
/// the sentence on the nodes drawn, the nodes drawn (indices in the report's order), and for a
/// hang the sentence on its ranks drawn.
pub(super) struct Drawn {
    pub(super) svg: String,
    pub(super) note: String,
    pub(super) drawn: Vec<usize>,
    pub(super) ranks_note: Option<String>,
}

/// The lanes. `named`: nodes the report names besides its verdict's; `zero`: the reference's
/// offset on the merged clock, and its name; `ranks`: a hang's ranks, each drawn under its
/// node.
pub(super) fn svg(
    r: &JobReport,
    merged: &Value,
    named: &BTreeSet<&str>,
    (zero, zero_name): (f64, &str),
    ranks: Option<&Ranks>,
) -> Drawn {
    let marks = marks(r, merged, zero);
    let drawn = chosen(r, &marks, named);
    let names: Vec<&str> = drawn.iter().map(|i| r.nodes[*i].name.as_str()).collect();
    let (rank_lanes, ranks_note) = match ranks {
        Some(k) => {
            let (lanes, note) = k.chosen(&names);
            (lanes, Some(note))
        }
        None => (Vec::new(), None),
    };
    let times = drawn
        .iter()
        .flat_map(|i| marks[*i].iter().map(|m| m.t))
        .chain(rank_lanes.iter().flat_map(|l| l.times()));
    let (lo, hi) = times.fold((0.0f64, 0.0f64), |(a, b), t| (a.min(t), b.max(t)));
    let pad = ((hi - lo) * 0.02).max(0.5);
    let ax = Axis {
        lo: lo - pad,
        hi: hi + pad,
    };
    let d = Drawing {
        r,
        marks: &marks,
        rows: layout(&drawn, &names, &rank_lanes),
        lagging: super::lagging_by_node(r),
        zero_name,
    };
    let mut s = d.draw("lanes", &ax);
    if ax.hi - ax.lo > 2.0 * (ZOOM.1 - ZOOM.0) {
        let zoom = Axis {
            lo: ZOOM.0.max(ax.lo),
            hi: ZOOM.1.min(ax.hi),
        };
        s.push_str(&format!(
            "\n<p class=\"note\">The same lanes from {:+.0} s to {:+.0} s around the reference:</p>\n{}",
            zoom.lo,
            zoom.hi,
            d.draw("lanes-zoom", &zoom)
        ));
    }
    let not_drawn = r.nodes.len() - drawn.len();
    let note = if not_drawn == 0 {
        format!("Every node with a bundle drawn ({}).", r.nodes.len())
    } else {
        let with_evidence = (0..r.nodes.len())
            .filter(|i| drawn.binary_search(i).is_err())
            .filter(|i| marks[*i].iter().any(|m| m.kind != Kind::Trigger))
            .count();
        format!(
            "{} of {} nodes drawn: the named node, the nodes with evidence and the named node's neighbours; {not_drawn} not drawn ({with_evidence} of them with evidence of their own: their bundles, or the peers' table below).",
            drawn.len(),
            r.nodes.len()
        )
    };
    Drawn {
        svg: s,
        note,
        drawn,
        ranks_note,
    }
}

/// A lane: a node (its index in the report's order, its place among the nodes drawn), or
/// one of a hang's ranks.
enum Row<'a> {
    Node(usize, usize),
    Rank(&'a RankLane),
}

/// Where each lane is drawn (its top): each node drawn, its ranks under it; ranks on no node
/// drawn (their node unknown) last.
fn layout<'a>(drawn: &[usize], names: &[&str], ranks: &[&'a RankLane]) -> Vec<(f64, Row<'a>)> {
    let mut rows = Vec::with_capacity(drawn.len() + ranks.len());
    let mut y = TOP;
    let under = |rows: &mut Vec<(f64, Row<'a>)>, y: &mut f64, node: Option<&str>| {
        for l in ranks.iter().filter(|l| l.node.as_deref() == node) {
            rows.push((*y, Row::Rank(l)));
            *y += l.height();
        }
    };
    for (k, (&i, name)) in drawn.iter().zip(names).enumerate() {
        rows.push((y, Row::Node(i, k)));
        y += LANE_H;
        under(&mut rows, &mut y, Some(name));
    }
    under(&mut rows, &mut y, None);
    rows
}

/// What one drawing of the lanes needs.
struct Drawing<'a, 'm> {
    r: &'a JobReport,
    marks: &'a [Vec<Mark<'m>>],
    rows: Vec<(f64, Row<'a>)>,
    lagging: HashMap<&'a str, Vec<u32>>,
    zero_name: &'a str,
}

impl Drawing<'_, '_> {
    /// The lanes on axis `ax`, as the SVG element `id`.
    fn draw(&self, id: &str, ax: &Axis) -> String {
        let r = self.r;
        let bottom = self.rows.last().map_or(TOP, |(y, row)| match row {
            Row::Node(..) => y + LANE_H,
            Row::Rank(l) => y + l.height(),
        });
        let height = bottom + 30.0;
        let what = if self.rows.iter().any(|x| matches!(x.1, Row::Rank(_))) {
            "one lane per node and, under each, one per rank, on the job's clock"
        } else {
            "one lane per node on the job's clock"
        };
        let mut s = format!(
            r#"<svg id="{id}" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" role="img" aria-label="{what}">"#
        );
        for (y, row) in &self.rows {
            match row {
                Row::Node(i, k) => {
                    let name = r.nodes[*i].name.as_str();
                    lane(&mut s, r, *i, (*y, *k), self.lagging.get(name));
                }
                Row::Rank(l) => l.band(&mut s, *y),
            }
        }
        ticks(&mut s, ax, height);
        let x0 = ax.x(0.0);
        s.push_str(&format!(
            r##"<line x1="{x0:.1}" y1="{}" x2="{x0:.1}" y2="{}" stroke="#c0392b" stroke-width="2"/><text x="{x0:.1}" y="16" class="zero">{}</text>"##,
            TOP - 8.0,
            height - 22.0,
            esc(self.zero_name)
        ));
        for (y, row) in &self.rows {
            match row {
                Row::Node(i, _) => lane_marks(&mut s, ax, *y, &r.nodes[*i].name, &self.marks[*i]),
                Row::Rank(l) => l.marks(&mut s, ax, *y),
            }
        }
        s.push_str("</svg>");
        s
    }
}

/// One lane's band and label (its top `y`, its place `k` among the nodes drawn): the named
/// node highlighted, a node with a hung rank marked.
fn lane(s: &mut String, r: &JobReport, i: usize, (y, k): (f64, usize), lagging: Option<&Vec<u32>>) {
    let n = &r.nodes[i];
    let named = Some(&n.name) == r.node.as_ref();
    let fill = if named {
        "#fadbd8"
    } else if k.is_multiple_of(2) {
        "#f4f6f7"
    } else {
        "#fbfcfc"
    };
    let mut label = cut(&n.name, 24);
    if let Some(l) = lagging {
        label.push_str(&format!(
            " · rank {}",
            esc(&crate::report::hang::rank_list(l))
        ));
    }
    s.push_str(&format!(
        r#"<g class="lane{}{}" data-node="{}"><rect x="{LEFT}" y="{y}" width="{}" height="{LANE_H}" fill="{fill}"/><text x="4" y="{}" class="lname">{}{label}<title>{}: {}</title></text></g>"#,
        if named { " named" } else { "" },
        if lagging.is_some() { " lagging" } else { "" },
        cut(&n.name, 200),
        W - LEFT - RIGHT,
        y + 16.0,
        if named { "▶ " } else { "" },
        cut(&n.name, 200),
        cut(&n.verdict, 300),
    ));
}

/// One lane's marks: the trigger under the evidence, at most one of a kind per pixel column
/// and [`MARKS_MAX`] in all.
fn lane_marks(s: &mut String, ax: &Axis, top: f64, node: &str, marks: &[Mark]) {
    let y = top + LANE_H / 2.0;
    let mut seen = HashSet::new();
    let ordered = marks
        .iter()
        .filter(|m| m.kind == Kind::Trigger)
        .chain(marks.iter().filter(|m| m.kind != Kind::Trigger));
    for m in ordered.filter(|m| (ax.lo..=ax.hi).contains(&m.t)) {
        let x = ax.x(m.t);
        if seen.len() >= MARKS_MAX || !seen.insert((m.kind, x as i64)) {
            continue;
        }
        let text = m.e["text"]
            .as_str()
            .or(m.e["line"].as_str())
            .or(m.e["reason"].as_str())
            .unwrap_or("");
        let title = format!(
            "<title>{} {}: {:+.3} s: {}</title>",
            cut(node, 60),
            m.kind.label(),
            m.t,
            cut(text, 200)
        );
        let class = m.kind.class();
        if m.kind == Kind::Trigger {
            s.push_str(&format!(
                r#"<path class="ev {class}" d="M{:.1} {y:.1}L{x:.1} {:.1}L{:.1} {y:.1}L{x:.1} {:.1}Z">{title}</path>"#,
                x - 5.0,
                y - 7.0,
                x + 5.0,
                y + 7.0
            ));
        } else {
            let radius = if m.kind.kernel() { 5 } else { 4 };
            s.push_str(&format!(
                r#"<circle class="ev {class}" cx="{x:.1}" cy="{y:.1}" r="{radius}">{title}</circle>"#
            ));
        }
    }
}

/// At most ~13 ticks whatever the span.
fn ticks(s: &mut String, ax: &Axis, height: f64) {
    let span = ax.hi - ax.lo;
    let step = [0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
        .into_iter()
        .find(|st| span / st <= 12.0)
        .unwrap_or_else(|| 10f64.powf((span / 12.0).log10().ceil()));
    if !(span.is_finite() && step.is_finite() && step > 0.0) {
        return;
    }
    let first = (ax.lo / step).ceil();
    for i in 0..=13 {
        let t = (first + f64::from(i)) * step;
        if t > ax.hi {
            break;
        }
        let x = ax.x(t);
        if x > W - 24.0 {
            break;
        }
        s.push_str(&format!(
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{}" stroke="#d5d8dc"/><text x="{x:.1}" y="{}" class="tick" text-anchor="middle">{t:+.1}s</text>"##,
            height - 22.0,
            height - 8.0
        ));
    }
}
