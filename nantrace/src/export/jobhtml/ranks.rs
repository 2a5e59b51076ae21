//! The ranks' lanes of job-report.html, for a hang (`jobreport::HangView`): under each node
//! drawn, each of its ranks on the job's clock: its last step/loss line and its first
//! watchdog or timeout line as marks (the silence between them dashed), and in words the
//! collective it last enqueued and completed (its watchdog lines' counters, else its Flight
//! Recorder dump), its stack group (ranks whose main threads stood in the same place at the
//! trigger; the ranks outside the largest group are where to look) and, for the rank the
//! verdict names and the ranks outside the largest group, its frame. Its Flight Recorder
//! dump's last collective of the hang's group is a mark where it was created, on its node's
//! clock put on the job's (`jobreport::FrCreated`), or a line of words saying why it is not.
//! At most [`RANK_LANES_MAX`] lanes: the named ranks, their neighbours, the ranks outside the
//! largest group first; the page says how many are not drawn. The job's words are cut and
//! escaped.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

use super::lanes::{Axis, LEFT, RIGHT, W};
use super::{cut, esc, num};
use crate::jobreport::{FrCreated, HangView, JobReport};

/// Ranks drawn at most (a lane each).
pub const RANK_LANES_MAX: usize = 48;
/// Ranks followed at most, every source together (hostile output).
const KNOWN_MAX: usize = 8192;
/// A time further than this from the reference is drawn at this distance.
const SPAN_MAX: f64 = 1e7;
/// The lane's band (its marks) and each of its two lines of words.
const BAND_H: f64 = 18.0;
const TEXT_H: f64 = 13.0;
/// The stack groups' colours, largest group first (a group past them is grey).
const PALETTE: [&str; 8] = [
    "#2874a6", "#b9770e", "#7d3c98", "#148f77", "#a93226", "#5d6d7e", "#1e8449", "#af601a",
];
/// Stack groups named in the legend at most.
const GROUPS_SHOWN: usize = 12;

/// One rank's lane.
pub(super) struct RankLane {
    pub(super) rank: u32,
    pub(super) node: Option<String>,
    /// One of the ranks the verdict names.
    named: bool,
    /// Its last step/loss line: when (seconds from the reference), the line.
    progress: Option<(f64, String)>,
    /// Its first watchdog or timeout line: when, the line with its counters.
    watchdog: Option<(f64, String)>,
    /// The collective it last enqueued and completed, in words (unescaped).
    collective: String,
    /// Its Flight Recorder dump's last collective (number, operation) and when it was
    /// created on the page's clock, or why that is not drawn.
    fr: Option<(i64, String, FrCreated)>,
    /// Where its main thread stood at its node's trigger (`S in futex_wait_queue,
    /// train.py:211 log_metrics`), and its stack group (0: the largest).
    frame: Option<String>,
    group: Option<usize>,
    /// Outside the largest stack group.
    suspect: bool,
}

/// A hang's ranks: every rank the lines, the stacks and the dumps know, and their stack
/// groups.
pub(super) struct Ranks {
    lanes: Vec<RankLane>,
    /// The stack groups, largest first: where their main threads stood, their ranks.
    groups: Vec<(String, Vec<u32>)>,
}

/// The lane of `rank`, added when fewer than [`KNOWN_MAX`] ranks are known.
fn lane_of(lanes: &mut BTreeMap<u32, RankLane>, rank: u32) -> Option<&mut RankLane> {
    if lanes.len() >= KNOWN_MAX && !lanes.contains_key(&rank) {
        return None;
    }
    Some(lanes.entry(rank).or_insert_with(|| RankLane {
        rank,
        node: None,
        named: false,
        progress: None,
        watchdog: None,
        collective: String::new(),
        fr: None,
        frame: None,
        group: None,
        suspect: false,
    }))
}

/// A time on the page's clock, when it is one.
fn clock(t: f64) -> Option<f64> {
    (!t.is_nan()).then(|| t.clamp(-SPAN_MAX, SPAN_MAX))
}

