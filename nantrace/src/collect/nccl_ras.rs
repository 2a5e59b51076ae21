//! NCCL's RAS service asked for its view of the job at the trigger (snapshot.json
//! `nccl_ras`): NCCL >= 2.24 runs a RAS thread in every process of a job, and any of them
//! answers on localhost:28028 (the job's `NCCL_RAS_ADDR` moves it) with the job's processes and
//! every communicator's ranks that are INCOMPLETE (no answer), DEAD (unreachable for 60 s),
//! MISMATCH (a different status or a different count of launched operations) or in ERROR.
//! Only while the job is alive: taken at the trigger, with the stacks.
//!
//! The protocol is `ncclras`'s (src/ras/client.cc and `rasClientEventLoop` in
//! src/ras/client_support.cc of NVIDIA/nccl v2.30.7-1, 73cf1122): `CLIENT PROTOCOL 2` →
//! `SERVER PROTOCOL <n>`; `TIMEOUT <s>` → `OK` (how long NCCL waits for its peers);
//! `SET FORMAT json` → `OK` from 2.28.7 on (an `ERROR: ...` before: the text format); then
//! `VERBOSE STATUS`, answered until the server closes. Bounded: [`DEADLINE`] for all of it
//! (connecting, [`CONNECT_TIMEOUT`] per address, and every read), at most [`OUTPUT_MAX`] bytes
//! kept; a port nobody listens on, a server that never answers, and a cut output are said in
//! the section, never a silent gap.
//!
//! The port listens in the job's network namespace: the query runs on a short-lived thread
//! that enters it (`setns(CLONE_NEWNET)` on `/proc/<rank pid>/ns/net`, root's right) when it is
//! not nantrace's own, and ends with the query. Everything read is the job's own text (any
//! process of the job can listen there): kept cleaned and bounded, parsed into a typed
//! [`View`], never machine evidence.
//!
//! Tested: the exchange against an in-process fake server (nantrace/tests/nccl_ras.rs: JSON,
//! a server refusing `SET FORMAT`, one that never answers, one that stops mid-answer, a JSON
//! answer past [`OUTPUT_MAX`] (asked again in text), a refused port, and, as root, a server in another network namespace); the parsers on outputs
//! built from NCCL's format strings of 2.24.3 and 2.30.7 (nccl_ras/tests.rs). Not on a real
//! NCCL's output: no GPU machine has run one; the formats are read from NCCL's source only.
#[cfg(test)]
mod tests;
mod text;
mod view;

pub use text::from_text;
pub use view::{from_json, Comm, Format, Kind, ProcessIssue, RankIssue, View, Why};

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// NCCL's default RAS port (`NCCL_RAS_CLIENT_PORT`, src/ras/ras_internal.h).
pub const DEFAULT_PORT: u16 = 28028;
/// The client protocol `ncclras` speaks (`NCCL_RAS_CLIENT_PROTOCOL`, 2 in 2.24 to 2.30).
pub const CLIENT_PROTOCOL: u32 = 2;
/// What RAS is told to wait for the job's other processes (`TIMEOUT`): NCCL gives up on a
/// peer after this, and answers within it plus its own 5 s at worst.
pub const NCCL_TIMEOUT_S: u32 = 2;
/// The whole exchange, connect to close: past it, what was read is kept and the rest said.
pub const DEADLINE: Duration = Duration::from_secs(5);
/// One address's connect, at most.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The answer kept, at most. NCCL's JSON lists every rank (about 550 bytes each): a job of
/// some 2,000 ranks goes past it, and is then asked again in text, which names the outliers
/// only.
pub const OUTPUT_MAX: usize = 1 << 20;
/// A handshake line, at most (NCCL's client reads 1 KiB).
const LINE_MAX: usize = 1024;
/// An output line kept in the section, at most (characters).
const KEPT_LINE_MAX: usize = 512;

/// Where RAS listens, from the job's `NCCL_RAS_ADDR` (`host:port`, `[ipv6]:port`) or the
/// default. A host name other than localhost is not resolved (DNS from inside the job's
/// namespace, on its say-so): said instead.
pub fn addresses(ras_addr: Option<&str>) -> Result<Vec<SocketAddr>, String> {
    let Some(a) = ras_addr.map(str::trim) else {
        return Ok(localhost(DEFAULT_PORT));
    };
    let bad = || format!("NCCL_RAS_ADDR={:?} is not host:port", view::word(a, 80));
    let (h, port) = if let Some(rest) = a.strip_prefix('[') {
        let (h, p) = rest.split_once("]:").ok_or_else(bad)?;
        (h.split('%').next().unwrap_or(h), p)
    } else {
        a.rsplit_once(':').ok_or_else(bad)?
    };
    let port: u16 = port.parse().map_err(|_| bad())?;
    if h.eq_ignore_ascii_case("localhost") {
        return Ok(localhost(port));
    }
    match h.parse::<IpAddr>() {
        Ok(ip) => Ok(vec![SocketAddr::new(ip, port)]),
        Err(_) => Err(format!(
            "NCCL_RAS_ADDR={:?} names a host, not an address: nantrace does not resolve names inside the job's namespace",
            view::word(a, 80)
        )),
    }
}

