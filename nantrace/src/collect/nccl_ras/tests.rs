//! The parsers on outputs built from NCCL's own format strings: each `format!` below is the
//! `rasOutAppend` / `json*` call of src/ras/client_support.cc it names, with printf's widths
//! (`%8d` is `{:8}`, `%8s` is `{:>8}`), NVIDIA/nccl v2.30.7-1 (73cf1122) unless said. Not a
//! real NCCL's output: none ran here.
use super::*;

/// `rasClientRunInit`: the version lines and a consistent job summary.
fn header(nodes: u32, per_node: u32, procs: u32) -> String {
    let mut s = "NCCL version 2.30.7+cuda12.9 compiled with CUDA 12.9\n".to_string();
    s += &format!(
        "CUDA runtime version {}, driver version {}\n\n",
        12090, 12090
    );
    s += "Job summary\n===========\n\n";
    s += "  Nodes  Processes         GPUs  Processes     GPUs\n(total)   per node  per process    (total)  (total)\n";
    s += &format!("{nodes:7}  {per_node:9}  {:11}  {procs:9}  {procs:7}\n", 1);
    s += "\nCommunicators...";
    s
}

/// `rasClientRunComms`' table row: `"%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s\n"`.
fn row(
    g: u32,
    comms: u32,
    nodes: u32,
    per_node: &str,
    size: u32,
    status: &str,
    errors: &str,
) -> String {
    format!(
        "{g:5}  {comms:8}  {nodes:8}  {per_node:>8}  {size:8}  {:8}  {status:>8}  {errors:>6}\n",
        size * comms
    )
}

/// `"  Rank %d -- GPU %s managed by process %d on node %s\n"` (`rasGpuToString`: `%d`, or
/// `%d (NVML %d)` when they differ).
fn rank(r: u32, gpu: &str, pid: u32, node: &str) -> String {
    format!("  Rank {r} -- GPU {gpu} managed by process {pid} on node {node}\n")
}

/// A job of 4 nodes × 8 ranks: rank 21's process dead, rank 13's not answering, rank 7 one
/// AllReduce behind, rank 3 of an 8-rank communicator with an asynchronous error.
fn text_2_30() -> String {
    let mut s = header(4, 8, 32);
    s += &format!(" ({:.3}s)\n=============\n\n", 2.051);
    s += "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n";
    s += &row(0, 1, 4, "7-8", 32, "RUNNING", "INCOMPLETE,MISMATCH");
    s += &row(1, 1, 1, "8", 8, "RUNNING", "ERROR");
    s += &row(2, 3, 1, "8", 8, "RUNNING", "OK");
    s += "\nErrors\n======\n\n";
    s += &format!(
        "INCOMPLETE\n  Missing communicator data from {} job process{}\n",
        1, ""
    );
    s += &format!(
        "  Process {} on node {} managing GPU{} {}\n",
        1598393, "172.16.64.212", "", "5"
    );
    s += "\n";
    s += &format!(
        "DEAD\n  {} job process{} considered dead (unreachable via the RAS network)\n",
        1, " is"
    );
    s += &format!(
        "  Process {} on node {} managing GPU{} {}\n",
        3487984, "172.16.64.213", "", "5"
    );
    s += "\n";
    s += &format!(
        "#{}-{} ({:016x}) INCOMPLETE\n  Missing communicator data from {} rank{}\n",
        0, 0, 0xcf26_4af5_3edb_e986_u64, 2, "s"
    );
    s += &rank(13, "5", 1_598_393, "172.16.64.212");
    s += &rank(21, "5", 3_487_984, "172.16.64.213");
    s += "\n";
    s += &format!("#{}-{} ({:016x}) ERROR\n", 1, 0, 0x00a0_79b8_28ff_1a75_u64);
    s += &format!("  Asynchronous error{} on {} rank{}\n", "", 1, "");
    s += &format!(
        "  Rank {} reported {} -- GPU {} managed by process {} on node {}\n",
        3, "Remote process error", "3 (NVML 7)", 507_288, "172.16.64.210"
    );
    s += "\n";
    s += "Warnings\n========\n\n";
    s += &format!(
        "TIMEOUT\n  Encountered {} communication timeout{} while gathering communicator data\n\n",
        2, "s"
    );
    s += &format!(
        "#{}-{} ({:016x}) MISMATCH\n",
        0, 0, 0xcf26_4af5_3edb_e986_u64
    );
    s += &format!(
        "  Communicator ranks have different {} operation counts\n",
        "AllReduce"
    );
    s += &format!("  {} ranks have launched up to operation {}\n", 29, 6650);
    s += &format!(
        "  Rank {} has launched up to operation {} -- GPU {} managed by process {} on node {}\n",
        7, 6649, "7", 483_079, "172.16.64.210"
    );
    s += "\n";
    s
}

