//! job-report.html: the job report as one self-contained page beside job-report.md (inline
//! CSS and SVG, no script, no network: a CSP forbids every fetch). The verdict and its action
//! on top; one lane per node on the job's clock with each node's trigger and evidence, the
//! named node highlighted (`lanes.rs`, at most [`lanes::LANES_MAX`] nodes drawn); for a hang,
//! each node's ranks as lanes under it on the same clock (`ranks.rs`, at most
//! [`ranks::RANK_LANES_MAX`]), where each rank stood and what the stacks and NCCL RAS said; the peers compared; the
//! missing nodes; the clock. It reads a [`JobReport`] and the merged timeline, never the
//! bundles. Everything a job or a bundle wrote (lines, host names) is escaped and cut short.
use std::collections::{BTreeSet, HashMap};

use serde_json::Value;

use super::html::esc;
use crate::jobreport::{HangView, JobReport, MEASURES};

mod lanes;
pub use lanes::LANES_MAX;
mod ranks;
pub use ranks::RANK_LANES_MAX;

/// Rows of the peers' and the ranks' tables at most (the rest are counted).
pub const ROWS_MAX: usize = 64;
/// Missing nodes and outliers named at most.
const LIST_MAX: usize = 200;

/// Untrusted text, control characters dropped, cut to `n` characters (`…` where cut), escaped.
fn cut(s: &str, n: usize) -> String {
    let mut t: String = s.chars().filter(|c| !c.is_control()).take(n + 1).collect();
    if t.chars().count() > n {
        t = t.chars().take(n).collect();
        t.push('…');
    }
    esc(&t)
}

/// The hung ranks the report names, by node.
fn lagging_by_node(r: &JobReport) -> HashMap<&str, Vec<u32>> {
    let mut m: HashMap<&str, Vec<u32>> = HashMap::new();
    for (rank, node) in r.hang.iter().flat_map(|h| &h.lagging) {
        if let Some(n) = node {
            m.entry(n.as_str()).or_default().push(*rank);
        }
    }
    m
}

