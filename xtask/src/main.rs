//! `cargo xtask`: the project's front door. Installs what is missing (idempotently), builds the
//! eBPF probes with the pinned toolchain, builds the CLI, runs the tests, the demo, the bench.
mod bench;
mod cluster;
mod dist;
mod nfs;
mod setup;
mod vm;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the eBPF toolchain (llvm-22-dev, pinned nightly + rust-src, bpf-linker 0.13)
    Setup,
    /// Build the eBPF object only
    BuildEbpf,
    /// Setup, build the probes, build the CLI
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Setup, build, then run every test (privileged ones single-threaded, as root)
    Test,
    /// Setup, build, then run `nantrace demo` (the built-in diverging training job)
    Demo {
        #[arg(long, default_value = "numeric")]
        scenario: String,
        #[arg(long, default_value = "demo-out")]
        out: String,
    },
    /// Benchmarks (root): writes docs/performance.md and bench/results.json
    Bench {
        /// Tiny sizes, a few seconds: proves the benchmark still works
        #[arg(long)]
        smoke: bool,
        /// The "before" figures: this results.json instead of the one being replaced
        #[arg(long)]
        previous: Option<std::path::PathBuf>,
        /// Measure nothing: write docs/performance.md again from bench/results.json
        #[arg(long)]
        render: bool,
    },
    /// The job report at scale (64-1024 node bundles) and its precision and recall on
    /// simulated multi-node jobs; writes bench/jobs-results.json (no root needed)
    BenchJobs {
        /// Tiny sizes, a few seconds: proves it still runs
        #[arg(long)]
        smoke: bool,
    },
    /// The kernel matrix: boot each Debian kernel of xtask/src/vm.rs in QEMU and run doctor
    /// and the kernel integration tests inside it, on the BTF path and the tracefs fallback
    /// (root; docs/kernel-matrix.md)
    VmTest {
        /// Comma-separated labels (default: all)
        #[arg(long)]
        kernels: Option<String>,
        /// Write the table into docs/kernel-matrix.md
        #[arg(long)]
        docs: bool,
    },
    /// The multi-node tests on a cluster of three QEMU VMs with Slurm and the agent on each
    /// (root; docs/multi-node.md)
    VmCluster,
    /// The job directory's rendezvous over NFS: one QEMU VM with the kernel's NFS server and
    /// two `nosharecache` mounts of one export, the `agent::jobdir::tests::nfs_*` unit tests
    /// in it (root; docs/multi-node.md)
    VmNfs,
    /// Release binary for glibc >= 2.28 (cargo zigbuild), probes embedded, plus
    /// target/dist/nantrace-VERSION-x86_64-linux-gnu.tar.gz (docs/dist.md).
    /// NANTRACE_BPF_OBJ=path embeds a prebuilt eBPF object instead of building one.
    Dist {
        /// Then, as root, run scripts/dist-check.sh on the tarball: the binary on a Debian
        /// bullseye (glibc 2.31) chroot, probes loading on this host, install.sh into a DESTDIR
        #[arg(long)]
        check_old_glibc: bool,
    },
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: running {cmd:?}");
    let st = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn build_cli(release: bool) -> Result<PathBuf> {
    let mut c = Command::new("cargo");
    c.current_dir(root())
        .args(["build", "--locked", "-p", "nantrace"]);
    if release {
        c.arg("--release");
    }
    run(&mut c)?;
    Ok(root()
        .join("target")
        .join(if release { "release" } else { "debug" })
        .join("nantrace"))
}

