//! `nantrace report B`: the node report of a bundle, or the job report of a directory of
//! node bundles; printed, and with `--write` the rendered files put back into it.
use std::path::Path;

use anyhow::Context as _;

/// The node report of bundle `b` on stdout; with `write`, report.md, report.txt, report.html
/// and trace.json rendered again into it (only a bundle directory that is ours alone; files
/// replaced by rename, 4.11).
pub fn bundle(b: &Path, write: bool) -> anyhow::Result<()> {
    let (a, t, snap) = crate::report::for_bundle(b)?;
    crate::term::print_report(&crate::report::markdown(&a, &t));
    if write {
        let dir = crate::safefs::Dir::open_private(b)
            .with_context(|| format!("report --write {}", b.display()))?;
        for (name, data) in crate::export::derived(&t, &snap).run().1 {
            dir.replace(name, &data)
                .with_context(|| format!("writing {}/{name}", b.display()))?;
        }
    }
    Ok(())
}

/// `nantrace report DIR` on a directory of node bundles: the job report on stdout (Markdown,
/// or `json`), and with `write` job-report.md, job-report.json and trace.json into DIR.
pub fn job_dir(dir: &Path, json: bool, write: bool) -> anyhow::Result<()> {
    let (r, merged, nodes) = crate::jobreport::from_dir(dir)?;
    let md = crate::jobreport::markdown(&r);
    if json {
        crate::sayout!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        crate::term::print_report(&md);
    }
    if write {
        let d = crate::safefs::Dir::open_private(dir)
            .with_context(|| format!("report --write {}", dir.display()))?;
        d.replace("job-report.md", md.as_bytes())?;
        d.replace("job-report.json", &serde_json::to_vec_pretty(&r)?)?;
        d.replace(
            "trace.json",
            &serde_json::to_vec(&crate::export::perfetto::merged(&merged, &nodes))?,
        )?;
    }
    Ok(())
}