/// `localhost` as NCCL's `getaddrinfo` may give it: IPv4 first, then IPv6 (as `ncclras` tries
/// every address).
fn localhost(port: u16) -> Vec<SocketAddr> {
    vec![
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port),
        SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), port),
    ]
}

/// One connection, every read and write within one deadline.
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
    deadline: Instant,
}

impl Conn {
    fn left(&self, what: &str) -> Result<Duration, String> {
        let d = self.deadline.saturating_duration_since(Instant::now());
        if d.is_zero() {
            return Err(format!("no answer before the deadline ({what})"));
        }
        Ok(d)
    }

    fn send(&mut self, cmd: &str) -> Result<(), String> {
        let d = self.left(cmd.trim())?;
        self.s
            .set_write_timeout(Some(d))
            .map_err(|e| e.to_string())?;
        self.s
            .write_all(cmd.as_bytes())
            .map_err(|e| format!("sending {}: {e}", cmd.trim()))
    }

    /// Read once more into the buffer: Ok(false) at the server's close.
    fn fill(&mut self, what: &str) -> Result<bool, String> {
        let d = self.left(what)?;
        self.s
            .set_read_timeout(Some(d))
            .map_err(|e| e.to_string())?;
        let mut chunk = [0u8; 16 << 10];
        loop {
            match self.s.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(format!("no answer before the deadline ({what})"));
                }
                Err(e) => return Err(format!("reading the answer to {what}: {e}")),
            }
        }
    }

    /// One answer line, without its newline.
    fn line(&mut self, what: &str) -> Result<String, String> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let l: Vec<u8> = self.buf.drain(..=i).collect();
                return Ok(String::from_utf8_lossy(&l[..i])
                    .trim_end_matches('\r')
                    .to_string());
            }
            if self.buf.len() >= LINE_MAX {
                return Err(format!(
                    "the answer to {what} is longer than {LINE_MAX} bytes without a newline"
                ));
            }
            if !self.fill(what)? {
                return Err(format!("the server closed the connection after {what}"));
            }
        }
    }
}

/// What the server said.
#[derive(Debug)]
pub struct Exchange {
    pub address: SocketAddr,
    pub server_protocol: String,
    pub format: Format,
    /// The answer to `SET FORMAT json` when it was not `OK`.
    pub format_refused: Option<String>,
    pub output: Vec<u8>,
    /// The output went on past [`OUTPUT_MAX`].
    pub cut: bool,
    /// Why the output stopped before the server closed it (the deadline, an error).
    pub stopped: Option<String>,
}

/// Why there is no exchange.
#[derive(Debug)]
pub enum Failure {
    /// No address accepted the connection.
    NotReachable(String),
    /// It did, and then the handshake failed.
    Failed(SocketAddr, String),
}

fn connect(addrs: &[SocketAddr], deadline: Instant) -> Result<(TcpStream, SocketAddr), Failure> {
    let mut why = Vec::new();
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            why.push(format!("{a}: not tried (out of time)"));
            continue;
        }
        match TcpStream::connect_timeout(a, left.min(CONNECT_TIMEOUT)) {
            Ok(s) => return Ok((s, *a)),
            Err(e) => why.push(format!("{a}: {e}")),
        }
    }
    Err(Failure::NotReachable(why.join("; ")))
}