/// `rank_state`'s clause as a frame: `main thread S in x, from f.py:1 g` → `S in x, f.py:1 g`.
fn frame(stack: &str) -> String {
    let s = stack.strip_prefix("main thread ").unwrap_or(stack);
    s.replacen(", from ", ", ", 1)
}

/// A frame with its file's directories left out (`S in x, f.py:1 g` from `S in x,
/// torch/distributed/f.py:1 g`): the lanes' words, the legend has it whole.
fn short(frame: &str) -> String {
    let Some((state, at)) = frame.rsplit_once(", ") else {
        return frame.to_string();
    };
    let (file, func) = at.split_once(' ').unwrap_or((at, ""));
    let file = file.rsplit('/').next().unwrap_or(file);
    format!("{state}, {file} {func}").trim_end().to_string()
}

/// A stack group's letter: A, B, ... Z, then G27, G28, ...
fn letter(g: usize) -> String {
    match u8::try_from(g) {
        Ok(i) if i < 26 => char::from(b'A' + i).to_string(),
        _ => format!("G{}", g + 1),
    }
}

/// The hang's ranks, from its view (`h`), the job report's nodes (their ranks' pids) and the
/// merged timeline (each rank's step/loss lines; `zero`: the reference's offset on it).
pub(super) fn read(r: &JobReport, h: &HangView, merged: &Value, zero: f64) -> Ranks {
    let mut lanes: BTreeMap<u32, RankLane> = BTreeMap::new();
    for (rank, node) in &h.lagging {
        if let Some(l) = lane_of(&mut lanes, *rank) {
            l.named = true;
            l.node.clone_from(node);
        }
    }
    for row in &h.ranks {
        let Some(l) = lane_of(&mut lanes, row.rank) else {
            continue;
        };
        l.named |= row.lagging;
        if l.node.is_none() {
            l.node.clone_from(&row.node);
        }
        // The hang's own group's row over another group's.
        if l.watchdog.is_some() && row.pg != h.pg {
            continue;
        }
        l.watchdog = row
            .at_s
            .and_then(clock)
            .map(|t| (t, row.line.clone()))
            .or(l.watchdog.take());
        let waits = match (row.waits_in, &row.op) {
            (Some(w), Some(op)) => format!("; timed out in {w}, {op}"),
            (Some(w), None) => format!("; timed out in {w}"),
            _ => String::new(),
        };
        l.collective = match (row.enqueued, row.completed) {
            (None, None) if waits.is_empty() => String::new(),
            (None, None) => format!("its watchdog line{}", waits.replacen(';', ":", 1)),
            (e, c) => format!(
                "last enqueued {}, completed {} (its watchdog line{waits})",
                num(e),
                num(c)
            ),
        };
    }
    let mut pids: HashMap<(&str, u64), u32> = HashMap::new();
    for s in &h.stood {
        let Some(l) = lane_of(&mut lanes, s.rank) else {
            continue;
        };
        if l.node.is_none() {
            l.node.clone_from(&s.node);
        }
        if let (Some(n), Some(p)) = (s.node.as_deref(), s.pid) {
            pids.insert((n, p), s.rank);
        }
        l.frame = s.stack.as_deref().map(frame);
        if let (Some((n, op, _)), Some(c)) = (&s.fr_last, &s.fr_created) {
            let c = match c {
                FrCreated::At(t) => {
                    clock(*t).map_or(FrCreated::NotDrawn("no time".into()), FrCreated::At)
                }
                c => c.clone(),
            };
            l.fr = Some((*n, op.clone(), c));
        }
        if let (true, Some((n, op, state))) = (l.collective.is_empty(), &s.fr_last) {
            l.collective = format!(
                "last enqueued {n}, completed {} (its Flight Recorder dump: {op}, {state})",
                num(s.fr_completed)
            );
        }
    }
    for n in &r.nodes {
        let ranks = &n.job["identity"]["distributed"]["ranks"];
        for x in ranks.as_array().into_iter().flatten() {
            let rank = x["rank"].as_u64().and_then(|r| u32::try_from(r).ok());
            if let (Some(rank), Some(pid)) = (rank, x["pid"].as_u64()) {
                pids.entry((n.name.as_str(), pid)).or_insert(rank);
            }
        }
    }
    progress(&mut lanes, merged, zero, &pids);
    let groups = groups(&mut lanes);
    Ranks {
        lanes: lanes.into_values().collect(),
        groups,
    }
}

