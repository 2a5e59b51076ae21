//! The layers of docs/architecture.md, checked on the code itself: every `crate::module` a
//! source file names (outside comments and its test module) is of its own layer or one below,
//! and the modules never import each other in a circle. A change that makes the model call a
//! renderer, or the analysis call a command, fails here with the file and the import.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// docs/architecture.md's table: each top module of `nantrace/src` and its layer.
const LAYERS: &[(u8, &[&str])] = &[
    (
        0,
        &["clock", "term", "source", "safefs", "correlate", "privdrop"],
    ),
    (
        1,
        &[
            "classify", "joblog", "nanscan", "event", "decode", "tracefs", "klog", "probes",
            "collect", "stream",
        ],
    ),
    (2, &["recorder", "trigger"]),
    (3, &["bundle"]),
    (4, &["report", "merge", "jobreport"]),
    (5, &["export"]),
    (
        6,
        &[
            "session", "watch", "doctor", "agent", "demo", "cmd", "gpucheck", "benchkit",
        ],
    ),
];

/// Files that are rendering though they sit in an analysis module's folder.
const RENDERING: &[&str] = &["report/render.rs", "jobreport/render.rs"];

/// The crate's macros, named as `crate::say!`: not modules.
const MACROS: &[&str] = &["say", "sayout"];

fn layer_of(module: &str) -> Option<u8> {
    LAYERS
        .iter()
        .find(|(_, ms)| ms.contains(&module))
        .map(|(l, _)| *l)
}

/// The code of a file without its comments and without its `#[cfg(test)]` module (tests may
/// build their input from any layer).
fn code(text: &str) -> String {
    let cut = text
        .find("#[cfg(test)]\nmod ")
        .or_else(|| text.find("#[cfg(test)]\npub(crate) mod "))
        .unwrap_or(text.len());
    text[..cut]
        .lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn sources(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, root, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            out.push((rel, std::fs::read_to_string(&p).unwrap()));
        }
    }
}

#[test]
fn the_layers_import_downwards_only_and_in_no_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    assert!(files.len() > 50, "the sources were found: {}", files.len());
    let mut upward = Vec::new();
    let mut unknown = BTreeSet::new();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (path, text) in &files {
        let name = path.rsplit('/').next().unwrap();
        if path == "lib.rs" || path == "main.rs" || name.contains("tests") {
            continue;
        }
        let top = path.split('/').next().unwrap().trim_end_matches(".rs");
        let Some(mut layer) = layer_of(top) else {
            unknown.insert(format!("{path}: module {top} is in no layer"));
            continue;
        };
        if RENDERING.contains(&path.as_str()) {
            layer = 5;
        }
        for to in &imports(path, &code(text)) {
            let to = to.as_str();
            if to == top || MACROS.contains(&to) {
                continue;
            }
            let Some(l) = layer_of(to) else {
                unknown.insert(format!("{path}: crate::{to} is in no layer"));
                continue;
            };
            edges
                .entry(top.to_string())
                .or_default()
                .insert(to.to_string());
            if l > layer {
                upward.push(format!(
                    "{path} (layer {layer}) uses crate::{to} (layer {l})"
                ));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "put these in LAYERS here and in docs/architecture.md: {unknown:#?}"
    );
    upward.sort();
    upward.dedup();
    assert!(upward.is_empty(), "imports that climb: {upward:#?}");
    // No circle among the modules (within a layer too): a depth-first walk.
    fn walk<'a>(
        m: &'a str,
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        circles: &mut Vec<String>,
    ) {
        if let Some(i) = path.iter().position(|p| *p == m) {
            circles.push(format!("{} -> {m}", path[i..].join(" -> ")));
            return;
        }
        if !done.insert(m) {
            return;
        }
        path.push(m);
        for n in edges.get(m).into_iter().flatten() {
            walk(n, edges, path, done, circles);
        }
        path.pop();
    }
    let mut circles = Vec::new();
    let mut done = BTreeSet::new();
    for m in edges.keys() {
        walk(m, &edges, &mut Vec::new(), &mut done, &mut circles);
    }
    assert!(
        circles.is_empty(),
        "modules importing each other: {circles:#?}"
    );
}