#[test]
fn the_text_format_names_the_dead_the_missing_the_lagging_and_the_failed_ranks() {
    let v = from_text(&text_2_30());
    assert_eq!(v.format, Format::Text);
    assert_eq!(v.nccl_version.as_deref(), Some("2.30.7+cuda12.9"));
    assert_eq!(
        (v.cuda_runtime_version, v.cuda_driver_version),
        (Some(12090), Some(12090))
    );
    assert_eq!(
        (v.nodes, v.processes, v.gpus),
        (Some(4), Some(32), Some(32))
    );
    assert_eq!((v.communicators, v.ranks), (Some(5), Some(64)));
    assert_eq!(v.collection_s, Some(2.051));
    assert_eq!(v.timeouts, Some(2));
    assert_eq!((v.missing_processes, v.dead_processes), (Some(1), Some(1)));
    assert_eq!(
        v.processes_listed,
        vec![
            ProcessIssue {
                kind: Kind::Incomplete,
                pid: 1_598_393,
                host: "172.16.64.212".into(),
                gpus: "5".into()
            },
            ProcessIssue {
                kind: Kind::Dead,
                pid: 3_487_984,
                host: "172.16.64.213".into(),
                gpus: "5".into()
            },
        ]
    );
    assert_eq!(v.comms.len(), 2, "{v:#?}");
    let c0 = &v.comms[0];
    assert_eq!(c0.id.as_deref(), Some("#0-0"));
    assert_eq!(c0.hash, "cf264af53edbe986");
    assert_eq!(
        (c0.size, c0.status.as_deref(), c0.missing_ranks),
        (Some(32), Some("RUNNING"), Some(2))
    );
    assert_eq!(c0.errors, vec!["INCOMPLETE", "MISMATCH"]);
    let at = |r: &RankIssue| {
        (
            r.rank,
            r.kind,
            r.pid,
            r.host.clone().unwrap_or_default(),
            r.cuda_dev,
        )
    };
    assert_eq!(
        c0.ranks.iter().map(at).collect::<Vec<_>>(),
        vec![
            (
                13,
                Kind::Incomplete,
                Some(1_598_393),
                "172.16.64.212".to_string(),
                Some(5)
            ),
            (
                21,
                Kind::Dead,
                Some(3_487_984),
                "172.16.64.213".to_string(),
                Some(5)
            ),
            (
                7,
                Kind::Mismatch,
                Some(483_079),
                "172.16.64.210".to_string(),
                Some(7)
            ),
        ]
    );
    assert_eq!(c0.ranks[0].why, Why::NoAnswer);
    assert_eq!(
        c0.ranks[2].why,
        Why::Ops {
            op: Some("AllReduce".into()),
            launched: 6649,
            most: Some(6650)
        }
    );
    let c1 = &v.comms[1];
    assert_eq!(
        (c1.id.as_deref(), c1.size, c1.errors.as_slice()),
        (Some("#1-0"), Some(8), &["ERROR".to_string()][..])
    );
    let r = &c1.ranks[0];
    assert_eq!(
        (r.rank, r.kind, r.cuda_dev, r.nvml_dev, r.pid),
        (3, Kind::Error, Some(3), Some(7), Some(507_288))
    );
    assert_eq!(
        r.why,
        Why::Error {
            phase: "asynchronous".into(),
            error: "Remote process error".into()
        }
    );
    assert!(v.has_issues());
}

/// The same job, all well: only the tables.
#[test]
fn a_job_that_is_well_has_no_issues() {
    let mut s = header(2, 4, 8);
    s += &format!(" ({:.3}s)\n=============\n\n", 0.004);
    s += "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n";
    s += &row(0, 1, 2, "4", 8, "RUNNING", "OK");
    s += "\nErrors\n======\n\nWarnings\n========\n\n";
    let v = from_text(&s);
    assert_eq!(
        (v.nodes, v.processes, v.communicators, v.ranks),
        (Some(2), Some(8), Some(1), Some(8))
    );
    assert!(!v.has_issues(), "{v:#?}");
}

