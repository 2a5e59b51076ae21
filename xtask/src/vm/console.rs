//! What a guest's serial console says when the guest did not finish.
use std::fmt::Write as _;

/// The serial console of a guest that did not finish: the first line of a kernel oops and
/// the lines that say where (`BUG:`, `Oops:`, `RIP:`, `Call Trace:` and the frames after it),
/// then the last lines. The tail alone ends with the panic and loses its cause.
pub(super) fn story(serial: &str) -> String {
    let lines: Vec<&str> = serial.lines().collect();
    let cut = |l: &str| -> String { l.chars().take(200).collect() };
    let mut out = String::new();
    let first = [
        "BUG:",
        "Oops:",
        "kernel BUG at",
        "general protection fault",
        "WARNING:",
        "invalid opcode:",
        "int3:",
    ];
    // An oops or a BUG first; a WARNING (often harmless, early in boot) only without one.
    let fatal = |l: &&str| {
        first
            .iter()
            .filter(|m| **m != "WARNING:")
            .any(|m| l.contains(m))
    };
    if let Some(i) = lines
        .iter()
        .position(fatal)
        .or_else(|| lines.iter().position(|l| l.contains("WARNING:")))
    {
        out.push_str("; the kernel's first complaint:");
        let mut frames = 0;
        for l in &lines[i..lines.len().min(i + 40)] {
            let keep = first.iter().any(|m| l.contains(m))
                || ["RIP:", "Call Trace:", "Comm:", "Code:"]
                    .iter()
                    .any(|m| l.contains(m))
                || (l.contains(" ? ") || l.contains("+0x")) && frames < 8;
            if keep {
                if l.contains("+0x") && !l.contains("RIP:") {
                    frames += 1;
                }
                let _ = write!(out, "\n      {}", cut(l));
            }
        }
    }
    let tail: Vec<&str> = lines
        .iter()
        .rev()
        .take(8)
        .copied()
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let _ = write!(
        out,
        "\n    serial console ends:\n      {}",
        tail.iter()
            .map(|l| cut(l))
            .collect::<Vec<_>>()
            .join("\n      ")
    );
    out
}

/// The emulator's own failures, named, that a guest may die of: TCG executing an `int3` that
/// the guest kernel left while patching a jump label or a static call (the oops seen under
/// multi-threaded TCG on 6.12 and 6.18, 2026-12-01; docs/kernel-matrix.md). Only a guest that
/// died of one of these boots again and may be reported FLAKY; a hang, a timeout or a wrong
/// answer is a failure.
pub(super) fn emulator_signature(serial: &str) -> Option<&'static str> {
    serial
        .lines()
        .any(|l| l.contains("Oops: int3"))
        .then_some("Oops: int3 (TCG and a patched jump label)")
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_the_named_emulator_oops_is_a_signature() {
        assert!(
            super::emulator_signature("[ 185.39] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n")
                .is_some()
        );
        assert!(super::emulator_signature("[ 9.0] nantrace: kernel log source check\n").is_none());
        assert!(super::emulator_signature("[ 9.0] BUG: unable to handle page fault\n").is_none());
    }

    /// The end of the serial console of CI's 6.12 guest that panicked (2026-12-01), with a
    /// made-up head: the oops line and the RIP come out, the register dump does not.
    #[test]
    fn the_oops_comes_before_the_tail() {
        let serial = "[  180.1] nantrace: kernel log source check\n[  185.39] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n[  185.39] CPU: 1 UID: 0 PID: 812 Comm: kernel_events-5 Not tainted 6.12.117+deb13-amd64 #1\n[  185.393939] RIP: 0010:copy_process+0x2367/0x2740\n[  185.394057] RSP: 0018:ff65c71b82297c20 EFLAGS: 00000282\n[  185.394092] RAX: 0000000000000000 RBX: 00000000ffffffff RCX: 0000000000000000\n[  185.39] Call Trace:\n[  185.39]  <TASK>\n[  185.39]  ? die+0x36/0x90\n[  185.39]  kernel_clone+0xbd/0x3f0\n[  185.394625] Kernel panic - not syncing: Fatal exception in interrupt\n";
        let s = super::story(serial);
        let (head, tail) = s.split_once("serial console ends:").unwrap();
        assert!(
            head.contains("Oops: int3")
                && head.contains("RIP: 0010:copy_process+0x2367")
                && head.contains("kernel_clone+0xbd"),
            "{s}"
        );
        assert!(!head.contains("RAX:"), "{s}");
        assert!(
            tail.trim_end().ends_with("Fatal exception in interrupt"),
            "{s}"
        );
        assert_eq!(
            super::story("[ 1.0] a\n[ 2.0] b\n"),
            "\n    serial console ends:\n      [ 1.0] a\n      [ 2.0] b"
        );
        // A harmless early WARNING does not hide the later oops.
        let s = super::story(&format!(
            "[ 0.5] WARNING: CPU: 0 PID: 1 at arch/x86/kernel/fpu/xstate.c:800\n{serial}"
        ));
        assert!(
            s.starts_with("; the kernel's first complaint:\n      [  185.39] Oops: int3"),
            "{s}"
        );
    }
}
