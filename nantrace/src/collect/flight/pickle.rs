//! A decoder of the pickles torch's own C++ Pickler writes for Flight Recorder dumps
//! (protocol 2: plain opcodes, memo references; `torch/csrc/jit/serialization/pickler.cpp`).
//! Only the opcodes such data needs; anything else (GLOBAL, REDUCE, BUILD: objects, code)
//! is refused by name. The input is the job's file, hostile: bounded in size, in MARK depth,
//! in the objects it creates and in the values it materialises (a memo reference expanded is
//! counted each time, so a small file of shared references cannot blow up), never a panic.
//!
//! Objects live in an arena while the opcodes run (a memoised list filled after its BINPUT is
//! the same list when fetched again, as in Python); the result is materialised once, at STOP.
use std::collections::HashMap;

/// The largest input decoded.
pub const INPUT_MAX: usize = 16 << 20;
/// The most objects the opcodes may create.
const NODES_MAX: usize = 2_000_000;
/// The most values materialised in the result (memo references counted each time).
pub const VALUES_MAX: usize = 2_000_000;
/// The most bytes of text and bytes materialised in the result.
const TEXT_MAX: usize = 64 << 20;
/// The deepest nesting, of MARKs while decoding and of containers in the result.
pub const DEPTH_MAX: usize = 64;