/// The top-level modules a source file at `path` (relative to src/) names: `crate::x`, each
/// of a grouped `crate::{x, y::z}`, and `super::` chains that climb to the crate's root from
/// a nested file (`super::super::x` in `report/detect/gpu.rs` is `crate::report::x`... and
/// one more `super` is `crate::x`).
fn imports(path: &str, code: &str) -> Vec<String> {
    let one = regex::Regex::new(r"\bcrate::([a-z_][a-z0-9_]*)").unwrap();
    let group = regex::Regex::new(r"\bcrate::\{([^}]*)\}").unwrap();
    let supers = regex::Regex::new(r"\b((?:super::)+)([a-z_][a-z0-9_]*)").unwrap();
    let mut out: Vec<String> = one.captures_iter(code).map(|c| c[1].to_string()).collect();
    for c in group.captures_iter(code) {
        for item in c[1].split(',') {
            let first = item.trim().split("::").next().unwrap_or("").trim();
            if !first.is_empty()
                && first
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                out.push(first.to_string());
            }
        }
    }
    // The file's depth in modules: `a/b/c.rs` is crate::a::b::c (3), `a/mod.rs` crate::a (1).
    let parts: Vec<&str> = path.trim_end_matches(".rs").split('/').collect();
    let depth = parts.len() - usize::from(parts.last() == Some(&"mod"));
    for c in supers.captures_iter(code) {
        if c[1].len() / "super::".len() == depth {
            out.push(c[2].to_string());
        }
    }
    out
}

/// Function length is clippy's `too_many_lines` at clippy.toml's threshold, run by `cargo
/// xtask test`; silencing it anywhere counts as a breach (issue 32).
#[test]
fn no_function_length_lint_is_silenced() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    for crate_dir in [
        "nantrace/src",
        "nantrace-common/src",
        "nantrace-ebpf/src",
        "xtask/src",
    ] {
        sources(&root.join(crate_dir), root, &mut files);
    }
    assert!(
        files.len() > 50,
        "the sources were not found under {}",
        root.display()
    );
    let lint = ["too_many", "_lines"].concat();
    let silenced: Vec<&str> = files
        .iter()
        .filter(|(_, text)| {
            // In an `allow(...)` or `expect(...)` attribute, on one line or several.
            ["allow(", "expect("].iter().any(|a| {
                text.match_indices(a).any(|(i, _)| {
                    let rest = &text[i..];
                    rest[..rest.find(')').unwrap_or(rest.len())].contains(&lint)
                })
            })
        })
        .map(|(path, _)| path.as_str())
        .collect();
    assert!(
        silenced.is_empty(),
        "clippy::{lint} named (an allow or expect of it) in {silenced:?}"
    );
    let conf = std::fs::read_to_string(root.join("clippy.toml")).expect("clippy.toml");
    assert!(
        conf.contains("too-many-lines-threshold = 120"),
        "clippy.toml: {conf}"
    );
}

#[test]
fn the_checker_sees_an_import_that_climbs() {
    // The same reading on a made-up file: a model calling a renderer is found.
    let text = "use x;\n// crate::report in a comment is not an import\nfn f() { crate::export::html::render(); }\n#[cfg(test)]\nmod tests { use crate::agent; }\n";
    assert_eq!(imports("bundle.rs", &code(text)), ["export"]);
    assert!(layer_of("export").unwrap() > layer_of("bundle").unwrap());
    // Grouped, and climbing with `super::` from a nested file.
    let grouped = "use crate::{say, export::html, report};\n";
    assert_eq!(
        imports("bundle/load.rs", &code(grouped)),
        ["say", "export", "report"]
    );
    let climbing = "use super::super::export::html;\nuse super::Acc;\n";
    assert_eq!(imports("bundle/load.rs", &code(climbing)), ["export"]);
    assert_eq!(imports("bundle/x/mod.rs", &code(climbing)), ["export"]);
    assert!(imports("report/detect/gpu.rs", &code(climbing)).is_empty());
}