/// The page's class for the verdict's colour.
fn verdict_class(v: &str) -> &'static str {
    if v.starts_with("PROBABLY THE MACHINE") {
        "machine"
    } else if v.starts_with("POSSIBLY THE MACHINE") {
        "possibly"
    } else if v.starts_with("NOT THE MACHINE") && !v.contains("INCOMPLETE") {
        "clear"
    } else {
        "undecided"
    }
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#17202a;max-width:1140px}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:18px 0 6px}
#verdict{padding:10px;border-left:6px solid #7f8c8d;background:#fdfefe;font-weight:600}
#verdict.machine{border-color:#c0392b} #verdict.possibly{border-color:#e67e22} #verdict.clear{border-color:#27ae60} #verdict.undecided{border-color:#d4ac0d}
#action,.warning{font-weight:600;color:#922b21}
.lname,.tick{font-size:11px;fill:#566573} .lane.lagging .lname{fill:#9a7d0a;font-weight:700} .lane.named .lname{fill:#922b21;font-weight:700} .zero{font-size:11px;fill:#c0392b}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #d5d8dc;padding:2px 6px;text-align:left;vertical-align:top}
td.num{text-align:right} td.outlier{background:#f5b7b1;font-weight:700} tr.named td:first-child{font-weight:700;color:#922b21} tr.lagging{background:#fcf3cf} tr.median{color:#566573;font-style:italic}
code{font-size:11px;word-break:break-all} .note{color:#566573;font-size:12px}
.sw{display:inline-block;width:10px;height:10px;border-radius:5px;margin:0 3px 0 10px}";

/// job-report.html of `r`, with `merged` (the job's merged timeline) for the lanes.
pub fn render(r: &JobReport, merged: &Value) -> String {
    let zero = merged["first_nan"]["offset_s"].as_f64().unwrap_or(0.0);
    let zero_name = match merged["first_nan"]["node"].as_str() {
        Some(n) => format!("first NaN ({})", n.chars().take(40).collect::<String>()),
        None => "first trigger".to_string(),
    };
    let mut named: BTreeSet<&str> = r.outliers.iter().map(|o| o.node.as_str()).collect();
    named.extend(
        r.hang
            .iter()
            .flat_map(|h| &h.lagging)
            .filter_map(|l| l.1.as_deref()),
    );
    named.extend(
        r.first_failure
            .iter()
            .filter_map(|o| o.cause_node.as_deref()),
    );
    named.extend(merged["first_nan"]["node"].as_str());
    // A hang whose lines, stacks and dumps know no rank draws no rank lanes.
    let ranks = r
        .hang
        .as_ref()
        .map(|h| ranks::read(r, h, merged, zero))
        .filter(|k| !k.is_empty());
    let lanes::Drawn {
        svg,
        note,
        drawn,
        ranks_note,
    } = lanes::svg(r, merged, &named, (zero, &zero_name), ranks.as_ref());
    let mut legend: String = lanes::Kind::ALL
        .iter()
        .map(|k| format!(r#"<span class="sw {}"></span>{}"#, k.class(), k.label()))
        .collect();
    let (what, ranks_words) = match (&ranks, ranks_note) {
        (Some(k), Some(n)) => {
            legend.push_str(r#"<span class="sw k-progress"></span>a rank's last step/loss line<span class="sw since"></span>its silence since<span class="sw k-fr"></span>its Flight Recorder dump's last collective created"#);
            (
                "The nodes and, under each, its ranks on one clock",
                format!(
                    "<p id=\"rank-lanes-note\" class=\"note\">{}</p>\n{}",
                    esc(&n),
                    k.legend()
                ),
            )
        }
        _ => ("The nodes on one clock", String::new()),
    };
    let kinds_css: String = lanes::Kind::ALL
        .iter()
        .map(|k| {
            format!(
                ".{c}{{fill:{v}}} .sw.{c}{{background:{v}}}\n",
                c = k.class(),
                v = k.colour()
            )
        })
        .collect();
    let jobs = if r.jobs.len() > 1 {
        format!(
            r#"<p id="jobs" class="warning">WARNING: these bundles are of {} different jobs: {}</p>"#,
            r.jobs.len(),
            cut(&r.jobs.join(", "), 400)
        )
    } else {
        String::new()
    };
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>nantrace job report — {title}</title>
<style>
{STYLE}
{kinds_css}{ranks_css}
</style></head><body>
<h1>nantrace job report</h1>
<div id="verdict" class="{vclass}">{verdict}</div>
{action}<p id="reference">Reference: {reference}</p>
{jobs}{cause}<h2>{what} (seconds relative to the job's {zero_name})</h2>
<p id="lanes-note" class="note">{note}</p>
{svg}
<p id="legend" class="note">{legend}</p>
{ranks_words}
{hang}<h2>Peers compared</h2>
{peers}
<h2>Missing nodes</h2>
{missing}
<h2>Clock</h2>
<p id="clock">{clock}</p>
<p class="note">Each node's own report: nantrace report &lt;its bundle&gt;; job-report.md and job-report.json beside this page say the same in text.</p>
</body></html>
"#,
        title = title(r),
        ranks_css = if ranks.is_some() {
            ranks::style()
        } else {
            String::new()
        },
        vclass = verdict_class(&r.verdict),
        verdict = cut(&r.verdict, 6000),
        action = r.action.as_ref().map_or(String::new(), |a| format!(
            "<p id=\"action\">Action: {}</p>\n",
            cut(a, 1000)
        )),
        reference = cut(&r.reference, 600),
        zero_name = esc(&zero_name),
        cause = cause(r),
        hang = r.hang.as_ref().map_or(String::new(), hang),
        peers = peers(r, &drawn),
        missing = missing(r),
        clock = cut(&r.clock_statement, 1000),
    )
}

/// The job and its size, for the page's title.
fn title(r: &JobReport) -> String {
    let job = match r.jobs.as_slice() {
        [j] => format!("job {}, ", cut(j, 40)),
        _ => String::new(),
    };
    format!(
        "{job}{} node{}",
        r.nodes.len(),
        if r.nodes.len() == 1 { "" } else { "s" }
    )
}

/// The job's first failure and its consequences, when the lines show both.
fn cause(r: &JobReport) -> String {
    let Some(c) = &r.first_failure else {
        return String::new();
    };
    format!(
        "<h2>Cause and consequences</h2><ul id=\"order\"><li>the job's first failure, on {}{}: {} ({:.1} s {} the reference): <code>{}</code></li><li>the job's {} after it, on every node (the first {:.1} s later), are its consequences: on their lanes, never the verdict</li></ul>\n",
        cut(c.cause_node.as_deref().unwrap_or("?"), 60),
        c.cause_rank.map_or(String::new(), |r| format!(", rank {r}")),
        cut(&c.cause_what, 200),
        c.cause_rel_s.abs(),
        if c.cause_rel_s <= 0.0 { "before" } else { "after" },
        cut(&c.cause_line, 300),
        if c.explains_network() {
            "network and hang lines"
        } else {
            "ambiguous GPU errors"
        },
        c.first_consequence_rel_s - c.cause_rel_s
    )
}

/// A counter as the tables print it.
fn num(v: Option<i64>) -> String {
    v.map_or("–".to_string(), |v| v.to_string())
}

/// Where each rank stood (the named ones first), and what the stacks and NCCL RAS said.
fn hang(h: &HangView) -> String {
    let coll = match (h.collective, &h.op) {
        (Some(c), Some(op)) => format!("collective {c} ({}, PG {})", cut(op, 32), cut(&h.pg, 32)),
        (Some(c), None) => format!("collective {c} (PG {})", cut(&h.pg, 32)),
        _ => format!("a collective of PG {}", cut(&h.pg, 32)),
    };
    let who: Vec<String> = h
        .lagging
        .iter()
        .take(32)
        .map(|(r, n)| match n {
            Some(n) => format!("rank {r} on {}", cut(n, 60)),
            None => format!("rank {r}"),
        })
        .collect();
    let who = if who.is_empty() {
        "no rank named".to_string()
    } else {
        who.join(", ")
    };
    let mut s = format!(
        "<h2>The hang: where each rank stood</h2>\n<p id=\"hang-kind\">{coll}: <b>{who}</b>: {} (the first watchdog line {:+.1} s from the reference).</p>\n",
        h.kind,
        if h.first_rel_s.is_finite() { h.first_rel_s } else { 0.0 }
    );
    s.push_str("<table id=\"ranks\"><tr><th>rank</th><th>node</th><th>PG</th><th>timed out in</th><th>operation</th><th>last enqueued</th><th>last completed</th><th>Flight Recorder: last collective</th><th>Flight Recorder: last completed</th><th>its line (the job's own words)</th></tr>\n");
    let rows = h.table_rows();
    for (row, st) in rows.iter().take(ROWS_MAX) {
        let fr_last = st
            .and_then(|st| st.fr_last.as_ref())
            .map_or("–".to_string(), |(n, op, state)| {
                format!("{n} {} {}", cut(op, 32), cut(state, 16))
            });
        s.push_str(&format!(
            "<tr{}><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{fr_last}</td><td class=\"num\">{}</td><td><code>{}</code></td></tr>\n",
            if row.lagging { " class=\"lagging\"" } else { "" },
            row.rank,
            row.node.as_deref().map_or("?".to_string(), |n| cut(n, 60)),
            cut(&row.pg, 32),
            num(row.waits_in),
            row.op.as_deref().map_or("–".to_string(), |o| cut(o, 32)),
            num(row.enqueued),
            num(row.completed),
            num(st.and_then(|st| st.fr_completed)),
            if row.line.is_empty() { "–".to_string() } else { cut(&row.line, 200) },
        ));
    }
    s.push_str("</table>\n");
    let more = h.rows_not_listed(rows.len(), ROWS_MAX);
    if more > 0 {
        s.push_str(&format!(
            "<p class=\"note\">{more} more ranks not listed.</p>\n"
        ));
    }
    if !h.missing.is_empty() {
        s.push_str(&format!(
            "<p id=\"silent-ranks\">Ranks of the world with no watchdog line in the bundles read: {}.</p>\n",
            esc(&crate::report::hang::rank_list(&h.missing))
        ));
    }
    let items = [
        ("rank-states", "At the trigger", h.at.join("; ")),
        (
            "stack-groups",
            "Stacks",
            h.groups.clone().unwrap_or_default(),
        ),
        ("nccl-ras", "NCCL RAS", h.ras.clone().unwrap_or_default()),
    ];
    for (id, what, text) in items.iter().filter(|i| !i.2.is_empty()) {
        s.push_str(&format!(
            "<p id=\"{id}\"><b>{what}:</b> {}</p>\n",
            cut(text, 3000)
        ));
    }
    s.push_str(&format!(
        "<details><summary>what the lines say, in one sentence</summary><p id=\"hang-sentence\">{}</p></details>\n",
        cut(&h.sentence, 6000)
    ));
    s
}

/// A measure as the peers' table prints it.
fn measure(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The median of `v` (0 for none).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

mod peers;
use peers::{missing, peers};

#[cfg(test)]
mod rank_tests;
#[cfg(test)]
mod tests;