/// Each rank's last step/loss line (its rank from the line's `[rankN]:` prefix, else from its
/// node and pid), in one pass over the merged timeline. A rank no source placed is placed on
/// the node whose bundle alone printed its lines.
fn progress(
    lanes: &mut BTreeMap<u32, RankLane>,
    merged: &Value,
    zero: f64,
    pids: &HashMap<(&str, u64), u32>,
) {
    let mut printed: BTreeMap<u32, BTreeSet<&str>> = BTreeMap::new();
    for e in merged["events"].as_array().into_iter().flatten() {
        if e["source"] != "log" || (e["step"].is_null() && e["loss"].is_null()) {
            continue;
        }
        let (Some(node), Some(line)) = (e["node"].as_str(), e["line"].as_str()) else {
            continue;
        };
        let (rank, _) = crate::joblog::rank_of(line);
        let rank = rank.or_else(|| pids.get(&(node, e["pid"].as_u64()?)).copied());
        let (Some(rank), Some(t)) = (rank, e["offset_s"].as_f64().and_then(|t| clock(t - zero)))
        else {
            continue;
        };
        let Some(l) = lane_of(lanes, rank) else {
            continue;
        };
        if l.progress.as_ref().is_none_or(|p| p.0 <= t) {
            l.progress = Some((t, line.chars().take(300).collect()));
        }
        let at = printed.entry(rank).or_default();
        if at.len() < 2 {
            at.insert(node);
        }
    }
    for (rank, at) in printed.into_iter().filter(|x| x.1.len() == 1) {
        if let (Some(l), Some(node)) = (lanes.get_mut(&rank), at.first()) {
            l.node.get_or_insert_with(|| (*node).to_string());
        }
    }
}

/// The ranks grouped by their frames, largest group first (ties by frame): each rank's
/// group set, the ranks outside the largest marked (with two groups or more).
fn groups(lanes: &mut BTreeMap<u32, RankLane>) -> Vec<(String, Vec<u32>)> {
    let mut by: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for l in lanes.values() {
        if let Some(f) = &l.frame {
            by.entry(f.as_str()).or_default().push(l.rank);
        }
    }
    let mut g: Vec<(String, Vec<u32>)> = by.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    g.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
    let index: HashMap<&str, usize> = g
        .iter()
        .enumerate()
        .map(|(i, x)| (x.0.as_str(), i))
        .collect();
    for l in lanes.values_mut() {
        l.group = l.frame.as_deref().and_then(|f| index.get(f).copied());
        l.suspect = g.len() >= 2 && l.group.is_some_and(|i| i > 0);
    }
    g
}

