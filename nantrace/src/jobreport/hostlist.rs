//! Slurm host lists (`gpu[01-04,07],login1`), as the bundles carry them.
use super::MAX_NODES;

/// Expand a Slurm host list (`gpu[01-04,07],login1`) into names, at most `MAX_NODES`.
pub fn expand_hostlist(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    // Split on commas outside brackets.
    let (mut depth, mut start) = (0i32, 0usize);
    let mut parts = Vec::new();
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    for p in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        let Some((prefix, rest)) = p.split_once('[') else {
            out.push(p.to_string());
            continue;
        };
        let Some((ranges, suffix)) = rest.split_once(']') else {
            continue;
        };
        for r in ranges.split(',') {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            let (Ok(x), Ok(y)) = (a.parse::<u64>(), b.parse::<u64>()) else {
                continue;
            };
            for k in x..=y.min(x + MAX_NODES as u64) {
                out.push(format!("{prefix}{k:0width$}{suffix}", width = a.len()));
                if out.len() >= MAX_NODES {
                    return out;
                }
            }
        }
    }
    out
}
