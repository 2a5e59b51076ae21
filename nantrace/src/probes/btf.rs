//! Struct member offsets from the kernel's BTF (`/sys/kernel/btf/vmlinux`), for the `tp_btf`
//! programs: Rust eBPF cannot emit CO-RE relocations, so userspace looks the offsets up and
//! writes them into the probes' read-only config, as it does with tracefs format offsets.
//!
//! Hand-written rather than a crate: the reader needs only the type section's structs and
//! their members (about 100 lines), aya-obj keeps its member lists private, and the one BTF
//! crate that exposes them (btf-rs) is LGPL, which a statically linked MIT/Apache binary
//! shipped in a tarball cannot take on lightly.
use std::collections::HashMap;

const MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("not BTF data (bad magic or header)")]
    BadHeader,
    #[error("BTF data is truncated")]
    Truncated,
    #[error("unknown BTF kind {0}")]
    UnknownKind(u32),
    #[error("struct {0} is not in the kernel's BTF")]
    NoStruct(String),
    #[error("{0}.{1} is not in the kernel's BTF")]
    NoMember(String, String),
    #[error("{0}.{1} is {2} bytes, the probe reads {3}")]
    Size(String, String, u32, u32),
}

#[derive(Clone, Debug)]
struct Member {
    name: u32,
    ty: u32,
    bit_offset: u32,
    bitfield: bool,
}

#[derive(Clone, Debug)]
enum Ty {
    /// int, enum, float: a name (ints) and a size.
    Scalar {
        name: u32,
        size: u32,
    },
    Ptr(u32),
    Array {
        elem: u32,
        n: u32,
    },
    Aggregate {
        union: bool,
        name: u32,
        size: u32,
    },
    Typedef {
        name: u32,
        t: u32,
    },
    /// const / volatile / restrict / type tag: what it qualifies.
    Qual(u32),
    /// A function prototype: its parameters' types.
    Proto(Vec<u32>),
    Other,
}

/// Alias chains and nesting in real BTF are shallow; the bound turns a malformed cycle into
/// "not found" instead of a hang or a stack overflow.
const MAX_DEPTH: u32 = 32;

/// The parsed type section: every type's size rule, and structs by name.
pub struct Btf {
    types: Vec<Ty>,
    /// Members of every struct and union, by type id.
    members: HashMap<u32, Vec<Member>>,
    /// Named structs' type ids.
    structs: HashMap<String, u32>,
    /// The `btf_trace_<tracepoint>` typedefs (what a `tp_btf` program receives).
    tracepoints: HashMap<String, u32>,
    strings: Vec<u8>,
}