/// The exchange with the first of `addrs` that accepts, by `deadline`; in JSON when `json`
/// and the server takes it.
pub fn exchange(addrs: &[SocketAddr], deadline: Instant, json: bool) -> Result<Exchange, Failure> {
    let (s, address) = connect(addrs, deadline)?;
    let mut c = Conn {
        s,
        buf: Vec::new(),
        deadline,
    };
    let fail = |e: String| Failure::Failed(address, e);
    c.send(&format!("CLIENT PROTOCOL {CLIENT_PROTOCOL}\n"))
        .map_err(fail)?;
    let hello = c.line("CLIENT PROTOCOL").map_err(fail)?;
    let server_protocol = match hello.get(..16) {
        Some(p) if p.eq_ignore_ascii_case("SERVER PROTOCOL ") => view::word(&hello[16..], 16),
        _ => {
            return Err(fail(format!(
                "not NCCL RAS: it answered {:?}",
                view::word(&hello, 120)
            )))
        }
    };
    c.send(&format!("TIMEOUT {NCCL_TIMEOUT_S}\n"))
        .map_err(fail)?;
    let ok = c.line("TIMEOUT").map_err(fail)?;
    if !ok.eq_ignore_ascii_case("OK") {
        return Err(fail(format!(
            "TIMEOUT {NCCL_TIMEOUT_S} answered {:?}",
            view::word(&ok, 120)
        )));
    }
    let (format, format_refused) = if json {
        c.send("SET FORMAT json\n").map_err(fail)?;
        let answer = c.line("SET FORMAT json").map_err(fail)?;
        if answer.eq_ignore_ascii_case("OK") {
            (Format::Json, None)
        } else {
            (Format::Text, Some(view::word(&answer, 120)))
        }
    } else {
        (Format::Text, None)
    };
    c.send("VERBOSE STATUS\n").map_err(fail)?;
    let mut out = std::mem::take(&mut c.buf);
    let mut stopped = None;
    while out.len() <= OUTPUT_MAX {
        match c.fill("VERBOSE STATUS") {
            Ok(true) => out.append(&mut c.buf),
            Ok(false) => break,
            Err(e) => {
                stopped = Some(e);
                break;
            }
        }
    }
    let cut = out.len() > OUTPUT_MAX;
    out.truncate(OUTPUT_MAX);
    Ok(Exchange {
        address,
        server_protocol,
        format,
        format_refused,
        output: out,
        cut,
        stopped,
    })
}

/// A variable of a process's environment (`/proc/PID/environ`'s bytes).
fn env_var(environ: &[u8], name: &str) -> Option<String> {
    environ.split(|&b| b == 0).find_map(|kv| {
        let v = kv.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
        Some(String::from_utf8_lossy(v).into_owned())
    })
}

fn environ(pid: u32) -> Vec<u8> {
    let mut b = Vec::new();
    if let Ok(f) = std::fs::File::open(format!("/proc/{pid}/environ")) {
        let _ = f.take(1 << 20).read_to_end(&mut b);
    }
    b
}

/// The job process whose namespace and environment are used: the lowest rank's first process
/// (NCCL runs in the ranks), else the job's first process. With its rank and environment.
fn target(pids: &[u32]) -> Option<(u32, Option<u32>, Vec<u8>)> {
    let mut best: Option<(u32, Option<u32>, Vec<u8>)> = None;
    for &pid in pids.iter().take(64) {
        let env = environ(pid);
        let rank = super::ranks::from_environ(&env).map(|r| r.rank);
        let better = match &best {
            None => true,
            Some((p, r, _)) => match (rank, r) {
                (Some(a), Some(b)) => (a, pid) < (*b, *p),
                (Some(_), None) => true,
                _ => false,
            },
        };
        if better {
            best = Some((pid, rank, env));
        }
    }
    best
}

/// Enter `pid`'s network namespace on this thread when it is not this thread's already:
/// Ok(true) entered, Ok(false) the same one.
fn enter_netns(pid: u32) -> Result<bool, String> {
    let path = format!("/proc/{pid}/ns/net");
    let theirs = std::fs::read_link(&path).map_err(|e| format!("{path}: {e}"))?;
    if std::fs::read_link("/proc/thread-self/ns/net").ok() == Some(theirs.clone()) {
        return Ok(false);
    }
    let f = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    use std::os::fd::AsRawFd as _;
    // SAFETY: setns on this thread only (a thread spawned for this query, which ends with it),
    // with a namespace fd we opened and hold.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "cannot enter the job's network namespace ({}, pid {pid}): {e}{}",
            theirs.display(),
            if e.raw_os_error() == Some(libc::EPERM) {
                " (root is needed)"
            } else {
                ""
            }
        ));
    }
    Ok(true)
}

/// The `nccl_ras` section for the job's processes `job`, within [`DEADLINE`].
pub fn snapshot(job: &std::collections::BTreeSet<u32>) -> Value {
    let pids: Vec<u32> = job.iter().copied().collect();
    section(&pids, None, DEADLINE)
}

