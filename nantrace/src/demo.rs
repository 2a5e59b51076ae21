//! `nantrace demo`: a tiny training job that ships with nantrace and really diverges.
//!
//! The job fits y = 3x + 1 by SGD in f32 with a learning-rate schedule that keeps growing (the
//! classic warmup bug). Past lr ≈ 2/E[x²] the weights blow up, the loss overflows to inf and
//! then becomes NaN (inf − inf): the NaN comes from the arithmetic, not from a print statement.
//! It logs like a real loop (step, loss, lr, a simulated fp16 loss scale with overflow
//! messages), forks a data-loader worker, and exits 1 when the loss is NaN.
use std::io::Write as _;
use std::time::Duration;

/// Scenarios: what fault (if any) is injected through real kernel mechanisms before the NaN.
pub const SCENARIOS: &[&str] = &["numeric", "xid"];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32) / ((1u64 << 24) as f32)
    }
}

/// The training loop (runs as the child `nantrace demo-train`).
pub fn train(scenario: &str, step_ms: u64) -> i32 {
    let me = std::env::current_exe().unwrap_or_else(|_| "nantrace".into());
    // A data-loader worker, as PyTorch's DataLoader forks them.
    let mut worker = std::process::Command::new(&me).arg("demo-worker").spawn().ok();
    let (mut w, mut b) = (0.0f32, 0.0f32);
    let mut lr = 0.01f32;
    let mut scale = 2048.0f32;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let out = std::io::stdout();
    let mut nan_steps = 0;
    println!("demo: fitting y = 3x + 1 with SGD (f32), lr warmup without a cap; scenario={scenario}");
    for step in 1..=400u32 {
        if step > 30 {
            lr *= 1.08;
        }
        let (mut gw, mut gb, mut loss) = (0.0f32, 0.0f32, 0.0f32);
        for _ in 0..32 {
            let x = rng.next() * 20.0 - 10.0;
            let y = 3.0 * x + 1.0 + (rng.next() - 0.5) * 0.1;
            let err = w * x + b - y;
            loss += err * err / 32.0;
            gw += 2.0 * err * x / 32.0;
            gb += 2.0 * err / 32.0;
        }
        // Simulated fp16 dynamic loss scaling: the scaled loss must fit in fp16.
        if (loss * scale).is_finite() && loss * scale > 65504.0 && scale > 1.0 {
            scale /= 2.0;
            println!("gradient overflow detected, ignoring gradient, setting loss scale to: {scale:.1}");
        }
        w -= lr * gw;
        b -= lr * gb;
        let mut l = out.lock();
        let _ = writeln!(l, "step {step} | loss {loss:.4} | lr {lr:.3e} | loss_scale {scale:.1} | grad_norm {:.3}", (gw * gw + gb * gb).sqrt());
        let _ = l.flush();
        drop(l);
        if scenario == "xid" && step == 60 {
            let line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=nantrace-demo, GPU has fallen off the bus. [INJECTED by nantrace demo --scenario xid]";
            match std::fs::write("/dev/kmsg", format!("{line}\n")) {
                Ok(()) => eprintln!("demo: INJECTED a fake NVRM Xid 79 line into the kernel log (/dev/kmsg)"),
                Err(e) => eprintln!("demo: could not inject the Xid line (/dev/kmsg: {e}); running as plain numeric divergence"),
            }
        }
        if loss.is_nan() {
            nan_steps += 1;
            if nan_steps >= 3 {
                eprintln!("RuntimeError: loss is NaN at step {step}, stopping training");
                if let Some(wk) = worker.as_mut() {
                    let _ = wk.kill();
                    let _ = wk.wait();
                }
                return 1;
            }
        }
        std::thread::sleep(Duration::from_millis(step_ms));
    }
    if let Some(wk) = worker.as_mut() {
        let _ = wk.kill();
        let _ = wk.wait();
    }
    0
}

/// The demo's data-loader worker: idles like a worker waiting for work, until killed.
pub fn worker() -> i32 {
    for _ in 0..600 {
        std::thread::sleep(Duration::from_millis(100));
    }
    0
}