/// NCCL 2.24.3-1 (6aae3792): `UNKNOWN`, rank numbers without processes, `collective
/// operation counts`, `(%.2fs)`; a job summary whose nodes differ.
#[test]
fn the_2_24_text_format_is_read_too() {
    let mut s = "NCCL version 2.24.3+cuda12.6 compiled with CUDA 12.6\nCUDA runtime version 12060, driver version 12080\n\n".to_string();
    s += "Job summary\n===========\n\n";
    s += "  Nodes  Processes         GPUs\n          per node  per process\n";
    s += &format!("{:7}  {:9}  {:11}\n{:7}  {:9}  {:11}\n", 1, 4, 1, 1, 3, 1);
    s += &format!(
        "\n  Nodes  Processes         GPUs\n(total)    (total)      (total)\n{:7}  {:9}  {:11}\n",
        2, 7, 7
    );
    s += &format!("\nCommunicators... ({:.2}s)\n=============\n\n", 1.5);
    s += "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n    #  in group  per comm  per node  per comm  in group\n";
    s += &row(0, 1, 2, "3-4", 8, "RUNNING", "INCOMPLETE,MISMATCH");
    s += "\nErrors\n======\n\n";
    s += &format!(
        "#{}-{} ({:016x}) INCOMPLETE\n  Missing communicator data from {} rank{}\n",
        0, 0, 0x9e17_999a_faa8_7dbb_u64, 1, ""
    );
    s += &format!("  The missing rank{}: {}\n\n", "", "7");
    s += "Warnings\n========\n\n";
    s += &format!(
        "#{}-{} ({:016x}) MISMATCH\n",
        0, 0, 0x9e17_999a_faa8_7dbb_u64
    );
    s += "  Communicator ranks have different status\n";
    s += &format!("  {} ranks have status {}\n", 5, "RUNNING");
    s += &format!("  {} ranks have status {}\n", 2, "UNKNOWN");
    s += &format!("  The unknown ranks: {}\n", "4,5");
    s += "  Communicator ranks have different collective operation counts\n";
    s += &format!("  {} ranks have launched up to operation {}\n", 6, 100);
    s += &format!(
        "  Rank {} has launched up to operation {} -- GPU {} managed by process {} on node {}\n",
        2, 99, "2", 1002, "10.0.0.1"
    );
    s += "\n";
    let v = from_text(&s);
    assert_eq!(v.nccl_version.as_deref(), Some("2.24.3+cuda12.6"));
    assert_eq!((v.nodes, v.processes, v.gpus), (Some(2), Some(7), Some(7)));
    assert_eq!(v.collection_s, Some(1.5));
    assert_eq!(v.comms.len(), 1, "{v:#?}");
    let c = &v.comms[0];
    assert_eq!(c.errors, vec!["INCOMPLETE", "MISMATCH"]);
    let got: Vec<(u32, Kind, Why)> = c
        .ranks
        .iter()
        .map(|r| (r.rank, r.kind, r.why.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (7, Kind::Incomplete, Why::NoAnswer),
            (4, Kind::Mismatch, Why::NotMember),
            (5, Kind::Mismatch, Why::NotMember),
            (
                2,
                Kind::Mismatch,
                Why::Ops {
                    op: None,
                    launched: 99,
                    most: Some(100)
                }
            ),
        ]
    );
    assert_eq!(c.ranks[3].pid, Some(1002));
}

/// A status mismatch in 2.26+'s words: `Rank %d has status %s -- GPU ...`.
#[test]
fn a_rank_alone_in_its_status_is_named_with_the_status_most_have() {
    let mut s = String::from("Warnings\n========\n\n");
    s += &format!("#{}-{} ({:016x}) MISMATCH\n", 0, 1, 0x1234_u64);
    s += "  Communicator ranks have different status\n";
    s += &format!("  {} ranks have status {}\n", 3, "RUNNING");
    s += &format!(
        "  Rank {} has status {} -- GPU {} managed by process {} on node {}\n",
        2, "ABORT", "2", 77, "fe80::1"
    );
    let v = from_text(&s);
    let r = &v.comms[0].ranks[0];
    assert_eq!(v.comms[0].hash, "0000000000001234");
    assert_eq!((r.rank, r.host.as_deref()), (2, Some("fe80::1")));
    assert_eq!(
        r.why,
        Why::Status {
            status: "ABORT".into(),
            most: Some("RUNNING".into())
        }
    );
}

