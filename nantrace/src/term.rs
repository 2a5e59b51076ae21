//! What nantrace prints on its own stderr/stdout. Two rules (redteam 2.11, 3.4):
//! - a closed or broken stream (`nantrace run ... 2>&1 | head`) never panics nantrace: the
//!   write error is ignored, the session goes on and still writes its bundle;
//! - text that came from someone else (log lines, process names, kernel lines) is shown with
//!   control characters (ESC, CR, newlines, ...) escaped, so it cannot move the cursor, clear
//!   the screen or forge lines.
use std::io::Write as _;

/// `eprintln!` that ignores write errors (EPIPE on a closed stderr).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stderr().lock(), $($arg)*);
    }};
}

/// `println!` that ignores write errors (EPIPE on `nantrace report B | head`).
#[macro_export]
macro_rules! sayout {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stdout().lock(), $($arg)*);
    }};
}

/// `print!` (no newline) that ignores write errors.
/// A report in Markdown as plain text for a terminal: no `**` emphasis, no `\|`-style
/// escapes, no HTML entities (the text was made safe by `report::md` and `clean` first; on a
/// terminal nothing renders Markdown, so what those escapes protect is shown as itself).
pub fn plain(md: &str) -> String {
    let s = md.replace("**", "");
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\\' && it.peek().is_some_and(|n| "\\`*[]~|".contains(*n)) {
            out.extend(it.next());
        } else {
            out.push(c);
        }
    }
    out.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

/// A Markdown report to stdout: plain text when stdout is a terminal, Markdown otherwise
/// (a file or a pipe keeps what report.md holds).
pub fn print_report(md: &str) {
    use std::io::IsTerminal as _;
    let md = clean_lines(md);
    if std::io::stdout().is_terminal() {
        print_out(&plain(&md));
    } else {
        print_out(&md);
    }
}

pub fn print_out(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(s.as_bytes());
    let _ = o.flush();
}

/// Untrusted text for a terminal: control characters (C0, DEL, C1) become `\xNN` / `\n`,
/// `\r`, `\t`; everything else is kept. Lines stay lines: no embedded newline survives.
pub fn clean(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out
}

/// [`clean`] for multi-line text that nantrace made itself (a report): its own newlines stay.
pub fn clean_lines(s: &str) -> String {
    let mut out: String = s.split('\n').map(clean).collect::<Vec<_>>().join("\n");
    if s.ends_with('\n') && !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_markdown_report_reads_as_plain_text_on_a_terminal() {
        let md = "**PROBABLY THE MACHINE (GPU)**: job output: \\[rank0\\]: x \\| y \\*z\\* &lt;b&gt; a &amp;lt; b\n| a | b |";
        assert_eq!(
            super::plain(md),
            "PROBABLY THE MACHINE (GPU): job output: [rank0]: x | y *z* <b> a &lt; b\n| a | b |"
        );
    }
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(clean("\n# PWNED\n\x1b[2J"), "\\n# PWNED\\n\\x1b[2J");
        assert_eq!(clean("step 2 | loss: nan"), "step 2 | loss: nan");
        assert_eq!(clean("a\u{9b}b\u{7f}"), "a\\x9bb\\x7f");
        assert!(!clean("x\u{202e}y").contains('\u{202e}'));
    }
}
