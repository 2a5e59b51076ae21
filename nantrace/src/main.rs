//! nantrace CLI: wiring only; the work lives in the library.
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "nantrace", version, about = "Flight recorder for GPU training nodes: was it the machine?")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print kernel events live (JSON Lines with --json)
    Watch {
        /// Root pid(s) of the job; descendants are followed. Without it: the whole machine.
        #[arg(long = "pid")]
        pids: Vec<u32>,
        /// Stop after this many seconds
        #[arg(long)]
        duration: Option<f64>,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
        /// Block requests at least this slow (ms) are events; errors always are
        #[arg(long, default_value_t = 50.0)]
        slow_io_ms: f64,
    },
    /// What this machine supports: privileges, tracefs, BTF, each probe, NVML
    Doctor {
        #[arg(long)]
        json: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Watch { pids, duration, json, slow_io_ms } => {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(nantrace::watch::run(nantrace::watch::WatchArgs { pids, duration, json, slow_io_ms }))
        }
        Cmd::Doctor { json } => {
            let r = nantrace::doctor::run();
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                nantrace::doctor::print_human(&r);
            }
            Ok(())
        }
    }
}