/// `jsonWriteRankData`, verbatim in its layout.
fn json_rank(
    rank: u32,
    pid: i32,
    dev: u32,
    init: i32,
    async_err: i32,
    allreduce: u64,
    first: bool,
) -> String {
    let mut s = String::new();
    if !first {
        s += ",\n";
    }
    s += "        {\n";
    s += &format!(
        "          \"rank\": {rank},\n          \"host\": \"{}\",\n          \"pid\": {pid},\n",
        "172.16.64.245"
    );
    s += &format!("          \"cuda_dev\": {dev},\n          \"nvml_dev\": {dev},\n");
    s += &format!("          \"status\": {{\n            \"init_state\": {init},\n            \"async_error\": {async_err},\n");
    s += &format!("            \"finalize_called\": {},\n            \"destroy_flag\": {},\n            \"abort_flag\": {}\n          }},\n", "false", "false", "false");
    s += "          \"collective_counts\": {\n";
    for (i, (op, n)) in [
        ("Broadcast", 1),
        ("Reduce", 0),
        ("AllGather", 0),
        ("ReduceScatter", 0),
        ("AllReduce", allreduce),
    ]
    .iter()
    .enumerate()
    {
        s += &format!(
            "            \"{op}\": {n}{}\n",
            if i < 4 { "," } else { "" }
        );
    }
    s += "          }\n        }";
    s
}

/// `jsonWriteMissingRank`.
fn json_missing(
    rank: u32,
    pid: i32,
    dev: u32,
    unresponsive: bool,
    dead: bool,
    first: bool,
) -> String {
    let mut s = String::new();
    if !first {
        s += ",\n";
    }
    s += &format!("        {{\n          \"rank\": {rank},\n          \"host\": \"{}\",\n          \"pid\": {pid},\n", "172.16.64.245");
    s += &format!("          \"cuda_dev\": {dev},\n          \"nvml_dev\": {dev},\n");
    s += &format!("          \"status\": {{\n            \"unresponsive\": {unresponsive},\n            \"considered_dead\": {dead}\n          }}\n        }}");
    s
}

/// `jsonStartCommunicator` ... `jsonEndCommunicator`.
fn json_comm(hash: u64, size: u32, ranks: &[String], missing: &[String], first: bool) -> String {
    let mut s = String::new();
    if !first {
        s += ",\n";
    }
    s += &format!(
        "    {{\n      \"hash\": \"0x{hash:x}\",\n      \"secondary_hash\": \"0x{:x}:0x{:x}\",\n",
        0xb7e7_u64, 0xb824_u64
    );
    s += &format!("      \"size\": {size},\n      \"ranks_count\": {},\n      \"missing_ranks_count\": {},\n      \"ranks\": [\n", ranks.len(), missing.len());
    s += &ranks.concat();
    s += "\n      ],\n      \"missing_ranks\": [\n";
    s += &missing.concat();
    s += "\n      ]\n    }";
    s
}

/// Two communicators: one of 4 ranks where rank 2 is an AllReduce behind and rank 3's process
/// is dead; one of 3 where rank 0 has an asynchronous error, rank 1 does not answer and rank 2
/// answers without being a member.
fn json_2_30() -> String {
    let mut s = String::from("{\n");
    s += &format!("  \"nccl_version\": \"{}\",\n  \"cuda_runtime_version\": {},\n  \"cuda_driver_version\": {},\n", "2.30.7", 13000, 13000);
    s += &format!(
        "  \"timestamp\": \"{}\",\n  \"communicators_count\": {},\n  \"communicators\": [\n",
        "2026-12-03 19:07:07", 2
    );
    let a = [
        json_rank(0, 100, 0, 0, 0, 42, true),
        json_rank(1, 101, 1, 0, 0, 42, false),
        json_rank(2, 102, 2, 0, 0, 41, false),
    ];
    s += &json_comm(
        0xae94_423c_fbb2_ef4a,
        4,
        &a,
        &[json_missing(3, 103, 3, true, true, true)],
        true,
    );
    let b = [json_rank(0, 100, 0, 0, 6, 7, true)];
    let m = [
        json_missing(1, 101, 1, true, false, true),
        json_missing(2, 102, 2, false, false, false),
    ];
    s += &json_comm(0x77, 3, &b, &m, false);
    s += &format!("\n  ],\n  \"ras\": {{\n    \"collection_time_sec\": {:.3},\n    \"timeouts_count\": {}\n  }}\n}}\n", 2.004, 1);
    s
}