impl Ranks {
    pub(super) fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// The lanes drawn, under the nodes drawn (`names`, in their order; a rank on no known
    /// node last), and the sentence on them: every rank on a node drawn up to
    /// [`RANK_LANES_MAX`]; past it the named ranks, their neighbours (two ranks either side),
    /// the ranks outside the largest stack group, the ranks with a watchdog line.
    pub(super) fn chosen(&self, names: &[&str]) -> (Vec<&RankLane>, String) {
        let pos: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let named: BTreeSet<u32> = self
            .lanes
            .iter()
            .filter(|l| l.named)
            .map(|l| l.rank)
            .collect();
        let mut keyed: Vec<(u8, u32, &RankLane)> = self
            .lanes
            .iter()
            .filter(|l| l.node.as_deref().is_none_or(|n| pos.contains_key(n)))
            .map(|l| {
                let near = named
                    .range(l.rank.saturating_sub(2)..=l.rank.saturating_add(2))
                    .next()
                    .is_some();
                let prio = match () {
                    () if l.named => 0,
                    () if near => 1,
                    () if l.suspect => 2,
                    () if l.watchdog.is_some() => 3,
                    () => 4,
                };
                (prio, l.rank, l)
            })
            .collect();
        let on_drawn = keyed.len();
        keyed.sort_unstable_by_key(|k| (k.0, k.1));
        let mut out: Vec<&RankLane> = keyed
            .into_iter()
            .take(RANK_LANES_MAX)
            .map(|k| k.2)
            .collect();
        let place = |l: &RankLane| l.node.as_deref().and_then(|n| pos.get(n)).copied();
        out.sort_by_key(|l| (place(l).unwrap_or(usize::MAX), l.rank));
        let total = self.lanes.len();
        let note = if out.len() == total {
            format!("Under each node its ranks, each on its own lane ({total}).")
        } else {
            format!(
                "{} of {total} ranks drawn under their nodes: the named rank{s}, {its} neighbours and the ranks outside the largest stack group first; {} not drawn ({} of them on nodes not drawn; the table below lists their watchdog lines).",
                out.len(),
                total - out.len(),
                total - on_drawn,
                s = if named.len() == 1 { "" } else { "s" },
                its = if named.len() == 1 { "its" } else { "their" },
            )
        };
        (out, note)
    }

    /// The words under the lanes: the named ranks with their frames, the stack groups.
    pub(super) fn legend(&self) -> String {
        let mut s = String::new();
        let named: Vec<String> = self
            .lanes
            .iter()
            .filter(|l| l.named)
            .take(8)
            .map(|l| {
                format!(
                    "▶ rank {}{}: {}",
                    l.rank,
                    l.node
                        .as_deref()
                        .map_or(String::new(), |n| format!(" on {}", cut(n, 60))),
                    l.frame
                        .as_deref()
                        .map_or("no stacks of it".into(), |f| cut(f, 200))
                )
            })
            .collect();
        if !named.is_empty() {
            s.push_str(&format!(
                "<p id=\"named-rank\"><b>{}</b> (the rank the verdict names: its main thread at its node's trigger)</p>\n",
                named.join("; ")
            ));
        }
        if self.groups.len() >= 2 {
            let said: Vec<String> = self
                .groups
                .iter()
                .enumerate()
                .take(GROUPS_SHOWN)
                .map(|(i, (f, ranks))| {
                    format!(
                        "<span class=\"sw g{}\"></span>{} ({} {}): {}{}",
                        i.min(PALETTE.len()),
                        letter(i),
                        if ranks.len() == 1 { "rank" } else { "ranks" },
                        esc(&crate::report::hang::rank_list(ranks)),
                        cut(f, 160),
                        if i == 0 { " (the largest)" } else { "" }
                    )
                })
                .collect();
            s.push_str(&format!(
                "<p id=\"stack-group-legend\" class=\"note\">Stack groups (the ranks' main threads at the trigger, the same place = one group; the ranks outside the largest are where to look): {}{}</p>\n",
                said.join("; "),
                if self.groups.len() > GROUPS_SHOWN {
                    format!("; {} more groups", self.groups.len() - GROUPS_SHOWN)
                } else {
                    String::new()
                }
            ));
        }
        s
    }
}