fn u16_at(d: &[u8], o: usize) -> Result<u16, BtfError> {
    d.get(o..o + 2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .ok_or(BtfError::Truncated)
}

fn u32_at(d: &[u8], o: usize) -> Result<u32, BtfError> {
    d.get(o..o + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(BtfError::Truncated)
}

impl Btf {
    pub fn from_sys_fs() -> std::io::Result<Result<Self, BtfError>> {
        Ok(Self::parse(&std::fs::read("/sys/kernel/btf/vmlinux")?))
    }

    pub fn parse(d: &[u8]) -> Result<Self, BtfError> {
        if u16_at(d, 0)? != MAGIC {
            return Err(BtfError::BadHeader);
        }
        let hdr_len = u32_at(d, 4)? as usize;
        let (type_off, type_len) = (u32_at(d, 8)? as usize, u32_at(d, 12)? as usize);
        let (str_off, str_len) = (u32_at(d, 16)? as usize, u32_at(d, 20)? as usize);
        let tys = d
            .get(hdr_len + type_off..hdr_len + type_off + type_len)
            .ok_or(BtfError::Truncated)?;
        let strings = d
            .get(hdr_len + str_off..hdr_len + str_off + str_len)
            .ok_or(BtfError::Truncated)?
            .to_vec();
        // Type id 0 is void.
        let mut types = vec![Ty::Other];
        let mut structs = HashMap::new();
        let mut tracepoints = HashMap::new();
        let mut all_members = HashMap::new();
        let mut o = 0;
        while o < tys.len() {
            let name = u32_at(tys, o)?;
            let info = u32_at(tys, o + 4)?;
            let size_or_type = u32_at(tys, o + 8)?;
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let kind_flag = info >> 31 == 1;
            o += 12;
            let ty = match kind {
                KIND_INT => {
                    o += 4;
                    Ty::Scalar {
                        name,
                        size: size_or_type,
                    }
                }
                KIND_PTR => Ty::Ptr(size_or_type),
                KIND_ARRAY => {
                    let t = Ty::Array {
                        elem: u32_at(tys, o)?,
                        n: u32_at(tys, o + 8)?,
                    };
                    o += 12;
                    t
                }
                KIND_STRUCT | KIND_UNION => {
                    let members = members_at(tys, o, vlen, kind_flag)?;
                    o += vlen * 12;
                    let id = types.len() as u32;
                    if kind == KIND_STRUCT && name != 0 {
                        // The first definition wins (vmlinux has one per name).
                        structs
                            .entry(cstr(&strings, name).to_string())
                            .or_insert(id);
                    }
                    all_members.insert(id, members);
                    Ty::Aggregate {
                        union: kind == KIND_UNION,
                        name,
                        size: size_or_type,
                    }
                }
                KIND_ENUM => {
                    o += vlen * 8;
                    Ty::Scalar {
                        name,
                        size: size_or_type,
                    }
                }
                KIND_ENUM64 => {
                    o += vlen * 12;
                    Ty::Scalar {
                        name,
                        size: size_or_type,
                    }
                }
                KIND_TYPEDEF => {
                    let n = cstr(&strings, name);
                    if let Some(tp) = n.strip_prefix("btf_trace_") {
                        tracepoints.insert(tp.to_string(), types.len() as u32);
                    }
                    Ty::Typedef {
                        name,
                        t: size_or_type,
                    }
                }
                KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    Ty::Qual(size_or_type)
                }
                KIND_FUNC_PROTO => {
                    let params = (0..vlen)
                        .map(|i| u32_at(tys, o + i * 8 + 4))
                        .collect::<Result<Vec<_>, _>>()?;
                    o += vlen * 8;
                    Ty::Proto(params)
                }
                KIND_VAR | KIND_DECL_TAG | KIND_DATASEC => {
                    o += if kind == KIND_DATASEC { vlen * 12 } else { 4 };
                    Ty::Other
                }
                // FWD (7), FUNC (12): nothing trailing.
                7 | 12 => Ty::Other,
                16 => Ty::Scalar {
                    name,
                    size: size_or_type,
                },
                k => return Err(BtfError::UnknownKind(k)),
            };
            types.push(ty);
        }
        Ok(Self {
            types,
            members: all_members,
            structs,
            tracepoints,
            strings,
        })
    }

    fn size_of(&self, id: u32, depth: u32) -> u32 {
        if depth > MAX_DEPTH {
            return 0;
        }
        match self.types.get(id as usize) {
            Some(Ty::Scalar { size, .. } | Ty::Aggregate { size, .. }) => *size,
            Some(Ty::Ptr(_)) => 8,
            Some(Ty::Typedef { t, .. } | Ty::Qual(t)) => self.size_of(*t, depth + 1),
            Some(Ty::Array { elem, n }) => self.size_of(*elem, depth + 1).saturating_mul(*n),
            _ => 0,
        }
    }

    /// A type as C writes it, qualifiers left out: `struct request *`, `blk_status_t`, `int`.
    fn describe(&self, id: u32, depth: u32) -> String {
        if depth > MAX_DEPTH {
            return "?".into();
        }
        match self.types.get(id as usize) {
            Some(Ty::Scalar { name, .. } | Ty::Typedef { name, .. }) => {
                cstr(&self.strings, *name).to_string()
            }
            Some(Ty::Aggregate { union, name, .. }) => format!(
                "{} {}",
                if *union { "union" } else { "struct" },
                cstr(&self.strings, *name)
            ),
            Some(Ty::Ptr(t)) => format!("{} *", self.describe(*t, depth + 1)),
            Some(Ty::Qual(t)) => self.describe(*t, depth + 1),
            None if id == 0 => "void".into(),
            _ => "?".into(),
        }
    }

    /// The arguments a `tp_btf` program on `tracepoint` receives (the `btf_trace_<tp>`
    /// prototype without its leading `void *`), or `None` when the kernel does not have it.
    pub fn tracepoint_args(&self, tracepoint: &str) -> Option<Vec<String>> {
        let mut id = *self.tracepoints.get(tracepoint)?;
        for _ in 0..MAX_DEPTH {
            match self.types.get(id as usize)? {
                Ty::Typedef { t, .. } | Ty::Ptr(t) | Ty::Qual(t) => id = *t,
                Ty::Proto(params) => {
                    return Some(
                        params
                            .iter()
                            .skip(1)
                            .map(|p| self.describe(*p, 0))
                            .collect(),
                    )
                }
                _ => return None,
            }
        }
        None
    }

    /// `Ok` when `tracepoint`'s arguments start with `want` (what the program reads), else
    /// what the kernel has: a different prototype means other arguments in other places.
    pub fn check_args(&self, tracepoint: &str, want: &[&str]) -> Result<(), String> {
        let got = self
            .tracepoint_args(tracepoint)
            .ok_or_else(|| format!("no btf_trace_{tracepoint} in the kernel's BTF"))?;
        if got.len() >= want.len() && got.iter().zip(want).all(|(g, w)| g == w) {
            Ok(())
        } else {
            Err(format!(
                "{tracepoint} passes ({}), the BTF program reads ({})",
                got.join(", "),
                want.join(", ")
            ))
        }
    }

    /// Byte offset of `strukt.member`, checked to be `size` bytes wide and not a bitfield.
    /// A member inside an anonymous struct or union is found too.
    pub fn offset(&self, strukt: &str, member: &str, size: u32) -> Result<u32, BtfError> {
        let members = self
            .structs
            .get(strukt)
            .and_then(|id| self.members.get(id))
            .ok_or_else(|| BtfError::NoStruct(strukt.into()))?;
        let (bits, ty) = self
            .find(members, member, 0, 0)
            .ok_or_else(|| BtfError::NoMember(strukt.into(), member.into()))?;
        let got = self.size_of(ty, 0);
        if got != size || bits % 8 != 0 {
            return Err(BtfError::Size(strukt.into(), member.into(), got, size));
        }
        Ok(bits / 8)
    }

    fn find(&self, members: &[Member], want: &str, base: u32, depth: u32) -> Option<(u32, u32)> {
        if depth > MAX_DEPTH {
            return None;
        }
        for m in members {
            if m.bitfield {
                continue;
            }
            if m.name != 0 {
                if cstr(&self.strings, m.name) == want {
                    return Some((base + m.bit_offset, m.ty));
                }
                continue;
            }
            // Anonymous struct/union: look inside, offsets relative to it.
            let mut id = m.ty;
            for _ in 0..MAX_DEPTH {
                match self.types.get(id as usize) {
                    Some(Ty::Typedef { t, .. } | Ty::Qual(t)) => id = *t,
                    _ => break,
                }
            }
            if let Some(inner) = self.members.get(&id) {
                if let Some(hit) = self.find(inner, want, base + m.bit_offset, depth + 1) {
                    return Some(hit);
                }
            }
        }
        None
    }
}

fn cstr(strings: &[u8], off: u32) -> &str {
    let s = strings.get(off as usize..).unwrap_or(&[]);
    let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
    std::str::from_utf8(&s[..end]).unwrap_or("")
}

/// A struct's or union's `vlen` members at `o` (12 bytes each: name, type, offset; with
/// `kind_flag` the offset's top byte is a bitfield's size).
fn members_at(tys: &[u8], o: usize, vlen: usize, kind_flag: bool) -> Result<Vec<Member>, BtfError> {
    let mut members = Vec::with_capacity(vlen);
    for i in 0..vlen {
        let m = o + i * 12;
        let off = u32_at(tys, m + 8)?;
        let (bit_offset, bitfield) = if kind_flag {
            (off & 0x00ff_ffff, off >> 24 != 0)
        } else {
            (off, false)
        };
        members.push(Member {
            name: u32_at(tys, m)?,
            ty: u32_at(tys, m + 4)?,
            bit_offset,
            bitfield,
        });
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob with: 1 = int (4 bytes), 2 = u64 int, 3 = ptr to 1, 4 = typedef pid_t -> 1,
    /// 5 = struct task { pid_t pid @0; u64 start @64 bits; int *p @128 bits; bitfield @192;
    /// union { u64 inner; } @256 }, 6 = that anonymous union, 7 = struct task *, 8 = void *,
    /// 9 = proto (void *, struct task *, int), 10 = ptr to 9, 11 = typedef btf_trace_demo,
    /// 12/13 = a typedef cycle, 14 = struct cyc { loop x; }, then an enum64, a decl tag and a
    /// datasec (kinds the reader only skips).
    fn blob() -> Vec<u8> {
        let strings = b"\0int\0u64\0pid_t\0task\0pid\0start\0p\0bits\0inner\0btf_trace_demo\0loop\0loop2\0cyc\0x\0e64\0tag\0.data\0".to_vec();
        let s = |name: &str| -> u32 {
            let pat = format!("\0{name}\0");
            strings
                .windows(pat.len())
                .position(|w| w == pat.as_bytes())
                .unwrap() as u32
                + 1
        };
        let mut t: Vec<u8> = Vec::new();
        let mut push = |v: &[u32]| {
            for x in v {
                t.extend_from_slice(&x.to_le_bytes());
            }
        };
        push(&[s("int"), KIND_INT << 24, 4, 32]);
        push(&[s("u64"), KIND_INT << 24, 8, 64]);
        push(&[0, KIND_PTR << 24, 1]);
        push(&[s("pid_t"), KIND_TYPEDEF << 24, 1]);
        push(&[s("task"), (1 << 31) | (KIND_STRUCT << 24) | 5, 40]);
        push(&[s("pid"), 4, 0]);
        push(&[s("start"), 2, 64]);
        push(&[s("p"), 3, 128]);
        push(&[s("bits"), 1, (3 << 24) | 192]);
        push(&[0, 6, 256]);
        push(&[0, (KIND_UNION << 24) | 1, 8]);
        push(&[s("inner"), 2, 0]);
        push(&[0, KIND_PTR << 24, 5]);
        push(&[0, KIND_PTR << 24, 0]);
        push(&[0, (KIND_FUNC_PROTO << 24) | 3, 0]);
        push(&[0, 8, 0, 7, 0, 1]);
        push(&[0, KIND_PTR << 24, 9]);
        push(&[s("btf_trace_demo"), KIND_TYPEDEF << 24, 10]);
        push(&[s("loop"), KIND_TYPEDEF << 24, 13]);
        push(&[s("loop2"), KIND_TYPEDEF << 24, 12]);
        push(&[s("cyc"), (KIND_STRUCT << 24) | 1, 4]);
        push(&[s("x"), 12, 0]);
        push(&[s("e64"), (KIND_ENUM64 << 24) | 1, 8]);
        push(&[s("x"), 1, 0]);
        push(&[s("tag"), KIND_DECL_TAG << 24, 5, 0]);
        push(&[s(".data"), (KIND_DATASEC << 24) | 1, 8]);
        push(&[1, 0, 8]);
        let mut d = Vec::new();
        d.extend_from_slice(&MAGIC.to_le_bytes());
        d.extend_from_slice(&[1, 0]);
        for x in [
            24u32,
            0,
            t.len() as u32,
            t.len() as u32,
            strings.len() as u32,
        ] {
            d.extend_from_slice(&x.to_le_bytes());
        }
        d.extend_from_slice(&t);
        d.extend_from_slice(&strings);
        d
    }

    #[test]
    fn tracepoint_prototypes_are_read_and_checked() {
        let b = Btf::parse(&blob()).unwrap();
        assert_eq!(
            b.tracepoint_args("demo"),
            Some(vec!["struct task *".to_string(), "int".to_string()])
        );
        assert_eq!(b.check_args("demo", &["struct task *"]), Ok(()));
        assert!(b
            .check_args("demo", &["struct request *"])
            .unwrap_err()
            .contains("passes (struct task *, int)"));
        assert!(b
            .check_args("demo", &["struct task *", "int", "int"])
            .is_err());
        assert!(b
            .check_args("absent", &["int"])
            .unwrap_err()
            .contains("no btf_trace_absent"));
    }

    #[test]
    fn a_typedef_cycle_is_a_refusal_not_a_hang() {
        let b = Btf::parse(&blob()).unwrap();
        assert_eq!(
            b.offset("cyc", "x", 4),
            Err(BtfError::Size("cyc".into(), "x".into(), 0, 4))
        );
    }

    #[test]
    fn offsets_sizes_and_refusals() {
        let b = Btf::parse(&blob()).unwrap();
        assert_eq!(b.offset("task", "pid", 4), Ok(0));
        assert_eq!(b.offset("task", "start", 8), Ok(8));
        assert_eq!(b.offset("task", "p", 8), Ok(16));
        assert_eq!(b.offset("task", "inner", 8), Ok(32));
        assert_eq!(
            b.offset("task", "pid", 8),
            Err(BtfError::Size("task".into(), "pid".into(), 4, 8))
        );
        assert_eq!(
            b.offset("task", "bits", 4),
            Err(BtfError::NoMember("task".into(), "bits".into()))
        );
        assert_eq!(
            b.offset("task", "nope", 4),
            Err(BtfError::NoMember("task".into(), "nope".into()))
        );
        assert_eq!(
            b.offset("request", "q", 8),
            Err(BtfError::NoStruct("request".into()))
        );
    }

    #[test]
    fn truncated_and_foreign_data_are_errors_not_panics() {
        let d = blob();
        for cut in [0, 1, 3, 10, 24, 30, d.len() - 1] {
            assert!(Btf::parse(&d[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(
            Btf::parse(b"\x7fELF............................").err(),
            Some(BtfError::BadHeader)
        );
    }

    /// The running kernel's BTF, where there is one: the members the probes read exist.
    #[test]
    fn the_running_kernels_btf_has_what_the_probes_read() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("SKIP: no /sys/kernel/btf/vmlinux on this machine");
            return;
        };
        let b = Btf::parse(&data).unwrap();
        assert!(b.offset("task_struct", "pid", 4).is_ok());
        assert!(b.offset("task_struct", "tgid", 4).is_ok());
        assert!(b.offset("request", "__sector", 8).is_ok());
        assert!(b.offset("request", "start_time_ns", 8).is_ok());
        for (tp, args) in super::super::BTF_ARGS {
            assert_eq!(b.check_args(tp, args), Ok(()), "{tp}");
        }
    }
}
