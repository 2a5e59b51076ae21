//! `cargo xtask bench`: placeholder filled in by the benchmark issue.
use anyhow::Result;

pub fn run(_smoke: bool) -> Result<()> {
    eprintln!("xtask: bench: not implemented yet");
    Ok(())
}
