//! The commands about the machine as it is now, without a job: `snapshot`, `gpucheck`,
//! `doctor`, and `ctl` (a request to the running agent).
use anyhow::Context as _;

use crate::{say, sayout};

/// `nantrace snapshot`: the machine now, to stdout or a 0600 file.
pub fn snapshot(pid: Option<u32>, out: Option<&std::path::Path>) -> anyhow::Result<i32> {
    if let Some(p) = pid {
        anyhow::ensure!(crate::correlate::alive(p), "pid {p} does not exist");
    }
    let s = serde_json::to_string_pretty(&crate::collect::snapshot(pid))?;
    match out {
        Some(path) => {
            write_0600(path, s.as_bytes())?;
            say!("nantrace: snapshot written to {}", path.display());
        }
        None => sayout!("{s}"),
    }
    Ok(0)
}

/// `nantrace gpucheck`: the same math on every GPU; the result printed, to a file or into a
/// bundle.
pub fn gpucheck(
    opts: &crate::gpucheck::Opts,
    out: Option<&std::path::Path>,
    bundle: Option<&std::path::Path>,
) -> anyhow::Result<i32> {
    anyhow::ensure!(
        (0.0..=0.9).contains(&opts.mem_fraction),
        "--mem-fraction must be between 0 and 0.9"
    );
    let v = crate::gpucheck::run(opts);
    say!(
        "{}",
        crate::term::clean_lines(crate::gpucheck::summary(&v).trim_end())
    );
    let text = serde_json::to_string_pretty(&v)?;
    match (out, bundle) {
        (Some(p), _) => write_0600(p, text.as_bytes())?,
        (None, Some(b)) => {
            crate::gpucheck::into_bundle(b, &v)?;
            say!(
                "nantrace: gpucheck.json added to {}; report.md rendered again",
                b.display()
            );
        }
        (None, None) => sayout!("{text}"),
    }
    Ok(crate::gpucheck::exit_code(&v))
}

/// `nantrace ctl`: one request to the agent's socket, its answer printed.
pub fn ctl(
    cmd: &str,
    args: [(&str, Option<String>); 3],
    socket: &std::path::Path,
    json: bool,
) -> anyhow::Result<i32> {
    let mut req = serde_json::json!({ "cmd": cmd });
    for (k, v) in args {
        if let Some(v) = v {
            req[k] = v.into();
        }
    }
    crate::agent::ctl::cli(cmd, req, socket, json)?;
    Ok(0)
}

/// `nantrace doctor`: what this machine supports, probe by probe.
pub fn doctor(json: bool) -> anyhow::Result<i32> {
    let r = crate::doctor::run();
    if json {
        sayout!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        crate::doctor::print_human(&r);
    }
    Ok(0)
}

/// A file nantrace writes by itself (snapshot --out): see `safefs::write_file_0600`.
pub fn write_0600(path: &std::path::Path, data: &[u8]) -> anyhow::Result<()> {
    crate::safefs::write_file_0600(path, data)
        .with_context(|| format!("writing {}", path.display()))
}
