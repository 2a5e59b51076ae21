//! tracefs: where it is mounted, and the field layout of a tracepoint from its `format` file.
use std::path::{Path, PathBuf};

/// One field of a tracepoint record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    pub offset: u32,
    pub size: u32,
    /// `__data_loc` string: a u32 holding (len << 16 | offset) of the data.
    pub data_loc: bool,
}

/// Parsed `format` file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Format {
    pub id: Option<u32>,
    pub fields: Vec<Field>,
    /// The `print fmt:` line (it carries units: `total-vm=%lukB`).
    pub print_fmt: String,
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("tracepoint {0} not found in tracefs ({1})")]
    Missing(String, PathBuf),
    #[error("reading {0}: {1}")]
    Io(PathBuf, std::io::Error),
}

impl Format {
    /// Parse the text of a tracefs `format` file. Lines that are not fields are ignored.
    pub fn parse(text: &str) -> Self {
        let mut out = Format::default();
        for line in text.lines() {
            let line = line.trim();
            if let Some(id) = line.strip_prefix("ID:") {
                out.id = id.trim().parse().ok();
                continue;
            }
            if let Some(p) = line.strip_prefix("print fmt:") {
                out.print_fmt = p.trim().to_string();
                continue;
            }
            let Some(rest) = line.strip_prefix("field:") else {
                continue;
            };
            let mut decl = "";
            let (mut offset, mut size) = (None, None);
            for part in rest.split(';') {
                let part = part.trim();
                if let Some(v) = part.strip_prefix("offset:") {
                    offset = v.trim().parse().ok();
                } else if let Some(v) = part.strip_prefix("size:") {
                    size = v.trim().parse().ok();
                } else if !part.contains(':') && !part.is_empty() && decl.is_empty() {
                    decl = part;
                }
            }
            let (Some(offset), Some(size)) = (offset, size) else {
                continue;
            };
            // The name is the last token of the declaration (`__data_loc char[] msg`, `__u8 saddr[4]`), without `[..]`.
            let last = decl
                .rsplit(|c: char| c.is_whitespace() || c == '*')
                .next()
                .unwrap_or("");
            let name = last.split('[').next().unwrap_or("");
            if name.is_empty() {
                continue;
            }
            out.fields.push(Field {
                name: name.to_string(),
                offset,
                size,
                data_loc: decl.starts_with("__data_loc"),
            });
        }
        out
    }

    /// KiB per unit of `oom:mark_victim`'s memory fields. Kernels that added total_vm/anon_rss
    /// to the tracepoint (6.8+) store kB and print `total-vm=%lukB`; a format that prints
    /// no unit is taken as pages (4 KiB).
    pub fn oom_kb_per_unit(&self) -> u64 {
        if self.print_fmt.is_empty() || self.print_fmt.contains("kB") {
            1
        } else {
            4
        }
    }

    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }

    /// Offset of `name`, or `MISSING` when the running kernel does not have it.
    pub fn offset(&self, name: &str) -> u32 {
        self.field(name)
            .map_or(nantrace_common::MISSING, |f| f.offset)
    }
}

/// The tracefs mount point, mounting it at /sys/kernel/tracing when it is absent and we may.
pub fn root() -> Option<PathBuf> {
    for p in ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"] {
        if Path::new(p).join("events").is_dir() {
            return Some(PathBuf::from(p));
        }
    }
    let target = c"/sys/kernel/tracing";
    // SAFETY: plain mount(2) call with NUL-terminated strings; failure is reported by errno.
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    (rc == 0 && Path::new("/sys/kernel/tracing/events").is_dir())
        .then(|| PathBuf::from("/sys/kernel/tracing"))
}

