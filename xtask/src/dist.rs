//! `cargo xtask dist`: one release binary with the probes embedded, linked against an old glibc
//! baseline with `cargo zigbuild`, checked for the newest GLIBC_ symbol version it needs, then
//! packed with the agent's systemd unit, config, docs and install.sh (docs/dist.md).
//!
//! Not musl: NVML is the driver's glibc-linked libnvidia-ml.so.1, loaded with dlopen; a static
//! musl binary cannot dlopen it.
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};

use crate::{root, run, setup};

/// The oldest glibc the binary runs on. 2.17 does not link: Rust's std calls getrandom (2.25)
/// and nantrace's safefs renameat2 (2.28). 2.28: RHEL/Rocky 8, Debian 10, Ubuntu 20.04 (2.31).
pub const GLIBC_BASELINE: (u32, u32) = (2, 28);
const TRIPLE: &str = "x86_64-unknown-linux-gnu";
/// Pinned, from PyPI, into target/dist-tools/venv (wheels: zig itself, a prebuilt cargo-zigbuild).
const ZIGLANG: &str = "0.17.1";
const CARGO_ZIGBUILD: &str = "0.24.1";

fn output(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn euid() -> u32 {
    extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: geteuid has no failure mode.
    unsafe { geteuid() }
}

/// The pinned zig + cargo-zigbuild in a private venv; installed once. Returns the venv's bin dir.
fn zig_tools() -> Result<PathBuf> {
    let venv = root().join("target/dist-tools/venv");
    let bin = venv.join("bin");
    let ok = |bin: &Path| {
        output(Command::new(bin.join("cargo-zigbuild")).arg("--version"))
            .is_some_and(|v| v == format!("cargo-zigbuild {CARGO_ZIGBUILD}"))
            && output(Command::new(bin.join("python3")).args(["-m", "ziglang", "version"]))
                .is_some_and(|v| v == ZIGLANG)
    };
    if ok(&bin) {
        return Ok(bin);
    }
    if output(Command::new("python3").args(["-c", "import venv, ensurepip"])).is_none() {
        setup::apt_install(&["python3-venv"])
            .context("python3 with the venv module is needed for zig and cargo-zigbuild")?;
    }
    if venv.exists() {
        std::fs::remove_dir_all(&venv)
            .with_context(|| format!("removing the stale {}", venv.display()))?;
    }
    let t = Instant::now();
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    run(Command::new(bin.join("pip"))
        .args(["install", "--disable-pip-version-check", "-q"])
        .arg(format!("ziglang=={ZIGLANG}"))
        .arg(format!("cargo-zigbuild=={CARGO_ZIGBUILD}")))
    .context("pip could not install ziglang and cargo-zigbuild from PyPI")?;
    if !ok(&bin) {
        bail!("installed ziglang {ZIGLANG} and cargo-zigbuild {CARGO_ZIGBUILD} in {}, but they do not answer their versions", venv.display());
    }
    eprintln!(
        "xtask: zig {ZIGLANG} and cargo-zigbuild {CARGO_ZIGBUILD} installed in {} ({:.0?})",
        venv.display(),
        t.elapsed()
    );
    Ok(bin)
}

/// The eBPF object to embed: $NANTRACE_BPF_OBJ when set (a prebuilt one), else built here.
fn bpf_object() -> Result<PathBuf> {
    let obj = if let Some(p) = std::env::var_os("NANTRACE_BPF_OBJ") {
        let p = PathBuf::from(p);
        eprintln!("xtask: embedding the prebuilt eBPF object {} (NANTRACE_BPF_OBJ): setup and build-ebpf skipped", p.display());
        p
    } else {
        let route = setup::setup()?;
        setup::build_ebpf(&route)?;
        root().join("nantrace-ebpf/target/bpfel-unknown-none/release/nantrace")
    };
    let bytes = std::fs::read(&obj)
        .with_context(|| format!("reading the eBPF object {}", obj.display()))?;
    // An ELF for EM_BPF (247): the CLI builds without probes when the object is missing or empty,
    // which must never be shipped.
    if bytes.len() < 20
        || &bytes[..4] != b"\x7fELF"
        || u16::from_le_bytes([bytes[18], bytes[19]]) != 247
    {
        bail!("{} is not an eBPF ELF object", obj.display());
    }
    Ok(obj)
}

/// (max version, symbols per version, NEEDED libraries) from `objdump -T -p`.
type GlibcReport = (Vec<u32>, BTreeMap<Vec<u32>, Vec<String>>, Vec<String>);

fn glibc_versions(bin: &Path) -> Result<GlibcReport> {
    let dump = output(Command::new("objdump").arg("-T").arg("-p").arg(bin))
        .context("objdump -T -p failed")?;
    parse_objdump(&dump)
}

fn parse_objdump(dump: &str) -> Result<GlibcReport> {
    let mut per: BTreeMap<Vec<u32>, Vec<String>> = BTreeMap::new();
    let mut needed = Vec::new();
    for line in dump.lines() {
        if let Some(lib) = line.trim().strip_prefix("NEEDED") {
            needed.push(lib.trim().to_string());
            continue;
        }
        // Dynamic symbol lines: `0000000000000000      DF *UND*  0000000000000000 (GLIBC_2.28) renameat2`.
        if !line.contains("*UND*") {
            continue;
        }
        let Some(at) = line.find("GLIBC_") else {
            continue;
        };
        let v: String = line[at + 6..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let sym = line.split_whitespace().last().unwrap_or("?").to_string();
        if v.is_empty() {
            bail!(
                "{sym} needs a non-numbered glibc version ({}): not portable",
                line.trim()
            );
        }
        let v: Vec<u32> = v.split('.').filter_map(|p| p.parse().ok()).collect();
        per.entry(v).or_default().push(sym);
    }
    let max = per
        .keys()
        .next_back()
        .cloned()
        .context("objdump shows no GLIBC_ symbol: not a glibc binary?")?;
    Ok((max, per, needed))
}

fn vstr(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(".")
}

/// Fails when a symbol needs a glibc newer than the baseline, or when the driver's libraries
/// are linked rather than dlopened. Prints the newest version needed and who needs it.
fn check_glibc(bin: &Path) -> Result<String> {
    judge(bin, glibc_versions(bin)?)
}

fn judge(bin: &Path, (max, per, needed): GlibcReport) -> Result<String> {
    let base = vec![GLIBC_BASELINE.0, GLIBC_BASELINE.1];
    eprintln!("xtask: NEEDED: {}", needed.join(" "));
    for (v, syms) in per.iter().rev().take(3) {
        eprintln!(
            "xtask:   GLIBC_{:<6} {} symbol(s): {}",
            vstr(v),
            syms.len(),
            syms.iter().take(8).cloned().collect::<Vec<_>>().join(" ")
        );
    }
    if let Some(l) = needed
        .iter()
        .find(|l| l.contains("nvidia") || l.contains("cuda"))
    {
        bail!(
            "{} links {l}: the driver's libraries must be dlopened, not linked",
            bin.display()
        );
    }
    if max > base {
        bail!(
            "{} needs GLIBC_{} ({}), newer than the baseline {}",
            bin.display(),
            vstr(&max),
            per[&max].join(" "),
            vstr(&base)
        );
    }
    eprintln!(
        "xtask: max GLIBC version required: {} (baseline {}): OK",
        vstr(&max),
        vstr(&base)
    );
    Ok(vstr(&max))
}

fn mib(path: &Path) -> Result<String> {
    let n = std::fs::metadata(path)?.len();
    Ok(format!("{n} bytes ({:.1} MiB)", n as f64 / 1048576.0))
}

fn copy_mode(from: &Path, to: &Path, mode: u32) -> Result<()> {
    if let Some(d) = to.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The release binary for the baseline's glibc, the probes in `obj` embedded. zig links against
/// glibc stubs of the baseline version: a symbol newer than it is a link error rather than a
/// surprise on the node.
fn zigbuild(tools: &Path, obj: &Path) -> Result<PathBuf> {
    let path = std::env::join_paths(std::iter::once(tools.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))?;
    let target = format!("{TRIPLE}.{}.{}", GLIBC_BASELINE.0, GLIBC_BASELINE.1);
    run(Command::new(tools.join("cargo-zigbuild"))
        .current_dir(root())
        .env("PATH", path)
        .env("NANTRACE_BPF_OBJ", obj)
        .args([
            "zigbuild",
            "--locked",
            "--release",
            "-p",
            "nantrace",
            "--target",
            &target,
        ]))
    .context("cargo zigbuild failed")?;
    Ok(root().join("target").join(TRIPLE).join("release/nantrace"))
}

/// The probes are in it, byte for byte.
fn check_embedded(built: &Path, obj: &Path) -> Result<()> {
    let image = std::fs::read(built)?;
    let want = std::fs::read(obj)?;
    if !image.windows(want.len()).any(|w| w == want.as_slice()) {
        bail!(
            "{} does not contain the eBPF object {}",
            built.display(),
            obj.display()
        );
    }
    Ok(())
}

/// `bin`: `built` stripped, with a debuglink to `debug`, its debug info.
fn strip(built: &Path, bin: &Path, debug: &Path) -> Result<()> {
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(built)
        .arg(debug))?;
    run(Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(bin)
        .arg(built))?;
    run(Command::new("objcopy")
        .arg(format!("--add-gnu-debuglink={}", debug.display()))
        .arg(bin))?;
    std::fs::set_permissions(bin, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The agent's unit, install.sh, the Prometheus rules, the config and the docs into the tree;
/// a note for each one missing.
fn copy_files(stage: &Path) -> Result<Vec<String>> {
    let src = root().join("dist");
    copy_mode(
        &src.join("nantrace-agent.service"),
        &stage.join("lib/systemd/system/nantrace-agent.service"),
        0o644,
    )?;
    copy_mode(&src.join("install.sh"), &stage.join("install.sh"), 0o755)?;
    for f in ["nantrace-rules.yml", "nantrace-rules.test.yml"] {
        copy_mode(
            &src.join("prometheus").join(f),
            &stage.join("share/nantrace/prometheus").join(f),
            0o644,
        )?;
    }
    let mut notes = Vec::new();
    if src.join("agent.toml").exists() {
        copy_mode(
            &src.join("agent.toml"),
            &stage.join("etc/nantrace/agent.toml"),
            0o600,
        )?;
    } else {
        notes.push(
            "dist/agent.toml does not exist: the tarball ships no etc/nantrace/agent.toml"
                .to_string(),
        );
    }
    for doc in ["README.md", "docs/agent.md", "docs/security.md"] {
        let from = root().join(doc);
        if from.exists() {
            copy_mode(
                &from,
                &stage
                    .join("share/doc/nantrace")
                    .join(Path::new(doc).file_name().unwrap()),
                0o644,
            )?;
        } else {
            notes.push(format!("{doc} does not exist: not in share/doc/nantrace"));
        }
    }
    Ok(notes)
}

/// `dist`/NAME.tar.gz of the tree `dist`/NAME. Reproducible: sorted, root-owned, mtime of the
/// last commit, gzip without a timestamp.
fn pack(dist: &Path, name: &str) -> Result<PathBuf> {
    let mtime = output(
        Command::new("git")
            .current_dir(root())
            .args(["log", "-1", "--format=%ct"]),
    )
    .unwrap_or_else(|| "0".into());
    let tarball = dist.join(format!("{name}.tar.gz"));
    run(Command::new("tar")
        .current_dir(dist)
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--format=gnu",
        ])
        .arg(format!("--mtime=@{mtime}"))
        .args(["--use-compress-program=gzip -9n", "-cf"])
        .arg(&tarball)
        .arg(name))?;
    Ok(tarball)
}

pub fn dist(check_old_glibc: bool) -> Result<()> {
    let t0 = Instant::now();
    if check_old_glibc && euid() != 0 {
        bail!("--check-old-glibc needs root (debootstrap, chroot, mounts, eBPF)");
    }
    let obj = bpf_object()?;
    setup::apt_install(&["binutils", "tar", "gzip"])?;
    let tools = zig_tools()?;

    let t_build = Instant::now();
    let built = zigbuild(&tools, &obj)?;
    let build_time = t_build.elapsed();

    check_embedded(&built, &obj)?;
    let glibc_max = check_glibc(&built)?;
    let version = output(Command::new(&built).arg("--version"))
        .and_then(|v| v.strip_prefix("nantrace ").map(str::to_string))
        .context("the built binary does not run here (`nantrace --version`)")?;

    // The tree that becomes the tarball.
    let name = format!("nantrace-{version}-x86_64-linux-gnu");
    let dist = root().join("target/dist");
    let stage = dist.join(&name);
    if stage.exists() {
        std::fs::remove_dir_all(&stage)?;
    }
    std::fs::create_dir_all(stage.join("bin"))?;
    let bin = stage.join("bin/nantrace");
    // Debug info goes next to the tarball (for symbolizing a backtrace from a node), not in it.
    let debug = dist.join(format!("{name}.debug"));
    strip(&built, &bin, &debug)?;
    check_glibc(&bin)?;
    let notes = copy_files(&stage)?;

    let tarball = pack(&dist, &name)?;
    let listing = output(Command::new("tar").arg("-tvzf").arg(&tarball)).unwrap_or_default();

    eprintln!("\nxtask: {}:\n{listing}", tarball.display());
    for n in &notes {
        eprintln!("xtask: note: {n}");
    }
    eprintln!(
        "xtask: glibc baseline {}.{}; max GLIBC_ version required: {glibc_max}",
        GLIBC_BASELINE.0, GLIBC_BASELINE.1
    );
    eprintln!(
        "xtask: binary (unstripped)  {}  {}",
        built.display(),
        mib(&built)?
    );
    eprintln!(
        "xtask: bin/nantrace         {}  {}",
        bin.display(),
        mib(&bin)?
    );
    eprintln!(
        "xtask: debug info           {}  {}",
        debug.display(),
        mib(&debug)?
    );
    eprintln!(
        "xtask: tarball              {}  {}",
        tarball.display(),
        mib(&tarball)?
    );
    eprintln!(
        "xtask: dist took {:.0?} (cargo zigbuild {:.0?})",
        t0.elapsed(),
        build_time
    );

    if check_old_glibc {
        let t = Instant::now();
        run(Command::new(root().join("scripts/dist-check.sh")).arg(&tarball))
            .context("the dist check failed (logs in target/dist-test/logs)")?;
        eprintln!("xtask: dist check took {:.0?}", t.elapsed());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Excerpts of `objdump -T -p`: this dist binary, and the bookworm-built one (glibc 2.36).
    const DIST: &str = "  NEEDED               libc.so.6\n  NEEDED               libdl.so.2\n\
0000000000000000  w   DF *UND*\t0000000000000000 (GLIBC_2.28) statx\n\
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.2.5) free\n\
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.28) renameat2\n\
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.25) getrandom\n";
    const HOST: &str =
        "0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.34) __libc_start_main\n\
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.33) fstat64\n\
0000000000000000      DF *UND*\t0000000000000000  GLIBC_2.34  dlopen\n";

    #[test]
    fn max_version_and_who_needs_it() {
        let (max, per, needed) = parse_objdump(DIST).unwrap();
        assert_eq!(max, vec![2, 28]);
        assert_eq!(per[&vec![2, 28]], vec!["statx", "renameat2"]);
        assert_eq!(per[&vec![2, 2, 5]], vec!["free"]);
        assert_eq!(needed, vec!["libc.so.6", "libdl.so.2"]);
        assert_eq!(
            judge(Path::new("dist"), parse_objdump(DIST).unwrap()).unwrap(),
            "2.28"
        );
    }

    #[test]
    fn newer_than_the_baseline_fails_and_names_the_symbols() {
        let e = judge(Path::new("host"), parse_objdump(HOST).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GLIBC_2.34") && e.contains("__libc_start_main") && e.contains("dlopen"),
            "{e}"
        );
    }

    #[test]
    fn linked_nvml_fails_and_unversioned_glibc_fails() {
        let linked = format!("  NEEDED               libnvidia-ml.so.1\n{DIST}");
        assert!(judge(Path::new("x"), parse_objdump(&linked).unwrap()).is_err());
        let private = "0000000000000000      DF *UND*\t0000000000000000 (GLIBC_PRIVATE) _dl_x\n";
        assert!(parse_objdump(private).is_err());
        assert!(parse_objdump("").is_err());
    }
}
