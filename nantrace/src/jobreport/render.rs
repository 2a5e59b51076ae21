//! The job report rendered as Markdown (untrusted text escaped by the node report's rules):
//! it reads a [`JobReport`], never the bundles.
use serde_json::Value;

use super::hang::{HangView, RankRow};
use super::peers::MEASURES;
use super::JobReport;

/// Rows of the ranks' table at most (the rest are counted), as job-report.html's.
const RANK_ROWS: usize = 64;

/// Untrusted text for a table's cell: the node report's escaping, and `|`.
fn esc(t: &str) -> String {
    crate::report::md(t).replace('|', "\\|")
}

/// The job report in Markdown (untrusted text escaped by the same rules as the node report).
pub fn markdown(r: &JobReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "# nantrace job report\n");
    let _ = writeln!(s, "**Verdict: {}**\n", esc(&r.verdict));
    let _ = writeln!(s, "Reference: {}\n", esc(&r.reference));
    let _ = writeln!(s, "Clock: {}\n", esc(&r.clock_statement));
    if let Some(c) = &r.first_failure {
        let _ = writeln!(
            s,
            "## Cause and consequences\n\n- the job's first failure, on {}{}: {} ({:.1} s {} the reference): \"{}\"\n- the job's {} after it, on every node (the first {:.1} s later), are its consequences: listed on their nodes, never the verdict\n",
            esc(c.cause_node.as_deref().unwrap_or("?")),
            c.cause_rank.map_or(String::new(), |r| format!(", rank {r}")),
            esc(&c.cause_what),
            c.cause_rel_s.abs(),
            if c.cause_rel_s <= 0.0 { "before" } else { "after" },
            esc(&c.cause_line),
            if c.explains_network() { "network and hang lines" } else { "ambiguous GPU errors" },
            c.first_consequence_rel_s - c.cause_rel_s
        );
    }
    if r.jobs.len() > 1 {
        let _ = writeln!(
            s,
            "WARNING: these bundles are of {} different jobs: {}\n",
            r.jobs.len(),
            esc(&r.jobs.join(", "))
        );
    }
    let _ = writeln!(
        s,
        "## Nodes ({} with a bundle{})\n",
        r.nodes.len(),
        if r.missing.is_empty() {
            String::new()
        } else {
            format!(
                ", {} missing: {}",
                r.missing.len(),
                esc(&r.missing.join(", "))
            )
        }
    );
    let _ = writeln!(
        s,
        "| node | job (as the bundle says) | verdict | first machine evidence |\n|---|---|---|---|"
    );
    for n in &r.nodes {
        let job = [
            n.job["slurm_job_id"].as_str().map(|j| format!("job {j}")),
            n.job["slurm_procid"]
                .as_str()
                .map(|p| format!("procid {p}")),
            ranks_text(&n.job["identity"]["distributed"]),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(", ");
        let first = n.first_machine.as_ref().map_or("none".to_string(), |f| {
            format!(
                "{}{}",
                f.text,
                if n.machine_from_job_words_only {
                    " (the job's own words)"
                } else {
                    ""
                }
            )
        });
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            esc(&n.name),
            esc(&job),
            esc(&n.verdict),
            esc(&first)
        );
    }
    for m in &r.missing {
        let _ = writeln!(s, "| {} | | MISSING: no bundle | |", esc(m));
    }
    if let Some(h) = &r.hang {
        s.push_str(&ranks_table(h));
    }
    let _ = writeln!(s, "\n## Peers compared\n");
    if r.nodes.len() < 3 {
        let _ = writeln!(
            s,
            "Not with {} node(s): it takes 3 to tell which one is odd.",
            r.nodes.len()
        );
    } else if r.outliers.is_empty() {
        let _ = writeln!(
            s,
            "No node stands out from its peers on: {}.",
            MEASURES
                .iter()
                .map(|m| m.0.replace('_', " "))
                .collect::<Vec<_>>()
                .join(", ")
        );
    } else {
        for o in &r.outliers {
            let _ = writeln!(s, "- {}", esc(&o.text));
        }
    }
    let _ = writeln!(
        s,
        "\nEach node's own report: `nantrace report <its bundle>`; the bundles: {}.",
        esc(&r
            .nodes
            .iter()
            .map(|n| n.bundle.as_str())
            .collect::<Vec<_>>()
            .join(", "))
    );
    s
}

