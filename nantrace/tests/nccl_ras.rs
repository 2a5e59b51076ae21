//! NCCL RAS asked at the trigger (`collect::nccl_ras`, docs/hangs.md): the exchange against a
//! fake RAS server in this process (std's TcpListener on 127.0.0.1, an ephemeral port) that
//! speaks NCCL's handshake (src/ras/client_support.cc `rasClientEventLoop`, v2.30.7-1): one
//! that takes `SET FORMAT json`, one that refuses it as NCCL before 2.28.7 does (text), one
//! that never answers (the deadline holds and the section says so), one that stops mid-output,
//! one whose JSON runs past 1 MiB (asked again in text), a refused port; and, as root, a server in another network namespace reached through a
//! process of it (setns). The outputs are built from NCCL's format strings; no real NCCL.
mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use nantrace::collect::nccl_ras;
use serde_json::Value;

#[derive(Clone, Copy)]
enum Mode {
    /// Takes `SET FORMAT json`, answers `body`.
    Json,
    /// Refuses it (`ERROR: Unknown command ...`), answers `body` in text.
    Text,
    /// Accepts and never says a word.
    Silent,
    /// The handshake, then half of `body`, then nothing.
    Stalls,
    /// Takes `SET FORMAT json`, answers with more than a MiB of it.
    HugeJson,
}

/// A text answer in NCCL's words: rank 5's process dead, rank 2 an AllReduce behind.
const TEXT: &str = "NCCL version 2.26.2+cuda12.8 compiled with CUDA 12.8\nCUDA runtime version 12080, driver version 12080\n\nJob summary\n===========\n\n  Nodes  Processes         GPUs  Processes     GPUs\n(total)   per node  per process    (total)  (total)\n      2          4            1          8        8\n\nCommunicators... (2.013s)\n=============\n\nGroup     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n    0         1         2       3-4         8         8   RUNNING  INCOMPLETE,MISMATCH\n\nErrors\n======\n\nDEAD\n  1 job process is considered dead (unreachable via the RAS network)\n  Process 4125 on node 10.0.0.2 managing GPU 1\n\n#0-0 (27a079b828ff1a75) INCOMPLETE\n  Missing communicator data from 1 rank\n  Rank 5 -- GPU 1 managed by process 4125 on node 10.0.0.2\n\nWarnings\n========\n\n#0-0 (27a079b828ff1a75) MISMATCH\n  Communicator ranks have different AllReduce operation counts\n  6 ranks have launched up to operation 42\n  Rank 2 has launched up to operation 41 -- GPU 2 managed by process 4012 on node 10.0.0.1\n\n";

const JSON: &str = "{\n  \"nccl_version\": \"2.30.7\",\n  \"cuda_runtime_version\": 13000,\n  \"cuda_driver_version\": 13000,\n  \"timestamp\": \"2026-12-03 19:07:07\",\n  \"communicators_count\": 1,\n  \"communicators\": [\n    {\n      \"hash\": \"0xae94423cfbb2ef4a\",\n      \"secondary_hash\": \"0x1:0x2\",\n      \"size\": 2,\n      \"ranks_count\": 1,\n      \"missing_ranks_count\": 1,\n      \"ranks\": [\n        {\n          \"rank\": 0,\n          \"host\": \"10.0.0.1\",\n          \"pid\": 4011,\n          \"cuda_dev\": 0,\n          \"nvml_dev\": 0,\n          \"status\": {\n            \"init_state\": 0,\n            \"async_error\": 0,\n            \"finalize_called\": false,\n            \"destroy_flag\": false,\n            \"abort_flag\": false\n          },\n          \"collective_counts\": {\n            \"AllReduce\": 42\n          }\n        }\n      ],\n      \"missing_ranks\": [\n        {\n          \"rank\": 1,\n          \"host\": \"10.0.0.2\",\n          \"pid\": 4125,\n          \"cuda_dev\": 1,\n          \"nvml_dev\": 1,\n          \"status\": {\n            \"unresponsive\": true,\n            \"considered_dead\": false\n          }\n        }\n      ]\n    }\n  ],\n  \"ras\": {\n    \"collection_time_sec\": 2.004,\n    \"timeouts_count\": 1\n  }\n}\n";

/// A fake RAS server on `listener`, for one client; returns the commands it was sent.
fn serve(listener: TcpListener, mode: Mode) -> std::thread::JoinHandle<Vec<String>> {
    serve_each(listener, vec![mode])
}

/// One client per mode, one after the other; every command they sent.
fn serve_each(listener: TcpListener, modes: Vec<Mode>) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut cmds = Vec::new();
        for mode in modes {
            let (s, _) = listener.accept().expect("accept");
            cmds.extend(one_client(s, mode));
        }
        cmds
    })
}

