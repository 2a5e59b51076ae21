//! The peers' table of job-report.html (each node's measures with the outliers marked, the
//! median over every node) and the missing nodes. Past [`ROWS_MAX`] nodes only the nodes
//! drawn and the outliers are rows; the median is still every node's.
use std::collections::{BTreeSet, HashMap};

use super::{cut, measure, median, JobReport, LIST_MAX, MEASURES, ROWS_MAX};

/// The nodes listed (indices in the report's order): every node up to [`ROWS_MAX`]; past
/// it the nodes drawn, then the outliers.
fn rows(r: &JobReport, drawn: &[usize]) -> Vec<usize> {
    if r.nodes.len() <= ROWS_MAX {
        return (0..r.nodes.len()).collect();
    }
    let outliers: BTreeSet<&str> = r.outliers.iter().map(|o| o.node.as_str()).collect();
    let mut rows: BTreeSet<usize> = drawn.iter().copied().take(ROWS_MAX).collect();
    for (i, n) in r.nodes.iter().enumerate() {
        if rows.len() >= ROWS_MAX {
            break;
        }
        if outliers.contains(n.name.as_str()) {
            rows.insert(i);
        }
    }
    rows.into_iter().collect()
}

/// The outliers in words, then the table: node, its verdict, its measures (an outlier's cell
/// marked, its sentence as the cell's title), its first machine evidence.
pub(super) fn peers(r: &JobReport, drawn: &[usize]) -> String {
    let cols: Vec<&str> = MEASURES
        .iter()
        .map(|m| m.0)
        .filter(|m| r.nodes.iter().any(|n| n.measures.contains_key(m)))
        .collect();
    // A lossy link's bad end marks its retransmits.
    let marked: HashMap<(&str, &str), &str> = r
        .outliers
        .iter()
        .map(|o| {
            let m = if o.measure == "tcp_lossy_links" {
                "tcp_retransmits"
            } else {
                o.measure
            };
            ((o.node.as_str(), m), o.text.as_str())
        })
        .collect();
    let mut s = if r.nodes.len() < 3 {
        format!(
            "<p id=\"outliers\" class=\"note\">Not with {} node(s): it takes 3 to tell which one is odd.</p>\n",
            r.nodes.len()
        )
    } else if r.outliers.is_empty() {
        "<p id=\"outliers\">No node stands out from its peers.</p>\n".to_string()
    } else {
        let items: String = r
            .outliers
            .iter()
            .take(LIST_MAX)
            .map(|o| format!("<li>{}</li>", cut(&o.text, 400)))
            .collect();
        format!("<ul id=\"outliers\">{items}</ul>\n")
    };
    s.push_str("<table id=\"peers\"><tr><th>node</th><th>its own verdict</th>");
    for c in &cols {
        s.push_str(&format!("<th>{}</th>", c.replace('_', " ")));
    }
    s.push_str("<th>first machine evidence</th></tr>\n");
    let listed = rows(r, drawn);
    for &i in &listed {
        row(&mut s, r, i, &cols, &marked);
    }
    if r.nodes.len() >= 3 {
        s.push_str(&format!(
            "<tr class=\"median\"><td>median</td><td>of {} nodes</td>",
            r.nodes.len()
        ));
        for c in &cols {
            let v: Vec<f64> = r
                .nodes
                .iter()
                .filter_map(|n| n.measures.get(c))
                .copied()
                .collect();
            s.push_str(&format!("<td class=\"num\">{}</td>", measure(median(v))));
        }
        s.push_str("<td></td></tr>\n");
    }
    s.push_str("</table>\n");
    if listed.len() < r.nodes.len() {
        s.push_str(&format!(
            "<p class=\"note\">{} nodes not listed (neither drawn above nor standing out): job-report.json has every node's measures.</p>\n",
            r.nodes.len() - listed.len()
        ));
    }
    s
}

/// One node's row: its name, its verdict, its measures (an outlier's cell marked, with its
/// sentence as the title), its first machine evidence.
fn row(
    s: &mut String,
    r: &JobReport,
    i: usize,
    cols: &[&str],
    marked: &HashMap<(&str, &str), &str>,
) {
    let n = &r.nodes[i];
    let short = n.verdict.split(':').next().unwrap_or("");
    s.push_str(&format!(
        "<tr{}><td>{}</td><td title=\"{}\">{}</td>",
        if Some(&n.name) == r.node.as_ref() {
            " class=\"named\""
        } else {
            ""
        },
        cut(&n.name, 60),
        cut(&n.verdict, 400),
        cut(short, 80)
    ));
    for c in cols {
        let v = n.measures.get(c).map_or("–".to_string(), |v| measure(*v));
        match marked.get(&(n.name.as_str(), *c)) {
            Some(t) => s.push_str(&format!(
                "<td class=\"num outlier\" title=\"{}\">{v}</td>",
                cut(t, 400)
            )),
            None => s.push_str(&format!("<td class=\"num\">{v}</td>")),
        }
    }
    let first = n.first_machine.as_ref().map_or("none".to_string(), |f| {
        let words = if n.machine_from_job_words_only {
            " (the job's own words)"
        } else {
            ""
        };
        format!("{}{words}", cut(&f.text, 240))
    });
    s.push_str(&format!("<td>{first}</td></tr>\n"));
}

/// The nodes of the job's node list without a bundle.
pub(super) fn missing(r: &JobReport) -> String {
    if r.missing.is_empty() {
        return "<p id=\"missing\">None: no node of the Slurm node list the bundles carry is without a bundle.</p>".to_string();
    }
    let items: String = r
        .missing
        .iter()
        .take(LIST_MAX)
        .map(|m| format!("<li>{}</li>", cut(m, 80)))
        .collect();
    let more = if r.missing.len() > LIST_MAX {
        format!(
            "<p class=\"note\">and {} more.</p>",
            r.missing.len() - LIST_MAX
        )
    } else {
        String::new()
    };
    format!(
        "<p>{} of the job's nodes sent no bundle: the verdict is INCOMPLETE, and a missing node may hold the cause.</p><ul id=\"missing\">{items}</ul>{more}",
        r.missing.len()
    )
}
