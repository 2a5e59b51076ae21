//! Golden files (`tests/golden/`): a rendering compared with the one recorded, or recorded
//! again with `NANTRACE_GOLDEN=update`.
use std::path::{Path, PathBuf};

pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// What may differ between two runs of the same rendering: the checkout's own path (a
/// bundle's directory is quoted in reports) and the machine's time zone (a reference's
/// local time: "2026-12-01 11:00:00 local, UTC+1"). Nothing else is normalised: the inputs
/// are frozen, so times and versions come from them.
pub fn normalize(s: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = root.parent().unwrap_or(root).display().to_string();
    static LOCAL: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d local, UTC[+-][0-9.]+").expect("pattern")
    });
    LOCAL
        .replace_all(&s.replace(&root, "<checkout>"), "<local time>")
        .into_owned()
}

/// The text of an HTML page: tags dropped, one line per block (scripts and styles kept as
/// text: the page's data is in them).
pub fn html_text(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => {
                in_tag = true;
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
            '>' if in_tag => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// One comparison; `Err` says where the two first differ.
pub fn check(name: &str, got: &str) -> Result<(), String> {
    let path = dir().join(name);
    let got = normalize(got);
    if std::env::var("NANTRACE_GOLDEN").is_ok_and(|v| v == "update") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &got).unwrap();
        return Ok(());
    }
    let want = std::fs::read_to_string(&path).map_err(|e| {
        format!("{name}: no golden file ({e}); record it with NANTRACE_GOLDEN=update")
    })?;
    if want == got {
        return Ok(());
    }
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let i = w
        .iter()
        .zip(&g)
        .position(|(a, b)| a != b)
        .unwrap_or(w.len().min(g.len()));
    let cut = |s: Option<&&str>| s.map_or("(none)".to_string(), |s| s.chars().take(300).collect());
    Err(format!(
        "{name}: line {} differs ({} lines recorded, {} now)\n  recorded: {}\n  now:      {}",
        i + 1,
        w.len(),
        g.len(),
        cut(w.get(i)),
        cut(g.get(i))
    ))
}

/// Every mismatch of a test, said together.
#[derive(Default)]
pub struct Mismatches(pub Vec<String>);

impl Mismatches {
    pub fn check(&mut self, name: &str, got: &str) {
        if let Err(e) = check(name, got) {
            self.0.push(e);
        }
    }

    /// A rendered file by its kind: report.html as its text, JSON pretty-printed (a diff
    /// then says which field), text as it is.
    pub fn check_file(&mut self, name: &str, kind: &str, bytes: &[u8]) {
        let text = String::from_utf8_lossy(bytes);
        match kind {
            "report.html" => self.check(&format!("{name}.txt"), &html_text(&text)),
            k if k.ends_with(".json") => {
                let v: serde_json::Value = serde_json::from_slice(bytes)
                    .unwrap_or_else(|e| serde_json::Value::String(format!("not JSON: {e}")));
                self.check(name, &(serde_json::to_string_pretty(&v).unwrap() + "\n"));
            }
            _ => self.check(name, &text),
        }
    }

    pub fn assert(self) {
        assert!(
            self.0.is_empty(),
            "{} rendering(s) differ from tests/golden/ (if meant: NANTRACE_GOLDEN=update, and commit the diff):\n{}",
            self.0.len(),
            self.0.join("\n")
        );
    }
}