/// `cargo xtask test`: setup, build, then every test: the unit tests, the privileged integration
/// tests (on both probe paths), the benchmarks in smoke mode, the kernel matrix, the job
/// directory over NFS and the cluster.
fn test() -> Result<()> {
    let route = setup::setup()?;
    setup::test_deps()?;
    setup::build_ebpf(&route)?;
    build_cli(false)?;
    // SAFETY: geteuid has no failure mode.
    let root_user = unsafe { libc_geteuid() } == 0;
    if !root_user {
        eprintln!("xtask: WARNING: not root: the privileged tests will SKIP (they fail in CI, which runs as root)");
    }
    // No function over clippy.toml's threshold (120 lines) outside tests (issue 32); an
    // `allow` of the lint is refused by the architecture test.
    run(Command::new("cargo").current_dir(root()).args([
        "clippy",
        "--locked",
        "--workspace",
        "--lib",
        "--bins",
        "--",
        "-A",
        "warnings",
        "-A",
        "clippy::all",
        "-D",
        "clippy::too_many_lines",
    ]))?;
    // Unit tests in parallel, then the integration tests that load probes, one at a time
    // (they share kernel state: tracepoints, cgroups, namespaces, /dev/kmsg).
    run(Command::new("cargo").current_dir(root()).args([
        "test",
        "--locked",
        "--workspace",
        "--lib",
        "--bins",
    ]))?;
    run(Command::new("cargo").current_dir(root()).args([
        "test",
        "--locked",
        "-p",
        "nantrace",
        "--test",
        "*",
        "--",
        "--test-threads=1",
    ]))?;
    // The kernel tests again on the tracefs fallback (the first run used the BTF
    // programs wherever the kernel has BTF): every probe works on both paths.
    run(Command::new("cargo")
        .current_dir(root())
        .env("NANTRACE_PROBE_PATH", "tracefs")
        .args([
            "test",
            "--locked",
            "-p",
            "nantrace",
            "--test",
            "kernel_events",
            "--test",
            "kernel_membership",
            "--",
            "--test-threads=1",
        ]))?;
    // The benchmark in smoke mode: proves it still runs (no timing assertions).
    bench::run(true, &root().join("target/debug/nantrace"))?;
    bench::jobs::run(
        true,
        &root().join("target/debug/nantrace"),
        Path::new("/dev/null"),
    )?;
    // The kernel matrix: the same kernel tests on every kernel of vm.rs, in VMs.
    if std::env::var("NANTRACE_VM_TEST").is_ok_and(|v| v == "0") {
        eprintln!("xtask: WARNING: NANTRACE_VM_TEST=0: the kernel matrix, the NFS VM and the VM cluster are SKIPPED (CI runs them)");
        return Ok(());
    }
    if !root_user {
        bail!("the kernel matrix needs root (it downloads kernels with apt and runs the privileged tests in VMs)");
    }
    vm::vm_test(
        &vm::Args {
            kernels: None,
            docs: false,
        },
        &root().join("target/debug/nantrace"),
    )?;
    // The job directory's rendezvous over NFS, in one VM (about 80 s).
    nfs::vm_nfs()?;
    // The multi-node tests on a cluster of VMs.
    cluster::vm_cluster(&root().join("target/debug/nantrace"))
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd.unwrap_or(Cmd::Build { release: false }) {
        Cmd::Setup => setup::setup().map(|_| ()),
        Cmd::BuildEbpf => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)
        }
        Cmd::Build { release } => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)?;
            let bin = build_cli(release)?;
            eprintln!("xtask: built {}", bin.display());
            Ok(())
        }
        Cmd::Test => test(),
        Cmd::VmCluster => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)?;
            let bin = build_cli(false)?;
            cluster::vm_cluster(&bin)
        }
        Cmd::VmNfs => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)?;
            nfs::vm_nfs()
        }
        Cmd::Demo { scenario, out } => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)?;
            let bin = build_cli(true)?;
            std::fs::create_dir_all(&out)?;
            run(Command::new(bin).args(["demo", "--scenario", &scenario, "--out", &out]))
        }
        Cmd::Bench {
            render: true,
            previous,
            ..
        } => bench::render(previous.as_deref()),
        Cmd::Bench {
            smoke,
            previous,
            render: false,
        } => {
            if let Some(p) = &previous {
                std::env::set_var("NANTRACE_BENCH_PREVIOUS", p);
            }
            let route = setup::setup()?;
            setup::test_deps()?;
            setup::build_ebpf(&route)?;
            let bin = build_cli(true)?;
            bench::run(smoke, &bin)
        }
        Cmd::BenchJobs { smoke } => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)?;
            let bin = build_cli(!smoke)?;
            bench::jobs::run(smoke, &bin, &root().join("bench/jobs-results.json")).map(|_| ())
        }
        Cmd::Dist { check_old_glibc } => dist::dist(check_old_glibc),
        Cmd::VmTest { kernels, docs } => {
            let route = setup::setup()?;
            setup::build_ebpf(&route)?;
            let bin = build_cli(false)?;
            vm::vm_test(&vm::Args { kernels, docs }, &bin)
        }
    }
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