fn one_client(s: std::net::TcpStream, mode: Mode) -> Vec<String> {
    let mut cmds = Vec::new();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    let mut l = String::new();
    while r.read_line(&mut l).is_ok_and(|n| n > 0) {
        let cmd = l.trim_end().to_string();
        l.clear();
        cmds.push(cmd.clone());
        if matches!(mode, Mode::Silent) {
            continue; // never a word, until the client gives up
        }
        let up = cmd.to_ascii_uppercase();
        let json = matches!(mode, Mode::Json | Mode::HugeJson);
        let answer = if up.starts_with("CLIENT PROTOCOL ") {
            "SERVER PROTOCOL 2\n".to_string()
        } else if up.starts_with("TIMEOUT ") || (up == "SET FORMAT JSON" && json) {
            "OK\n".to_string()
        } else if up == "VERBOSE STATUS" {
            status(&mut w, mode);
            return cmds;
        } else {
            format!("ERROR: Unknown command {cmd}\n")
        };
        let _ = w.write_all(answer.as_bytes());
    }
    cmds
}

/// The answer to `VERBOSE STATUS`, as several messages (as NCCL sends it), then the close.
fn status(w: &mut std::net::TcpStream, mode: Mode) {
    let huge = format!("{}{}}}\n", &JSON[..JSON.len() - 2], " ".repeat(1_200_000));
    let body = match mode {
        Mode::Json => JSON,
        Mode::HugeJson => huge.as_str(),
        _ => TEXT,
    };
    if matches!(mode, Mode::Stalls) {
        let _ = w.write_all(&body.as_bytes()[..body.len() / 2]);
        std::thread::sleep(Duration::from_secs(4));
        return;
    }
    let chunk = if body.len() > 100_000 { 1 << 16 } else { 700 };
    for part in body.as_bytes().chunks(chunk) {
        if w.write_all(part).is_err() {
            break; // the client stopped reading (at its limit)
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

fn ask(addr: &str, deadline: Duration) -> Value {
    nccl_ras::section(&[std::process::id()], Some(addr), deadline)
}

const HANDSHAKE: [&str; 4] = [
    "CLIENT PROTOCOL 2",
    "TIMEOUT 2",
    "SET FORMAT json",
    "VERBOSE STATUS",
];

#[test]
fn a_server_that_takes_json_answers_in_json() {
    let (l, addr) = listener();
    let server = serve(l, Mode::Json);
    let v = ask(&addr, Duration::from_secs(3));
    assert_eq!(server.join().unwrap(), HANDSHAKE);
    assert_eq!(v["format"], "json", "{v:#}");
    assert_eq!(v["address"], addr);
    assert_eq!(v["server_protocol"], "2");
    assert_eq!(v["netns"], "nantrace's own, the job's too");
    assert_eq!(v["output_bytes"], JSON.len());
    assert!(
        v["output_incomplete"].is_null() && v["output_cut"].is_null(),
        "{v:#}"
    );
    let view: nccl_ras::View = serde_json::from_value(v["view"].clone()).expect("a view");
    assert_eq!(view.nccl_version.as_deref(), Some("2.30.7"));
    let r = &view.comms[0].ranks[0];
    assert_eq!(
        (r.rank, r.kind, r.pid, r.host.as_deref()),
        (1, nccl_ras::Kind::Incomplete, Some(4125), Some("10.0.0.2"))
    );
}

#[test]
fn a_server_that_refuses_set_format_is_read_in_text() {
    let (l, addr) = listener();
    let server = serve(l, Mode::Text);
    let v = ask(&addr, Duration::from_secs(3));
    assert_eq!(server.join().unwrap(), HANDSHAKE);
    assert_eq!(v["format"], "text", "{v:#}");
    assert_eq!(
        v["set_format_answer"],
        "ERROR: Unknown command SET FORMAT json"
    );
    assert_eq!(
        v["output"][0],
        "NCCL version 2.26.2+cuda12.8 compiled with CUDA 12.8"
    );
    let view: nccl_ras::View = serde_json::from_value(v["view"].clone()).expect("a view");
    let got: Vec<(u32, nccl_ras::Kind)> = view.comms[0]
        .ranks
        .iter()
        .map(|r| (r.rank, r.kind))
        .collect();
    assert_eq!(
        got,
        vec![(5, nccl_ras::Kind::Dead), (2, nccl_ras::Kind::Mismatch)]
    );
    assert_eq!(view.dead_processes, Some(1));
}

#[test]
fn a_server_that_never_answers_costs_the_deadline_and_is_said() {
    let (l, addr) = listener();
    let server = serve(l, Mode::Silent);
    let t0 = Instant::now();
    let v = ask(&addr, Duration::from_millis(1500));
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_millis(2500),
        "{took:?}"
    );
    assert_eq!(
        v["error"], "no answer before the deadline (CLIENT PROTOCOL)",
        "{v:#}"
    );
    assert_eq!(v["address"], addr);
    assert_eq!(v["deadline_s"], 1.5);
    assert!(v["view"].is_null());
    assert_eq!(server.join().unwrap(), ["CLIENT PROTOCOL 2"]);
}

#[test]
fn a_server_that_stops_mid_answer_leaves_what_it_said_and_why_it_is_short() {
    let (l, addr) = listener();
    let server = serve(l, Mode::Stalls);
    let v = ask(&addr, Duration::from_millis(1500));
    assert_eq!(
        v["output_incomplete"], "no answer before the deadline (VERBOSE STATUS)",
        "{v:#}"
    );
    assert_eq!(v["output_bytes"], TEXT.len() / 2);
    let view: nccl_ras::View = serde_json::from_value(v["view"].clone()).expect("a view");
    assert_eq!(view.nodes, Some(2), "the half that came is read");
    server.join().unwrap();
}

#[test]
fn a_refused_port_is_not_reachable_and_said() {
    let (l, addr) = listener();
    drop(l);
    let t0 = Instant::now();
    let v = ask(&addr, Duration::from_secs(3));
    assert!(t0.elapsed() < Duration::from_secs(2), "a refusal is quick");
    let why = v["not_reachable"]
        .as_str()
        .unwrap_or_else(|| panic!("{v:#}"));
    assert!(
        why.starts_with(&format!("{addr}: Connection refused")),
        "{why}"
    );
    assert!(
        why.contains("no NCCL >= 2.24 process of the job listens there"),
        "{why}"
    );
    // No job process: nothing asked, and said.
    let none = nccl_ras::section(&[], None, Duration::from_secs(1));
    assert_eq!(none["not_queried"], "no job process");
}

/// As root: the RAS port of a job in another network namespace, reached through its process
/// (setns on the query's own thread); the same address from nantrace's own namespace is not
/// that server.
#[test]
fn a_job_in_another_network_namespace_is_asked_in_it() {
    if !common::privileged("a_job_in_another_network_namespace_is_asked_in_it") {
        return;
    }
    let ns = format!("ntras-{}", std::process::id());
    let _ = common::sh(&format!("ip netns del {ns} 2>/dev/null"));
    common::sh_ok(&format!("ip netns add {ns} && ip -n {ns} link set lo up"));
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = common::sh(&format!("ip netns del {}", self.0));
        }
    }
    let _gone = Gone(ns.clone());
    // The server's socket is made in the job's namespace; it stays there.
    let (l, addr) = common::NetPair::in_ns(&ns, listener).join().unwrap();
    let server = serve(l, Mode::Text);
    let mut job = std::process::Command::new("ip")
        .args(["netns", "exec", &ns, "sleep", "30"])
        .spawn()
        .expect("ip netns exec");
    std::thread::sleep(Duration::from_millis(300));
    let v = nccl_ras::section(&[job.id()], Some(&addr), Duration::from_secs(3));
    let here = ask(&addr, Duration::from_secs(2));
    let _ = job.kill();
    let _ = job.wait();
    assert_eq!(v["netns"], "the job's (entered)", "{v:#}");
    assert_eq!(v["format"], "text", "{v:#}");
    assert_eq!(server.join().unwrap(), HANDSHAKE);
    assert!(
        here["format"].is_null(),
        "nantrace's own namespace has no such server: {here:#}"
    );
}

#[test]
fn a_json_answer_past_a_mib_is_asked_again_in_text() {
    let (l, addr) = listener();
    let server = serve_each(l, vec![Mode::HugeJson, Mode::Text]);
    let v = ask(&addr, Duration::from_secs(4));
    let mut want: Vec<&str> = HANDSHAKE.to_vec();
    want.extend(["CLIENT PROTOCOL 2", "TIMEOUT 2", "VERBOSE STATUS"]);
    assert_eq!(server.join().unwrap(), want);
    assert_eq!(
        v["json_cut"], "the JSON answer went past 1048576 bytes: asked again in text",
        "{v:#}"
    );
    assert_eq!(v["format"], "text");
    assert!(v["set_format_answer"].is_null());
    let view: nccl_ras::View = serde_json::from_value(v["view"].clone()).expect("a view");
    assert_eq!(view.dead_processes, Some(1));
}