/// The section, asking from the namespace of one of `pids` (see [`target`]); `addr` in place of
/// the job's `NCCL_RAS_ADDR` (tests). Within `deadline` and one more second for the thread.
pub fn section(pids: &[u32], addr: Option<&str>, deadline: Duration) -> Value {
    let t0 = Instant::now();
    if pids.is_empty() {
        return json!({ "not_queried": "no job process" });
    }
    let (pids, addr) = (pids.to_vec(), addr.map(String::from));
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("nantrace-ras".into())
        .spawn(move || {
            let _ = tx.send(ask(&pids, addr.as_deref(), t0 + deadline));
        });
    if let Err(e) = spawned {
        return json!({ "error": format!("no thread for the NCCL RAS query: {e}") });
    }
    let mut v = rx.recv_timeout(deadline + Duration::from_secs(1)).unwrap_or_else(|_| {
        json!({ "error": format!("the NCCL RAS query took longer than {} s (a process's memory map locked, or a connect stuck): left out", deadline.as_secs_f64() + 1.0) })
    });
    v["deadline_s"] = json!(deadline.as_secs_f64());
    v["took_ms"] = json!(t0.elapsed().as_millis() as u64);
    v
}

/// On the query's own thread: find the process, enter its namespace, ask.
fn ask(pids: &[u32], addr: Option<&str>, deadline: Instant) -> Value {
    let Some((pid, rank, env)) = target(pids) else {
        return json!({ "not_queried": "no job process" });
    };
    let mut v = json!({ "pid": pid });
    if let Some(r) = rank {
        v["rank"] = json!(r);
    }
    let (ras_addr, from) = match addr {
        Some(a) => (Some(a.to_string()), "given"),
        None => match env_var(&env, "NCCL_RAS_ADDR") {
            Some(a) => (Some(a), "NCCL_RAS_ADDR"),
            None => (None, "default"),
        },
    };
    v["address_from"] = json!(from);
    if addr.is_none() && env_var(&env, "NCCL_RAS_ENABLE").is_some_and(|e| e.trim() == "0") {
        v["not_queried"] = json!("RAS is off in the job's environment (NCCL_RAS_ENABLE=0)");
        return v;
    }
    let addrs = match addresses(ras_addr.as_deref()) {
        Ok(a) => a,
        Err(e) => {
            v["not_queried"] = json!(e);
            return v;
        }
    };
    match enter_netns(pid) {
        Ok(entered) => {
            v["netns"] = json!(if entered {
                "the job's (entered)"
            } else {
                "nantrace's own, the job's too"
            })
        }
        Err(e) => {
            v["error"] = json!(e);
            return v;
        }
    }
    match exchange(&addrs, deadline, true) {
        // Cut JSON does not parse: the text names the outliers in far fewer bytes.
        Ok(x) if x.cut && x.format == Format::Json => {
            v["json_cut"] = json!(format!(
                "the JSON answer went past {OUTPUT_MAX} bytes: asked again in text"
            ));
            match exchange(&addrs, deadline, false) {
                Ok(t) => said(&mut v, t),
                Err(_) => said(&mut v, x),
            }
        }
        Ok(x) => said(&mut v, x),
        Err(Failure::NotReachable(e)) => {
            v["not_reachable"] = json!(format!("{e}: no NCCL >= 2.24 process of the job listens there (NCCL older or not loaded, RAS disabled, not initialised yet, or the job gone)"));
        }
        Err(Failure::Failed(a, e)) => {
            v["address"] = json!(a.to_string());
            v["error"] = json!(e);
        }
    }
    v
}

/// The exchange into the section: the output as lines, and its view.
fn said(v: &mut Value, x: Exchange) {
    let text = String::from_utf8_lossy(&x.output);
    v["address"] = json!(x.address.to_string());
    v["server_protocol"] = json!(x.server_protocol);
    v["format"] = json!(x.format);
    if let Some(r) = &x.format_refused {
        v["set_format_answer"] = json!(r);
    }
    v["output_bytes"] = json!(x.output.len());
    if x.cut {
        v["output_cut"] = json!(format!(
            "the output went on past {OUTPUT_MAX} bytes: cut there"
        ));
    }
    if let Some(s) = &x.stopped {
        v["output_incomplete"] = json!(s);
    }
    let view = match x.format {
        Format::Json => from_json(&text),
        Format::Text => Ok(from_text(&text)),
    };
    match view {
        Ok(view) => v["view"] = serde_json::to_value(view).unwrap_or(Value::Null),
        Err(e) => v["view_error"] = json!(e),
    }
    v["output"] = json!(text
        .lines()
        .map(|l| crate::term::clean(l)
            .chars()
            .take(KEPT_LINE_MAX)
            .collect::<String>())
        .collect::<Vec<_>>());
}
