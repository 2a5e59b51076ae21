//! Finding a job's node bundles under a directory and reading them, one per node: bounded,
//! never through a link, each bundle bound to the name its node's agent gave it.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{JobReport, MAX_NODES};
use crate::merge::Node;

/// Directory entries looked at while finding bundles, at most.
const MAX_ENTRIES: usize = 200_000;

/// The node bundles under `dir`: `dir` itself when it is one, else its subdirectories to a
/// depth of 3 (`<job>/<incident>/<host>/`, or bundles copied by hand into one directory).
/// Symbolic links are not followed.
pub fn find_bundles(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if is_bundle(dir) {
        return Ok(vec![dir.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut seen = 0usize;
    let mut stack = vec![(dir.to_path_buf(), 0u32)];
    while let Some((d, depth)) = stack.pop() {
        let rd = match std::fs::read_dir(&d) {
            Ok(r) => r,
            Err(e) if depth == 0 => return Err(anyhow::anyhow!("{}: {e}", d.display())),
            Err(_) => continue,
        };
        for ent in rd.flatten() {
            seen += 1;
            anyhow::ensure!(seen <= MAX_ENTRIES, "{}: more than {MAX_ENTRIES} entries looked at; point nantrace at the job's incident directory", dir.display());
            // file_type() does not follow links: a link to a directory is skipped.
            if !ent.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let p = ent.path();
            // A copy in progress (`.<host>.tmp-...`) or anything hidden is not a node's bundle.
            if ent.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            if is_bundle(&p) {
                out.push(p);
                anyhow::ensure!(
                    out.len() <= MAX_NODES,
                    "{}: more than {MAX_NODES} node bundles",
                    dir.display()
                );
            } else if depth < 2 {
                stack.push((p, depth + 1));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn is_bundle(d: &Path) -> bool {
    std::fs::symlink_metadata(d.join("timeline.json")).is_ok_and(|m| m.is_file())
}

/// Whether `dir` holds node bundles rather than being one.
pub fn is_job_dir(dir: &Path) -> bool {
    !is_bundle(dir) && find_bundles(dir).is_ok_and(|b| !b.is_empty())
}

/// Up to this many nodes the job report reads every node whole and keeps everything (the
/// merged trace has every node's counters). Past it, a quiet node is read from its summary,
/// and of each node only the events the job's steps and the trace's evidence lanes need are
/// kept once its part is taken (its log lines, its trigger, anything not quiet); the node the
/// verdict names gets all of its events back.
pub const FULL_LANES_NODES: usize = 16;

/// Read and analyse the bundles under `dir`, one node's events in memory at a time: the
/// headers first (the job's clock and reference need no events), then each node (from its
/// summary or whole), its part of the report taken, what the job no longer needs let go.
pub fn from_dir(dir: &Path) -> anyhow::Result<(JobReport, Value, Vec<Node>)> {
    from_dir_using(dir, FULL_LANES_NODES, true)
}

/// [`from_dir`] with another node count than [`FULL_LANES_NODES`] past which summaries are
/// read and events let go (tests and benchmarks: the large-job path on a small job).
pub fn from_dir_past(
    dir: &Path,
    full_lanes: usize,
) -> anyhow::Result<(JobReport, Value, Vec<Node>)> {
    from_dir_using(dir, full_lanes, true)
}

/// How each node is read: from its summary (a quiet node's, usable) or whole.
enum Source {
    /// Its summary was usable when its header was read: read again when its turn comes
    /// (1024 summaries held at once took 1.5 GiB).
    Summary,
    Whole,
}

/// `full_lanes`: [`FULL_LANES_NODES`]; `summaries`: use the nodes' summaries where they may
/// stand for their timelines (past `full_lanes` only).
pub(super) fn from_dir_using(
    dir: &Path,
    full_lanes: usize,
    summaries: bool,
) -> anyhow::Result<(JobReport, Value, Vec<Node>)> {
    let dirs = find_bundles(dir)?;
    anyhow::ensure!(
        !dirs.is_empty(),
        "{}: no node bundle (a directory with timeline.json) in it or below it",
        dir.display()
    );
    // Decided on the bundles found (a node may have several): past it, heads keep only the
    // part of their snapshot the job-wide steps read.
    let thin = dirs.len() > full_lanes;
    let heads = read_heads(&dirs, summaries && thin, thin);
    anyhow::ensure!(
        !heads.is_empty(),
        "{}: none of the {} bundles could be read",
        dir.display(),
        dirs.len()
    );
    let groups = by_host(heads);
    let mut nodes: Vec<Node> = groups.iter().map(|g| combine_heads(g)).collect();
    // A node that dumped more than once is read whole (its dumps are put together).
    let how: Vec<Source> = groups
        .iter()
        .map(|g| match g.as_slice() {
            [(_, true)] => Source::Summary,
            _ => Source::Whole,
        })
        .collect();
    let clock = crate::merge::Clock::of(&mut nodes);
    let mut job = Job::default();
    for i in 0..nodes.len() {
        let skipped = clock.skipped.contains(&i);
        job.read(&clock, (&groups[i], &how[i]), &mut nodes[i], thin, skipped);
    }
    let mut merged = clock.assemble(&nodes, std::mem::take(&mut job.events));
    let mut r = super::build_from(&merged, &nodes, job.parts.clone());
    r.from_summaries = job.from_summaries;
    // The node the verdict names: read whole if it was read from its summary (its part taken
    // again, the report made again, once), and all its events back in the merged timeline.
    let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    let named = r
        .node
        .as_ref()
        .and_then(|n| names.iter().position(|x| x == n));
    if let Some(i) = named.filter(|i| thin && !clock.skipped.contains(i)) {
        let again = matches!(how[i], Source::Summary);
        if let Some(mut whole) = read_whole(&groups[i]) {
            whole.name.clone_from(&nodes[i].name);
            let (at, evs): (Vec<i128>, Vec<Value>) =
                clock.events_of(&mut whole).into_iter().unzip();
            let (part, evs) = super::NodePart::of(&whole, evs, (clock.t0, &clock.first_nan()));
            let mut all: Vec<(i128, Value)> = merged["events"]
                .as_array_mut()
                .map(std::mem::take)
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e["node"].as_str() != Some(whole.name.as_str()))
                .map(|e| (instant(&e), e))
                .collect();
            all.extend(at.into_iter().zip(evs));
            if again {
                job.parts[i] = part;
                whole.snapshot = thin_snapshot(&whole.snapshot);
                nodes[i] = whole;
            }
            merged = clock.assemble(&nodes, all);
            if again {
                r = super::build_from(&merged, &nodes, job.parts);
                r.from_summaries = job.from_summaries - 1;
            }
        }
    }
    Ok((r, merged, nodes))
}

/// The parts of the job report taken node by node, and the events kept for the job's
/// steps (its log lines, its hang, the merged trace).
#[derive(Default)]
struct Job {
    events: Vec<(i128, Value)>,
    parts: Vec<super::NodePart>,
    from_summaries: usize,
}

impl Job {
    /// One node: read (from its summary or whole), its part taken, its events kept (when
    /// `thin`, only those the job's steps and evidence lanes need).
    fn read(
        &mut self,
        clock: &crate::merge::Clock,
        (group, how): (&[(Node, bool)], &Source),
        node: &mut Node,
        thin: bool,
        skipped: bool,
    ) {
        let first_nan = clock.first_nan();
        let name = node.name.clone();
        let keep = |e: &Value| {
            !thin || e["source"] == "log" || e["source"] == "trigger" || !super::summary::quiet(e)
        };
        match how {
            Source::Summary if !skipped => {
                let dir = &group[0].0.dir;
                let Some(s) = super::summary::usable(dir) else {
                    crate::say!("nantrace: WARNING: {}: its summary changed since its header was read: its timeline is read", dir.display());
                    return self.read(clock, (group, &Source::Whole), node, thin, skipped);
                };
                *node = super::summary::node(dir, &s);
                node.name = name;
                let (at, evs): (Vec<i128>, Vec<Value>) = clock.events_of(node).into_iter().unzip();
                let (part, evs) =
                    super::NodePart::from_summary(&s, node, evs, (clock.t0, &first_nan));
                self.parts.push(part);
                self.events
                    .extend(at.into_iter().zip(evs).filter(|(_, e)| keep(e)));
                self.from_summaries += 1;
                return;
            }
            Source::Whole if !skipped => {
                if let Some(mut whole) = read_whole(group) {
                    whole.name = name;
                    *node = whole;
                }
            }
            _ => {}
        }
        let own = if skipped {
            Vec::new()
        } else {
            clock.events_of(node)
        };
        let (at, evs): (Vec<i128>, Vec<Value>) = own.into_iter().unzip();
        let (part, evs) = super::NodePart::of(node, evs, (clock.t0, &first_nan));
        self.parts.push(part);
        self.events.extend(
            at.into_iter()
                .zip(evs)
                .filter(|(_, e)| keep(e) && (!thin || !is_sample(e))),
        );
        if thin {
            node.snapshot = thin_snapshot(&node.snapshot);
        }
    }
}

/// An event's instant on the job's clock (its corrected `time`).
fn instant(e: &Value) -> i128 {
    e["time"]
        .as_str()
        .and_then(crate::clock::parse_rfc3339_ns)
        .unwrap_or(0)
}

/// The collectors' samples: most of a node's events, needed only by its own analysis and
/// its peer measures (taken while the node is read).
pub(super) fn is_sample(e: &Value) -> bool {
    matches!(
        e["source"].as_str(),
        Some("gpu" | "system" | "disk" | "net" | "job_procs")
    )
}

/// What the job-wide steps read of a node's snapshot once its part is taken: its GPUs (to
/// name the culprit's), its ranks' stacks and NCCL RAS's view (a hang), its scheduler.
pub(super) fn thin_snapshot(s: &Value) -> Value {
    if !s.is_object() {
        return s.clone();
    }
    // NCCL RAS's parsed view, not its raw output (up to 1 MiB).
    let mut ras = s["nccl_ras"].clone();
    if let Some(o) = ras.as_object_mut() {
        o.remove("output");
    }
    json!({ "gpu": s["gpu"], "stacks": s["stacks"], "scheduler": s["scheduler"], "network": { "job_sockets": s["network"]["job_sockets"] }, "nccl_ras": ras, "flight_recorder": crate::report::flight::thin(&s["flight_recorder"]) })
}

/// Each bundle's header and snapshot (no events), each file once (redteam4 D-8: 50
/// directories of hard links to one 7.5 MB bundle took 3 GB: a timeline already read under
/// another name is said and skipped), each bound to its directory's name.
fn read_heads(dirs: &[PathBuf], summaries: bool, thin: bool) -> Vec<(Node, bool)> {
    let mut nodes = Vec::new();
    let mut files = BTreeSet::new();
    for d in dirs {
        use std::os::unix::fs::MetadataExt as _;
        let file = std::fs::symlink_metadata(d.join("timeline.json"))
            .ok()
            .map(|m| (m.dev(), m.ino()));
        if file.is_some_and(|f| files.contains(&f)) {
            crate::say!(
                "nantrace: WARNING: {}: its timeline.json is a file already read (a hard link): skipped",
                d.display()
            );
            continue;
        }
        let summary = summaries.then(|| super::summary::usable(d)).flatten();
        let head = match &summary {
            Some(s) => Ok(super::summary::node(d, s)),
            None => crate::merge::load_head(d),
        };
        let summary = summary.is_some();
        match head {
            Ok(mut n) => match bound_to_its_directory(&n) {
                Ok(()) => {
                    // Recorded once accepted: a refused link under a wrong name does not
                    // hide the same file under its node's own name.
                    files.extend(file);
                    // The clock needs the header only.
                    n.timeline["events"] = json!([]);
                    if thin {
                        n.snapshot = thin_snapshot(&n.snapshot);
                    }
                    nodes.push((n, summary));
                }
                Err(why) => crate::say!("nantrace: WARNING: {}: not read: {why}", d.display()),
            },
            Err(e) => crate::say!("nantrace: WARNING: {}: not read: {e:#}", d.display()),
        }
    }
    nodes
}

/// A node's bundles read whole and made one node; `None` (said) when one can no longer be
/// read: the node then counts with its header only.
fn read_whole(group: &[(Node, bool)]) -> Option<Node> {
    let mut whole = Vec::with_capacity(group.len());
    for (h, _) in group {
        match crate::merge::load(&h.dir) {
            Ok(n) => whole.push(n),
            Err(e) => {
                crate::say!(
                    "nantrace: WARNING: {}: its events could not be read: {e:#}",
                    h.dir.display()
                );
                return None;
            }
        }
    }
    Some(combine(whole))
}

/// The header of a node that dumped several times, as [`combine`] makes it.
fn combine_heads(group: &[(Node, bool)]) -> Node {
    combine(
        group
            .iter()
            .map(|(n, _)| Node {
                name: n.name.clone(),
                dir: n.dir.clone(),
                timeline: n.timeline.clone(),
                snapshot: n.snapshot.clone(),
                correction_s: n.correction_s,
                uncertainty_s: n.uncertainty_s,
            })
            .collect(),
    )
}

/// A bundle in an incident of a job directory sits where its node's agent put it,
/// `<incident>/<host>[-N]/`: one whose claimed host differs from its directory's name was not
/// put there by that host's agent (redteam4 D-3: a directory `n3-3` claiming host n1 blamed
/// n1). Bundles elsewhere (copied by hand) are not bound to a name.
fn bound_to_its_directory(n: &Node) -> Result<(), String> {
    let Some(parent) = n.dir.parent() else {
        return Ok(());
    };
    if !parent.join("INCIDENT.json").is_file() {
        return Ok(());
    }
    let name = n
        .dir
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let claimed = crate::safefs::sanitize(
        n.timeline["host"]["hostname"].as_str().unwrap_or(""),
        "host",
    );
    // `<host>`, or `<host>-N` for its second and later dumps (a host may end in -12 itself).
    let ours = name == claimed
        || name
            .strip_prefix(claimed.as_str())
            .and_then(|r| r.strip_prefix('-'))
            .is_some_and(|k| !k.is_empty() && k.bytes().all(|c| c.is_ascii_digit()));
    if ours {
        Ok(())
    } else {
        Err(format!(
            "it claims host {:?} but lies in {name:?} of an incident: only that host's agent puts a bundle under its name",
            crate::term::clean(&claimed)
        ))
    }
}

/// A node that dumped twice in one incident (the job-wide dump another node asked for, then
/// its own trigger): one node, its bundles' events together (each once), its first trigger,
/// its first NaN, the newest accounting and snapshot.
#[cfg(test)]
pub(super) fn one_per_host(nodes: Vec<Node>) -> Vec<Node> {
    by_host(nodes.into_iter().map(|n| (n, false)).collect())
        .into_iter()
        .map(|g| combine(g.into_iter().map(|(n, _)| n).collect()))
        .collect()
}

/// The bundles of each host (by the host name they claim), each host's in trigger order.
fn by_host(nodes: Vec<(Node, bool)>) -> Vec<Vec<(Node, bool)>> {
    let mut by_host: BTreeMap<String, Vec<(Node, bool)>> = BTreeMap::new();
    for (n, s) in nodes {
        let host = n.timeline["host"]["hostname"]
            .as_str()
            .unwrap_or("")
            .to_string();
        by_host.entry(host).or_default().push((n, s));
    }
    by_host
        .into_values()
        .map(|mut group| {
            group.sort_by(|(a, _), (b, _)| {
                a.timeline["trigger"]["time"]
                    .as_str()
                    .unwrap_or("")
                    .cmp(b.timeline["trigger"]["time"].as_str().unwrap_or(""))
            });
            group
        })
        .collect()
}

/// One host's bundles (in trigger order) as one node.
fn combine(mut group: Vec<Node>) -> Node {
    if group.len() == 1 {
        return group.remove(0);
    }
    {
        let mut seen = BTreeSet::new();
        let mut events = Vec::new();
        for n in &group {
            for e in n.timeline["events"].as_array().into_iter().flatten() {
                let key = format!(
                    "{}|{}|{}|{}|{}",
                    e["time"], e["source"], e["pid"], e["line"], e["text"]
                );
                if seen.insert(key) {
                    events.push(e.clone());
                }
            }
        }
        events.sort_by(|a, b| {
            a["time"]
                .as_str()
                .unwrap_or("")
                .cmp(b["time"].as_str().unwrap_or(""))
        });
        let first_nan = group
            .iter()
            .filter_map(|n| {
                n.timeline["first_nan"]
                    .as_object()
                    .map(|_| n.timeline["first_nan"].clone())
            })
            .min_by(|a, b| {
                a["time"]
                    .as_str()
                    .unwrap_or("")
                    .cmp(b["time"].as_str().unwrap_or(""))
            });
        let dirs: Vec<String> = group.iter().map(|n| n.dir.display().to_string()).collect();
        let writers = crate::merge::union_kernel_writers(group.iter().map(|n| &n.timeline));
        let mut first = group.remove(0);
        let last = group.pop().unwrap_or_else(|| unreachable!("two or more"));
        first.timeline["events"] = Value::Array(events);
        first.timeline["first_nan"] = first_nan.unwrap_or(Value::Null);
        first.timeline["accounting"] = last.timeline["accounting"].clone();
        // Who wrote the kernel log lines, as every dump of the node checked them (a line only
        // the first dump's window held keeps its writer).
        if first.timeline["accounting"].is_object() {
            first.timeline["accounting"]["kernel_writers"] = writers;
        }
        first.timeline["bundles"] = json!(dirs);
        // The job's connections as any of its dumps listed them: the dump at the job's exit
        // has none left, the one at the NaN had them all (packet loss on n2 was blamed on n1
        // when only the last dump's list counted).
        let sockets = union_job_sockets(
            std::iter::once(&first.snapshot)
                .chain(group.iter().map(|n| &n.snapshot))
                .chain(std::iter::once(&last.snapshot)),
        );
        first.snapshot = last.snapshot;
        // A bundle's snapshot is its node's claim: anything but an object of objects is
        // left as it is (indexing a non-object would panic).
        if !sockets.is_empty()
            && first.snapshot.is_object()
            && (first.snapshot["network"].is_object() || first.snapshot["network"].is_null())
        {
            first.snapshot["network"]["job_sockets"] = Value::Array(sockets);
        }
        first
    }
}

/// The job's sockets over several snapshots of one node, each (local, remote) once, at most
/// as many as one snapshot may list.
fn union_job_sockets<'a>(snapshots: impl Iterator<Item = &'a Value>) -> Vec<Value> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for s in snapshots.flat_map(|s| s["network"]["job_sockets"].as_array().into_iter().flatten()) {
        if out.len() >= 4096 {
            break;
        }
        if seen.insert((s["local"].to_string(), s["remote"].to_string())) {
            out.push(s.clone());
        }
    }
    out
}
