//! `nantrace merge B1 B2 ... --out DIR`: node bundles on one clock, with the node report read
//! over the merged timeline.
use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// Merge `bundles` into `out` (a new directory, or one only we can write, never one of the
/// inputs): timeline.json, trace.json, report.md, report.html; the verdict on stdout.
pub fn run(bundles: &[PathBuf], out: &Path) -> anyhow::Result<()> {
    let mut nodes = bundles
        .iter()
        .map(|b| crate::merge::load(b))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let merged = crate::merge::merge(&mut nodes);
    let trace = crate::export::perfetto::merged(&merged, &nodes);
    let snap = nodes[0].snapshot.clone();
    let a = crate::report::analyze(&merged, &snap);
    let dir = out_dir(out, bundles)?;
    dir.replace("timeline.json", &crate::merge::timeline_bytes(&merged)?)?;
    dir.replace("trace.json", &serde_json::to_vec(&trace)?)?;
    let md = crate::report::markdown(&a, &merged);
    dir.replace("report.md", md.as_bytes())?;
    dir.replace(
        "report.html",
        crate::export::html::render(&a, &merged, &snap).as_bytes(),
    )?;
    crate::say!(
        "nantrace: merged {} bundles into {}: {}",
        nodes.len(),
        out.display(),
        merged["clock_statement"].as_str().unwrap_or("")
    );
    crate::sayout!("{}", crate::term::clean(&a.verdict));
    Ok(())
}

fn out_dir(out: &Path, inputs: &[PathBuf]) -> anyhow::Result<crate::safefs::Dir> {
    for b in inputs {
        anyhow::ensure!(!crate::safefs::is_within(out, b) && !crate::safefs::is_within(b, out), "--out {} is (or contains, or is inside) the input bundle {}: it would be overwritten; give a new directory", out.display(), b.display());
    }
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
            let name = out
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("--out {}: not a directory name", out.display()))?;
            Ok(crate::safefs::Dir::open(parent)?
                .create_subdir(name)
                .with_context(|| format!("creating {}", out.display()))?)
        }
        Err(e) => Err(e).with_context(|| format!("--out {}", out.display())),
        Ok(_) => crate::safefs::Dir::open_private(out).with_context(|| {
            format!(
                "--out {}: give a new directory, or one only you can write",
                out.display()
            )
        }),
    }
}