/// Why [`root`] found no usable tracefs: mounted but unreadable (not root) is not "not
/// mounted" (redteam 6.14a).
pub fn why_unavailable() -> String {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mounted: Vec<&str> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "tracefs").then_some(dir)
        })
        .collect();
    // SAFETY: geteuid has no failure mode.
    let euid = unsafe { libc::geteuid() };
    match mounted.first() {
        Some(dir) => match std::fs::read_dir(Path::new(dir).join("events")) {
            Err(e) => format!(
                "tracefs is mounted at {dir} but not readable by uid {euid} ({e}): root is needed"
            ),
            Ok(_) => format!("tracefs is mounted at {dir} but has no events directory"),
        },
        None if euid == 0 => {
            "tracefs is not mounted and could not be mounted at /sys/kernel/tracing".into()
        }
        None => format!("tracefs is not mounted, and uid {euid} may not mount it: root is needed"),
    }
}

/// Read and parse `events/<group>/<name>/format` under `root`.
pub fn read_format(root: &Path, group: &str, name: &str) -> Result<Format, FormatError> {
    let path = root.join("events").join(group).join(name).join("format");
    match std::fs::read_to_string(&path) {
        Ok(t) => Ok(Format::parse(&t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(FormatError::Missing(format!("{group}:{name}"), path))
        }
        Err(e) => Err(FormatError::Io(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Recorded from 6.18's events/sched/sched_process_fork/format.
    const FORK: &str = "name: sched_process_fork\nID: 312\nformat:\n\
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\
\tfield:__data_loc char[] parent_comm;\toffset:8;\tsize:4;\tsigned:0;\n\
\tfield:pid_t parent_pid;\toffset:12;\tsize:4;\tsigned:1;\n\
\tfield:__data_loc char[] child_comm;\toffset:16;\tsize:4;\tsigned:0;\n\
\tfield:pid_t child_pid;\toffset:20;\tsize:4;\tsigned:1;\n\n\
print fmt: \"comm=%s pid=%d child_comm=%s child_pid=%d\", __get_str(parent_comm), REC->parent_pid, __get_str(child_comm), REC->child_pid\n";

    // 5.x layout of the same tracepoint: char arrays instead of __data_loc.
    const FORK_OLD: &str = "ID: 300\nformat:\n\
\tfield:char parent_comm[16];\toffset:8;\tsize:16;\tsigned:1;\n\
\tfield:pid_t parent_pid;\toffset:24;\tsize:4;\tsigned:1;\n\
\tfield:char child_comm[16];\toffset:28;\tsize:16;\tsigned:1;\n\
\tfield:pid_t child_pid;\toffset:44;\tsize:4;\tsigned:1;\n";

    #[test]
    fn parses_data_loc_and_plain_fields() {
        let f = Format::parse(FORK);
        assert_eq!(f.id, Some(312));
        assert_eq!(f.fields.len(), 6);
        let c = f.field("child_comm").unwrap();
        assert_eq!((c.offset, c.size, c.data_loc), (16, 4, true));
        assert_eq!(f.offset("child_pid"), 20);
        assert_eq!(f.offset("common_pid"), 4);
        assert_eq!(f.offset("nope"), nantrace_common::MISSING);
    }

    #[test]
    fn parses_older_array_layout() {
        let f = Format::parse(FORK_OLD);
        let c = f.field("child_comm").unwrap();
        assert_eq!((c.offset, c.size, c.data_loc), (28, 16, false));
        assert_eq!(f.offset("child_pid"), 44);
    }

    #[test]
    fn parses_pointer_and_array_declarations() {
        let f = Format::parse(
            "\tfield:const void * skbaddr;\toffset:8;\tsize:8;\tsigned:0;\n\
             \tfield:__u8 saddr_v6[16];\toffset:42;\tsize:16;\tsigned:0;\n\
             \tfield:broken line without offset;\n",
        );
        assert_eq!(f.offset("skbaddr"), 8);
        assert_eq!(f.offset("saddr_v6"), 42);
        assert_eq!(f.fields.len(), 2);
    }

    #[test]
    fn empty_or_garbage_input_gives_no_fields() {
        assert!(Format::parse("").fields.is_empty());
        assert!(Format::parse("\u{0}\u{1}garbage;;;").fields.is_empty());
    }
}