/// A Python value as the pickle holds it.
#[derive(Clone, Debug, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i64),
    /// An integer beyond 64 bits: its byte length only.
    BigInt(usize),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    /// Keys and values in the order the pickle set them.
    Dict(Vec<(Py, Py)>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("{0} bytes: over the {INPUT_MAX}-byte limit")]
    TooBig(usize),
    #[error("cut short at byte {0}")]
    Truncated(usize),
    #[error("opcode {name} (0x{op:02x}) at byte {at}: not one of a Flight Recorder dump's")]
    Refused {
        op: u8,
        name: &'static str,
        at: usize,
    },
    #[error("{0} at byte {1}")]
    Malformed(&'static str, usize),
    #[error("over the limit of {0}")]
    Limit(&'static str),
    #[error("no STOP opcode")]
    NoStop,
}

impl Py {
    /// The value of `key` in a dict whose keys are text.
    pub fn get(&self, key: &str) -> Option<&Py> {
        match self {
            Py::Dict(kv) => kv
                .iter()
                .find(|(k, _)| matches!(k, Py::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Py::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Py::Int(i) => Some(*i),
            Py::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Py::Bool(b) => Some(*b),
            Py::Int(i) => Some(*i != 0),
            _ => None,
        }
    }

    /// The items of a list or a tuple.
    pub fn items(&self) -> &[Py] {
        match self {
            Py::List(v) | Py::Tuple(v) => v,
            _ => &[],
        }
    }

    /// As JSON, the way Python's `json` writes what `pickle.load` read (tuples as lists,
    /// keys as text, bytes as `{"bytes": hex}`): what the tests compare with.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::{json, Value};
        match self {
            Py::None => Value::Null,
            Py::Bool(b) => json!(b),
            Py::Int(i) => json!(i),
            Py::BigInt(n) => json!({ "bigint_bytes": n }),
            Py::Float(f) => json!(f),
            Py::Str(s) => json!(s),
            Py::Bytes(b) => {
                json!({ "bytes": b.iter().map(|x| format!("{x:02x}")).collect::<String>() })
            }
            Py::List(v) | Py::Tuple(v) => Value::Array(v.iter().map(Py::to_json).collect()),
            Py::Dict(kv) => Value::Object(
                kv.iter()
                    .map(|(k, v)| {
                        let k = match k {
                            Py::Str(s) => s.clone(),
                            Py::Int(i) => i.to_string(),
                            Py::None => "None".into(),
                            other => format!("{other:?}"),
                        };
                        (k, v.to_json())
                    })
                    .collect(),
            ),
        }
    }
}

/// An object of the arena: containers hold indices.
enum Node {
    Leaf(Py),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
}

#[derive(Clone, Copy)]
enum Item {
    Obj(usize),
    Mark,
}

struct Machine<'a> {
    b: &'a [u8],
    pos: usize,
    nodes: Vec<Node>,
    stack: Vec<Item>,
    memo: HashMap<u32, usize>,
    marks: usize,
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Error> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.b.len());
        let end = end.ok_or(Error::Truncated(self.b.len()))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> Result<u64, Error> {
        let s = self.take(n)?;
        Ok(s.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x)))
    }

    fn len(&mut self, n: usize) -> Result<usize, Error> {
        let at = self.pos;
        usize::try_from(self.uint(n)?).map_err(|_| Error::Malformed("a length past the input", at))
    }

    fn node(&mut self, n: Node) -> Result<usize, Error> {
        if self.nodes.len() >= NODES_MAX {
            return Err(Error::Limit("objects"));
        }
        self.nodes.push(n);
        Ok(self.nodes.len() - 1)
    }

    fn push(&mut self, n: Node) -> Result<(), Error> {
        let i = self.node(n)?;
        self.stack.push(Item::Obj(i));
        Ok(())
    }

    fn pop(&mut self, at: usize) -> Result<usize, Error> {
        match self.stack.pop() {
            Some(Item::Obj(i)) => Ok(i),
            Some(Item::Mark) => Err(Error::Malformed("a MARK where a value was expected", at)),
            None => Err(Error::Malformed("an empty stack", at)),
        }
    }

    /// The values above the topmost MARK, and the MARK removed.
    fn pop_mark(&mut self, at: usize) -> Result<Vec<usize>, Error> {
        let m = self
            .stack
            .iter()
            .rposition(|x| matches!(x, Item::Mark))
            .ok_or(Error::Malformed("no MARK", at))?;
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        self.marks = self.marks.saturating_sub(1);
        Ok(items
            .into_iter()
            .filter_map(|x| match x {
                Item::Obj(i) => Some(i),
                Item::Mark => None,
            })
            .collect())
    }

    fn text(&mut self, n: usize, at: usize) -> Result<(), Error> {
        let n = self.len(n)?;
        let s = self.take(n)?;
        let s =
            std::str::from_utf8(s).map_err(|_| Error::Malformed("text that is not UTF-8", at))?;
        let s = s.to_string();
        self.push(Node::Leaf(Py::Str(s)))
    }

    fn bytes(&mut self, n: usize) -> Result<(), Error> {
        let n = self.len(n)?;
        let s = self.take(n)?.to_vec();
        self.push(Node::Leaf(Py::Bytes(s)))
    }

    fn long(&mut self, n: usize) -> Result<(), Error> {
        let n = self.len(n)?;
        let s = self.take(n)?;
        let v = if n == 0 {
            Py::Int(0)
        } else if n <= 8 {
            // Little-endian two's complement, sign-extended from its top byte.
            let neg = s[n - 1] & 0x80 != 0;
            let mut buf = [if neg { 0xff } else { 0 }; 8];
            buf[..n].copy_from_slice(s);
            Py::Int(i64::from_le_bytes(buf))
        } else {
            Py::BigInt(n)
        };
        self.push(Node::Leaf(v))
    }

    fn put(&mut self, key: u32, at: usize) -> Result<(), Error> {
        match self.stack.last() {
            Some(Item::Obj(i)) => {
                if self.memo.len() >= NODES_MAX && !self.memo.contains_key(&key) {
                    return Err(Error::Limit("memo entries"));
                }
                self.memo.insert(key, *i);
                Ok(())
            }
            _ => Err(Error::Malformed("a memo put without a value", at)),
        }
    }

    fn get(&mut self, key: u32, at: usize) -> Result<(), Error> {
        let i = *self
            .memo
            .get(&key)
            .ok_or(Error::Malformed("a memo get of a key never put", at))?;
        self.stack.push(Item::Obj(i));
        Ok(())
    }

    fn setitems(&mut self, items: Vec<usize>, at: usize) -> Result<(), Error> {
        if items.len() % 2 != 0 {
            return Err(Error::Malformed("SETITEMS with an odd count", at));
        }
        let d = self.pop(at)?;
        let Node::Dict(kv) = &mut self.nodes[d] else {
            return Err(Error::Malformed(
                "SETITEM(S) on a value that is not a dict",
                at,
            ));
        };
        for p in items.chunks_exact(2) {
            kv.push((p[0], p[1]));
        }
        self.stack.push(Item::Obj(d));
        Ok(())
    }

    fn appends(&mut self, items: Vec<usize>, at: usize) -> Result<(), Error> {
        let l = self.pop(at)?;
        let Node::List(v) = &mut self.nodes[l] else {
            return Err(Error::Malformed(
                "APPEND(S) on a value that is not a list",
                at,
            ));
        };
        v.extend(items);
        self.stack.push(Item::Obj(l));
        Ok(())
    }

    fn tuple(&mut self, n: usize, at: usize) -> Result<(), Error> {
        if self.stack.len() < n {
            return Err(Error::Malformed(
                "a tuple of more values than the stack holds",
                at,
            ));
        }
        let items = self.stack.split_off(self.stack.len() - n);
        let items = items
            .into_iter()
            .map(|x| match x {
                Item::Obj(i) => Ok(i),
                Item::Mark => Err(Error::Malformed("a MARK inside a tuple", at)),
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.push(Node::Tuple(items))
    }

    /// One opcode; `Ok(true)` at STOP.
    fn step(&mut self) -> Result<bool, Error> {
        let at = self.pos;
        if self.stack.len() >= NODES_MAX {
            return Err(Error::Limit("stack depth"));
        }
        let op = self.take(1)?[0];
        match op {
            0x80 => {
                let v = self.take(1)?[0];
                if v > 5 {
                    return Err(Error::Malformed("a protocol past 5", at));
                }
            }
            0x95 => {
                self.take(8)?; // FRAME: a length hint
            }
            b'(' => {
                if self.marks >= DEPTH_MAX {
                    return Err(Error::Limit("MARK depth"));
                }
                self.marks += 1;
                self.stack.push(Item::Mark);
            }
            b'.' => return Ok(true),
            b'}' => self.push(Node::Dict(Vec::new()))?,
            b']' => self.push(Node::List(Vec::new()))?,
            b')' => self.push(Node::Tuple(Vec::new()))?,
            0x85 => self.tuple(1, at)?,
            0x86 => self.tuple(2, at)?,
            0x87 => self.tuple(3, at)?,
            b't' => {
                let items = self.pop_mark(at)?;
                self.push(Node::Tuple(items))?;
            }
            b'l' => {
                let items = self.pop_mark(at)?;
                self.push(Node::List(items))?;
            }
            b'd' => {
                let items = self.pop_mark(at)?;
                if items.len() % 2 != 0 {
                    return Err(Error::Malformed("DICT with an odd count", at));
                }
                let kv = items.chunks_exact(2).map(|p| (p[0], p[1])).collect();
                self.push(Node::Dict(kv))?;
            }
            b's' => {
                let v = self.pop(at)?;
                let k = self.pop(at)?;
                self.setitems(vec![k, v], at)?;
            }
            b'u' => {
                let items = self.pop_mark(at)?;
                self.setitems(items, at)?;
            }
            b'a' => {
                let v = self.pop(at)?;
                self.appends(vec![v], at)?;
            }
            b'e' => {
                let items = self.pop_mark(at)?;
                self.appends(items, at)?;
            }
            b'X' => self.text(4, at)?,
            0x8c => self.text(1, at)?,
            0x8d => self.text(8, at)?,
            b'B' => self.bytes(4)?,
            b'C' => self.bytes(1)?,
            0x8e => self.bytes(8)?,
            b'0' => {
                if let Item::Mark = self
                    .stack
                    .pop()
                    .ok_or(Error::Malformed("POP of an empty stack", at))?
                {
                    self.marks = self.marks.saturating_sub(1);
                }
            }
            b'2' => {
                let top = *self
                    .stack
                    .last()
                    .ok_or(Error::Malformed("DUP of an empty stack", at))?;
                // A copied MARK would leave the mark count behind the stack's marks.
                if matches!(top, Item::Mark) {
                    return Err(Error::Malformed("DUP of a MARK", at));
                }
                self.stack.push(top);
            }
            _ => self.scalar_or_memo(op, at)?,
        }
        Ok(false)
    }

    /// The numbers, constants and memo opcodes; anything else is refused by name.
    fn scalar_or_memo(&mut self, op: u8, at: usize) -> Result<(), Error> {
        match op {
            b'J' => {
                let v = self.uint(4)? as u32 as i32;
                self.push(Node::Leaf(Py::Int(i64::from(v))))?;
            }
            b'K' => {
                let v = self.uint(1)?;
                self.push(Node::Leaf(Py::Int(v as i64)))?;
            }
            b'M' => {
                let v = self.uint(2)?;
                self.push(Node::Leaf(Py::Int(v as i64)))?;
            }
            0x8a => self.long(1)?,
            0x8b => self.long(4)?,
            b'G' => {
                let s = self.take(8)?;
                let mut a = [0u8; 8];
                a.copy_from_slice(s);
                self.push(Node::Leaf(Py::Float(f64::from_be_bytes(a))))?;
            }
            b'N' => self.push(Node::Leaf(Py::None))?,
            0x88 => self.push(Node::Leaf(Py::Bool(true)))?,
            0x89 => self.push(Node::Leaf(Py::Bool(false)))?,
            b'q' => {
                let k = self.uint(1)? as u32;
                self.put(k, at)?;
            }
            b'r' => {
                let k = self.uint(4)? as u32;
                self.put(k, at)?;
            }
            0x94 => {
                let k = u32::try_from(self.memo.len()).map_err(|_| Error::Limit("memo entries"))?;
                self.put(k, at)?;
            }
            b'h' => {
                let k = self.uint(1)? as u32;
                self.get(k, at)?;
            }
            b'j' => {
                let k = self.uint(4)? as u32;
                self.get(k, at)?;
            }
            _ => {
                return Err(Error::Refused {
                    op,
                    name: op_name(op),
                    at,
                })
            }
        }
        Ok(())
    }

    /// The tree of `i`, counting each value made against the budgets.
    fn build(&self, i: usize, depth: usize, budget: &mut (usize, usize)) -> Result<Py, Error> {
        if depth > DEPTH_MAX {
            return Err(Error::Limit(
                "nesting depth (or a container that holds itself)",
            ));
        }
        budget.0 += 1;
        if budget.0 > VALUES_MAX {
            return Err(Error::Limit("values materialised"));
        }
        let kids = |ids: &[usize], budget: &mut (usize, usize)| {
            ids.iter()
                .map(|c| self.build(*c, depth + 1, budget))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(match &self.nodes[i] {
            Node::Leaf(p) => {
                let n = match p {
                    Py::Str(s) => s.len(),
                    Py::Bytes(b) => b.len(),
                    _ => 0,
                };
                budget.1 += n;
                if budget.1 > TEXT_MAX {
                    return Err(Error::Limit("text materialised"));
                }
                p.clone()
            }
            Node::List(v) => Py::List(kids(v, budget)?),
            Node::Tuple(v) => Py::Tuple(kids(v, budget)?),
            Node::Dict(kv) => {
                let mut out = Vec::with_capacity(kv.len());
                for (k, v) in kv {
                    out.push((
                        self.build(*k, depth + 1, budget)?,
                        self.build(*v, depth + 1, budget)?,
                    ));
                }
                Py::Dict(out)
            }
        })
    }
}

/// The name of an opcode refused (Python's pickletools names).
fn op_name(op: u8) -> &'static str {
    match op {
        b'c' => "GLOBAL",
        0x93 => "STACK_GLOBAL",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'i' => "INST",
        b'o' => "OBJ",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'I' => "INT",
        b'L' => "LONG",
        b'F' => "FLOAT",
        b'S' | b'T' | b'U' => "STRING",
        b'V' => "UNICODE",
        b'g' | b'p' => "GET/PUT (text)",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        b'1' => "POP_MARK",
        _ => "unknown",
    }
}

/// Decode one pickle.
pub fn decode(b: &[u8]) -> Result<Py, Error> {
    if b.len() > INPUT_MAX {
        return Err(Error::TooBig(b.len()));
    }
    let mut m = Machine {
        b,
        pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
        marks: 0,
    };
    while m.pos < b.len() {
        if m.step()? {
            let top = m.pop(m.pos)?;
            return m.build(top, 0, &mut (0, 0));
        }
    }
    Err(Error::NoStop)
}

#[cfg(test)]
#[path = "pickle_tests.rs"]
pub(crate) mod tests;