/// The page's style for the ranks' lanes and the stack groups' colours.
pub(super) fn style() -> String {
    let mut s = String::from(".rname{font-size:11px;fill:#566573} .rank-lane.suspect .rname{fill:#9a7d0a;font-weight:700} .rank-lane.named .rname{fill:#922b21;font-weight:700}
.rtext{font-size:10.5px;fill:#424949;paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round} .rtext .frame{fill:#922b21;font-weight:700} .gl{font-size:9px;fill:#fff;font-weight:700}
.k-progress{fill:#5d6d7e} .sw.k-progress{background:#5d6d7e} .k-fr{fill:#1a5276} .sw.k-fr{background:#1a5276;border-radius:0} .since{stroke:#909497;stroke-dasharray:3 3} .sw.since{background:none;border-top:2px dashed #909497;border-radius:0;height:0}
");
    for (i, c) in PALETTE.iter().chain(["#95a5a6"].iter()).enumerate() {
        s.push_str(&format!(".g{i}{{fill:{c}}} .sw.g{i}{{background:{c}}} "));
    }
    s.push('\n');
    s
}

impl RankLane {
    /// Its band, then its lines of words (a third for its Flight Recorder dump).
    pub(super) fn height(&self) -> f64 {
        let lines = if self.fr.is_some() { 3.0 } else { 2.0 };
        BAND_H + lines * TEXT_H + 4.0
    }

    /// When its Flight Recorder dump's last collective was created, where it is drawn.
    fn fr_at(&self) -> Option<f64> {
        match &self.fr {
            Some((_, _, FrCreated::At(t))) => Some(*t),
            _ => None,
        }
    }

    /// The times it marks.
    pub(super) fn times(&self) -> impl Iterator<Item = f64> + '_ {
        let p = self.progress.iter().chain(&self.watchdog).map(|p| p.0);
        p.chain(self.fr_at())
    }

    /// Its band at `y` and its label: the rank, its node, its stack group's chip; the named
    /// rank highlighted, a rank outside the largest group marked.
    pub(super) fn band(&self, s: &mut String, y: f64) {
        let fill = if self.named { "#fadbd8" } else { "#fdfefe" };
        let group = self.group.map_or(String::new(), letter);
        s.push_str(&format!(
            r##"<g class="rank-lane{}{}" data-rank="{}" data-node="{}" data-group="{group}"><rect x="{LEFT}" y="{y}" width="{}" height="{}" fill="{fill}" stroke="#eaeded"/><text x="14" y="{}" class="rname">{}rank {}{}<title>rank {}{}</title></text>"##,
            if self.named { " named" } else { "" },
            if self.suspect { " suspect" } else { "" },
            self.rank,
            self.node.as_deref().map_or(String::new(), |n| cut(n, 200)),
            W - LEFT - RIGHT,
            self.height() - 4.0,
            y + 13.0,
            if self.named { "▶ " } else { "" },
            self.rank,
            self.node.as_deref().map_or(" (node ?)".into(), |n| format!(" · {}", cut(n, 12))),
            self.rank,
            self.node.as_deref().map_or(String::new(), |n| format!(" on {}", cut(n, 200))),
        ));
        if let Some(g) = self.group {
            s.push_str(&format!(
                r#"<rect x="{}" y="{}" width="28" height="12" rx="3" class="g{}"/><text x="{}" y="{}" class="gl" text-anchor="middle">{group}</text>"#,
                LEFT - 34.0,
                y + 3.0,
                g.min(PALETTE.len()),
                LEFT - 20.0,
                y + 12.5,
            ));
        }
        s.push_str("</g>");
    }

    /// Its marks on axis `ax` (its last step/loss line, its first watchdog line, the silence
    /// between them or since) and its words.
    pub(super) fn marks(&self, s: &mut String, ax: &Axis, y: f64) {
        let yc = y + BAND_H / 2.0;
        let inside = |t: f64| (ax.lo..=ax.hi).contains(&t);
        s.push_str(&format!(
            r#"<g class="rank-marks" data-rank="{}">"#,
            self.rank
        ));
        if let Some((tp, _)) = self.progress.as_ref().filter(|p| p.0 < ax.hi) {
            let end = self.watchdog.as_ref().map_or(ax.hi, |w| w.0.min(ax.hi));
            if end > tp.max(ax.lo) {
                s.push_str(&format!(
                    r#"<line class="since" x1="{:.1}" y1="{yc:.1}" x2="{:.1}" y2="{yc:.1}"><title>rank {}: no step/loss line since {tp:+.1} s</title></line>"#,
                    ax.x(tp.max(ax.lo)),
                    ax.x(end),
                    self.rank
                ));
            }
        }
        if let Some((t, line)) = self.progress.as_ref().filter(|p| inside(p.0)) {
            let x = ax.x(*t);
            s.push_str(&format!(
                r#"<rect class="ev k-progress" x="{:.1}" y="{:.1}" width="8" height="8">{}</rect>"#,
                x - 4.0,
                yc - 4.0,
                self.title("its last step/loss line", *t, line)
            ));
        }
        if let Some((t, line)) = self.watchdog.as_ref().filter(|w| inside(w.0)) {
            s.push_str(&format!(
                r#"<circle class="ev k-hang" cx="{:.1}" cy="{yc:.1}" r="4">{}</circle>"#,
                ax.x(*t),
                self.title("its first watchdog / timeout line", *t, line)
            ));
        }
        if let (Some((n, op, _)), Some(t)) = (&self.fr, self.fr_at().filter(|t| inside(*t))) {
            let x = ax.x(t);
            s.push_str(&format!(
                r#"<path class="ev k-fr" d="M{:.1} {:.1}L{x:.1} {:.1}L{:.1} {:.1}Z"><title>rank {}: {}: {t:+.3} s (its Flight Recorder dump; its node's clock put on the job's)</title></path>"#,
                x - 5.0,
                yc + 5.0,
                yc - 5.0,
                x + 5.0,
                yc + 5.0,
                self.rank,
                fr_label(*n, op)
            ));
        }
        for (k, text) in self.words().iter().enumerate() {
            s.push_str(&format!(
                r#"<text x="{}" y="{:.1}" class="rtext">{text}</text>"#,
                LEFT + 4.0,
                y + BAND_H + 10.0 + TEXT_H * k as f64
            ));
        }
        s.push_str("</g>");
    }

    fn title(&self, what: &str, t: f64, line: &str) -> String {
        format!(
            "<title>rank {} {what}: {t:+.3} s: {}</title>",
            self.rank,
            cut(line, 200)
        )
    }

    /// Its lines of words (markup): when it last made progress and timed out; where it stood
    /// (the named rank's and a suspect's frame first) and its collective; when its Flight
    /// Recorder dump's last collective was created, or why that is not drawn.
    fn words(&self) -> Vec<String> {
        let progress = match &self.progress {
            Some((t, line)) => format!(
                "last step/loss line {t:+.1} s: {}",
                cut(crate::joblog::rank_of(line).1.trim(), 48)
            ),
            None => "no step/loss line".into(),
        };
        let watchdog = match &self.watchdog {
            Some((t, _)) => format!("first watchdog / timeout line {t:+.1} s"),
            None => "no watchdog line".into(),
        };
        let group = match self.group {
            Some(g) if self.suspect => format!("group {}, outside the largest", letter(g)),
            Some(g) => format!("group {}", letter(g)),
            None => "no stacks of it".into(),
        };
        let stood = match (&self.frame, self.named || self.suspect) {
            (Some(f), true) => format!(
                "<tspan class=\"frame\">rank {}{}: {}</tspan> ({group})",
                self.rank,
                self.node
                    .as_deref()
                    .map_or(String::new(), |n| format!(" on {}", cut(n, 40))),
                cut(f, 80)
            ),
            (Some(f), false) => format!("{group}: {}", cut(&short(f), 60)),
            (None, _) => group,
        };
        let collective = if self.collective.is_empty() {
            "no watchdog counters, no Flight Recorder dump".to_string()
        } else {
            cut(&self.collective, 110)
        };
        let fr = self.fr.as_ref().map(|(n, op, c)| match c {
            FrCreated::At(t) => format!(
                "{} {t:+.1} s (its node's clock put on the job's)",
                fr_label(*n, op)
            ),
            FrCreated::NotDrawn(why) => {
                format!("{}: not drawn: {}", fr_label(*n, op), cut(why, 200))
            }
        });
        [
            format!("{progress} · {watchdog}"),
            format!("{stood} · {collective}"),
        ]
        .into_iter()
        .chain(fr)
        .collect()
    }
}

/// A Flight Recorder mark's label (markup): `FR: collective 6 gloo:all_reduce created`.
fn fr_label(n: i64, op: &str) -> String {
    format!("FR: collective {n} {} created", cut(op, 64))
}
