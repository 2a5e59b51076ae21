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
        let (a, files) = crate::export::derived(&t, &snap).run();
        for (name, data) in files {
            dir.replace(name, &data)
                .with_context(|| format!("writing {}/{name}", b.display()))?;
        }
        // Its summary again, of this analysis (a bundle of an older agent gets one).
        let mut summary = crate::jobreport::summary::of(&t, &snap, &a);
        summary["timeline"] = crate::bundle::timeline_identity(b)?;
        dir.replace("summary.json", &serde_json::to_vec(&summary)?)
            .with_context(|| format!("writing {}/summary.json", b.display()))?;
    }
    Ok(())
}

/// `nantrace report --summaries DIR`: summary.json written into each node bundle under DIR
/// that has none the job report may use, one bundle in memory at a time.
pub fn write_summaries(dir: &Path) -> anyhow::Result<()> {
    let (mut done, mut failed) = (0, 0);
    for b in crate::jobreport::find_bundles(dir)? {
        // One of this analysis, of exactly this timeline (its hash checked too), stays.
        let id = crate::bundle::timeline_identity(&b).ok();
        if crate::jobreport::summary::current(&b)
            .is_some_and(|s| id.as_ref() == Some(&s["timeline"]))
        {
            continue;
        }
        // An incomplete bundle, or one without snapshot.json, is read from its files.
        if b.join(crate::bundle::recover::NOTE).exists() || !b.join("snapshot.json").is_file() {
            crate::say!("nantrace: {}: incomplete or without snapshot.json: no summary (read from its files)", b.display());
            continue;
        }
        let written = crate::report::for_bundle(&b).and_then(|(a, t, snap)| {
            let mut summary = crate::jobreport::summary::of(&t, &snap, &a);
            summary["timeline"] = crate::bundle::timeline_identity(&b)?;
            crate::safefs::Dir::open_private(&b)?
                .replace("summary.json", &serde_json::to_vec(&summary)?)?;
            Ok(())
        });
        match written {
            Ok(()) => done += 1,
            Err(e) => {
                failed += 1;
                crate::say!(
                    "nantrace: WARNING: {}: no summary written: {e:#}",
                    b.display()
                );
            }
        }
    }
    crate::say!("nantrace: {done} summaries written ({failed} could not be)");
    Ok(())
}

/// `nantrace report DIR` on a directory of node bundles: the job report on stdout (Markdown,
/// or `json`), and with `write` job-report.md, job-report.json, job-report.html and trace.json
/// into DIR.
pub fn job_dir(dir: &Path, json: bool, write: bool) -> anyhow::Result<()> {
    let (r, merged, nodes) = crate::jobreport::from_dir(dir)?;
    if r.from_summaries > 0 {
        crate::say!(
            "nantrace: {} of {} nodes read from their summaries (quiet nodes, and nodes whose only words are hang lines), the others from their timelines",
            r.from_summaries,
            r.nodes.len()
        );
    }
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
            "job-report.html",
            crate::export::jobhtml::render(&r, &merged).as_bytes(),
        )?;
        d.replace(
            "trace.json",
            &serde_json::to_vec(&crate::export::perfetto::merged(&merged, &nodes))?,
        )?;
    }
    Ok(())
}