/// A node's ranks as its bundle says (`agent::ranks`): `ranks 8-15 of 16 (torch, node rank 1)`.
pub(super) fn ranks_text(d: &Value) -> Option<String> {
    let mut r: Vec<u64> = d["ranks"]
        .as_array()?
        .iter()
        .filter_map(|x| x["rank"].as_u64())
        .collect();
    r.sort_unstable();
    r.dedup();
    let (first, last) = (*r.first()?, *r.last()?);
    let span = if r.len() == 1 {
        format!("rank {first}")
    } else if last - first == r.len() as u64 - 1 {
        format!("ranks {first}-{last}")
    } else {
        format!(
            "ranks {}",
            r.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        )
    };
    let of = d["world_size"]
        .as_u64()
        .map_or(String::new(), |w| format!(" of {w}"));
    let node = d["node_rank"]
        .as_u64()
        .map_or(String::new(), |n| format!(", node rank {n}"));
    Some(format!(
        "{span}{of} ({}{node})",
        d["launcher"].as_str().unwrap_or("?")
    ))
}

impl HangView {
    /// The ranks' table of job-report.md and .html, the named ranks first, then by group (in
    /// number order) and rank: where each stood as its watchdog lines say (a row per process
    /// group its lines name) and, on the hang's group's row, what the stacks and its Flight
    /// Recorder dump say of it. A named rank or a rank with a dump, and no watchdog line, has
    /// a row of its own.
    pub fn table_rows(&self) -> Vec<(RankRow, Option<&super::hang::RankStood>)> {
        let mut rows: Vec<RankRow> = self.ranks.clone();
        let named = self.lagging.iter().map(|(r, n)| (*r, n));
        // Past the rows kept, a rank with a dump may have a line row that was cut: not added
        // again (it is counted with the ranks not listed).
        let all_kept = self.ranks_seen <= self.ranks.len();
        let dumped = self
            .stood
            .iter()
            .filter(|st| all_kept && st.fr_last.is_some());
        let mut seen: std::collections::HashSet<u32> = rows
            .iter()
            .filter(|r| r.pg == self.pg)
            .map(|r| r.rank)
            .collect();
        for (rank, node) in named.chain(dumped.map(|st| (st.rank, &st.node))) {
            if seen.insert(rank) {
                rows.push(RankRow {
                    rank,
                    pg: self.pg.clone(),
                    node: node.clone(),
                    lagging: self.lagging.iter().any(|l| l.0 == rank),
                    ..RankRow::default()
                });
            }
        }
        rows.sort_by_key(|r| {
            (
                !r.lagging,
                r.pg.parse::<u64>().unwrap_or(u64::MAX),
                r.pg.clone(),
                r.rank,
            )
        });
        rows.into_iter()
            .map(|r| {
                let st = self
                    .stood
                    .iter()
                    .find(|st| st.rank == r.rank && r.pg == self.pg);
                (r, st)
            })
            .collect()
    }

    /// The table's rows not listed (past `shown`) and ranks with a watchdog line not kept.
    pub fn rows_not_listed(&self, rows: usize, shown: usize) -> usize {
        rows.saturating_sub(shown) + self.ranks_seen.saturating_sub(self.ranks.len())
    }
}

/// [`HangView::table_rows`] in Markdown; "—" where a cell has nothing.
fn ranks_table(h: &HangView) -> String {
    use std::fmt::Write as _;
    let rows = h.table_rows();
    if rows.is_empty() {
        return String::new();
    }
    let dash = |v: Option<i64>| v.map_or("—".to_string(), |v| v.to_string());
    let mut s = String::from("\n## The hang: where each rank stood\n\n| rank | node | PG | timed out in | last enqueued | last completed | Flight Recorder: last collective | Flight Recorder: last completed | its line (the job's own words) |\n|---|---|---|---|---|---|---|---|---|\n");
    for (r, st) in rows.iter().take(RANK_ROWS) {
        let last = st
            .and_then(|st| st.fr_last.as_ref())
            .map_or("—".to_string(), |(n, op, state)| {
                format!("{n} {op} {state}")
            });
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.rank,
            esc(r.node.as_deref().unwrap_or("?")),
            esc(&r.pg),
            match (r.waits_in, &r.op) {
                (Some(w), Some(op)) => format!("{w} ({})", esc(op)),
                (w, _) => dash(w),
            },
            dash(r.enqueued),
            dash(r.completed),
            esc(&last),
            dash(st.and_then(|st| st.fr_completed)),
            if r.line.is_empty() {
                "—".to_string()
            } else {
                esc(&r.line)
            },
        );
    }
    let more = h.rows_not_listed(rows.len(), RANK_ROWS);
    if more > 0 {
        let _ = writeln!(s, "\n{more} more ranks not listed.");
    }
    s
}
