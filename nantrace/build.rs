//! Embed the eBPF object built by `cargo xtask build-ebpf`, when it exists. Without it the CLI
//! still builds (unit tests, `snapshot`, `report` need no probes) and says how to build them.
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("nantrace.bpf.o");
    let src = std::env::var_os("NANTRACE_BPF_OBJ")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap())
                .join("../nantrace-ebpf/target/bpfel-unknown-none/release/nantrace")
        });
    println!("cargo:rerun-if-env-changed=NANTRACE_BPF_OBJ");
    println!("cargo:rerun-if-changed={}", src.display());
    match std::fs::read(&src) {
        Ok(bytes) => std::fs::write(&out, bytes).unwrap(),
        Err(_) => {
            println!("cargo:warning=eBPF object {} not found: probes will be unavailable (run `cargo xtask build`)", src.display());
            std::fs::write(&out, b"").unwrap();
        }
    }
}