#[test]
fn the_json_format_is_read_into_the_same_view() {
    let v = from_json(&json_2_30()).expect("valid JSON");
    assert_eq!(v.format, Format::Json);
    assert_eq!(v.nccl_version.as_deref(), Some("2.30.7"));
    assert_eq!(
        (v.communicators, v.ranks, v.timeouts),
        (Some(2), Some(7), Some(1))
    );
    assert_eq!(v.collection_s, Some(2.004));
    assert_eq!((v.dead_processes, v.missing_processes), (Some(1), Some(1)));
    assert_eq!(v.comms.len(), 2);
    let a = &v.comms[0];
    assert_eq!(
        (a.hash.as_str(), a.size, a.status.as_deref()),
        ("ae94423cfbb2ef4a", Some(4), Some("RUNNING"))
    );
    assert_eq!(a.errors, vec!["INCOMPLETE", "MISMATCH"]);
    let got: Vec<(u32, Kind, Why, Option<u32>)> = a
        .ranks
        .iter()
        .map(|r| (r.rank, r.kind, r.why.clone(), r.pid))
        .collect();
    assert_eq!(
        got,
        vec![
            (3, Kind::Dead, Why::NoAnswer, Some(103)),
            (
                2,
                Kind::Mismatch,
                Why::Ops {
                    op: Some("AllReduce".into()),
                    launched: 41,
                    most: Some(42)
                },
                Some(102)
            ),
        ]
    );
    let b = &v.comms[1];
    assert_eq!(b.errors, vec!["ERROR", "INCOMPLETE", "MISMATCH"]);
    let got: Vec<(u32, Kind, Why)> = b
        .ranks
        .iter()
        .map(|r| (r.rank, r.kind, r.why.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, Kind::Incomplete, Why::NoAnswer),
            (2, Kind::Mismatch, Why::NotMember),
            (
                0,
                Kind::Error,
                Why::Error {
                    phase: "asynchronous".into(),
                    error: "Remote process error (6)".into()
                }
            ),
        ]
    );
    assert_eq!(b.ranks[0].host.as_deref(), Some("172.16.64.245"));
    // The view goes into snapshot.json and comes back the same.
    let back: View = serde_json::from_value(serde_json::to_value(&v).unwrap()).unwrap();
    assert_eq!(back, v);
}

#[test]
fn hostile_output_stays_bounded_and_plain() {
    assert!(from_json("{\"communicators\": 3").is_err());
    assert!(from_json("[1]").is_err());
    let evil = "Warnings\n#0-0 (0000000000000001) MISMATCH\n  Communicator ranks have different status\n  Rank 1 has status \u{1b}[31mX -- GPU 1 managed by process 9 on node <b>\u{1b}]x\n";
    let v = from_text(evil);
    let r = &v.comms[0].ranks[0];
    let Why::Status { status, .. } = &r.why else {
        panic!("{r:?}")
    };
    assert_eq!(status, "\\x1b[31mX", "control characters escaped");
    let h = r.host.as_deref().unwrap_or_default();
    assert!(!h.contains('\u{1b}') && h.ends_with('…'), "{h:?}");
    let long = format!(
        "NCCL version {} compiled with CUDA 1\n",
        "9".repeat(100_000)
    );
    assert!(from_text(&long)
        .nccl_version
        .is_none_or(|s| s.chars().count() <= 64));
    assert_eq!(addresses(None).unwrap()[0].to_string(), "127.0.0.1:28028");
    assert_eq!(
        addresses(Some("[::1]:9")).unwrap()[0].to_string(),
        "[::1]:9"
    );
    assert_eq!(addresses(Some("localhost:7")).unwrap().len(), 2);
    assert!(addresses(Some("evil.example:28028")).is_err());
    assert!(addresses(Some("28028")).is_err());
    assert_eq!(
        env_var(b"A=1\0NCCL_RAS_ADDR=10.0.0.1:5\0", "NCCL_RAS_ADDR").as_deref(),
        Some("10.0.0.1:5")
    );
}
