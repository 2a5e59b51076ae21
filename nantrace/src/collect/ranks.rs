//! Which rank of a distributed job a process is, from the launcher's variables in its
//! environment: torchrun / torch.distributed (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
//! `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`), Open MPI
//! (`OMPI_COMM_WORLD_*`), PMI (`PMI_RANK`, `PMI_SIZE`), Slurm (`SLURM_PROCID`, `SLURM_NODEID`,
//! `SLURM_NTASKS`), and the GPUs it may use (`CUDA_VISIBLE_DEVICES`). Read as root from
//! /proc/PID/environ; only these keys are kept, each checked against its shape (a number, a
//! host name, an id), and bounded. They are the job's own claims about itself: they say which
//! rank a node's bundle speaks for, never what is wrong with the machine.
use serde::Serialize;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RankRef {
    /// `torch`, `mpi`, `pmi` or `slurm`: whose variables gave the rank.
    pub launcher: &'static str,
    pub rank: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// The node's rank in the job (torchrun's GROUP_RANK, Slurm's SLURM_NODEID).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_rank: Option<u32>,
    /// `MASTER_ADDR:MASTER_PORT` (the rendezvous every rank of one job shares).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_visible_devices: Option<String>,
    /// The GPUs (`/dev/nvidiaN` minors) this process holds open, from its descriptors.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
}

/// A rank, a size: a number below 2^24 (no job has more ranks).
fn num(v: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(v).ok()?;
    (!s.is_empty() && s.len() <= 8 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
        .filter(|n| *n < 1 << 24)
}

/// Text of a given shape: at most `max` bytes of `ok` characters, else nothing.
fn shaped(v: &[u8], max: usize, ok: impl Fn(u8) -> bool) -> Option<String> {
    (!v.is_empty() && v.len() <= max && v.iter().all(|b| ok(*b)))
        .then(|| String::from_utf8_lossy(v).into_owned())
}

/// The rank a process's environment claims, when a launcher set one.
pub fn from_environ(environ: &[u8]) -> Option<RankRef> {
    let mut v: std::collections::HashMap<&[u8], &[u8]> = std::collections::HashMap::new();
    for kv in environ.split(|&b| b == 0).take(10_000) {
        let Some(eq) = kv.iter().position(|&b| b == b'=') else {
            continue;
        };
        let k = &kv[..eq];
        if KEYS.contains(&k) {
            v.entry(k).or_insert(&kv[eq + 1..]);
        }
    }
    let get = |k: &str| v.get(k.as_bytes()).copied();
    let n = |k: &str| get(k).and_then(num);
    let (launcher, rank, local, size) = if let Some(r) =
        n("RANK").filter(|_| get("WORLD_SIZE").is_some() || get("LOCAL_RANK").is_some())
    {
        ("torch", r, n("LOCAL_RANK"), n("WORLD_SIZE"))
    } else if let Some(r) = n("OMPI_COMM_WORLD_RANK") {
        (
            "mpi",
            r,
            n("OMPI_COMM_WORLD_LOCAL_RANK"),
            n("OMPI_COMM_WORLD_SIZE"),
        )
    } else if let Some(r) = n("PMI_RANK") {
        ("pmi", r, n("MPI_LOCALRANKID"), n("PMI_SIZE"))
    } else if let Some(r) = n("SLURM_PROCID") {
        ("slurm", r, n("SLURM_LOCALID"), n("SLURM_NTASKS"))
    } else {
        return None;
    };
    let host =
        |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'[' | b']');
    let master = match (
        get("MASTER_ADDR").and_then(|a| shaped(a, 253, host)),
        get("MASTER_PORT").and_then(num),
    ) {
        (Some(a), Some(p)) => Some(format!("{a}:{p}")),
        (Some(a), None) => Some(a),
        _ => None,
    };
    Some(RankRef {
        launcher,
        rank,
        local_rank: local,
        world_size: size,
        node_rank: n("GROUP_RANK").or_else(|| n("SLURM_NODEID")),
        master,
        run_id: get("TORCHELASTIC_RUN_ID").and_then(|r| {
            shaped(r, 64, |b| {
                b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
            })
        }),
        cuda_visible_devices: get("CUDA_VISIBLE_DEVICES").and_then(|c| {
            shaped(c, 256, |b| {
                b.is_ascii_alphanumeric() || matches!(b, b',' | b'-')
            })
        }),
        gpus: Vec::new(),
    })
}

const KEYS: &[&[u8]] = &[
    b"RANK",
    b"LOCAL_RANK",
    b"WORLD_SIZE",
    b"GROUP_RANK",
    b"MASTER_ADDR",
    b"MASTER_PORT",
    b"TORCHELASTIC_RUN_ID",
    b"OMPI_COMM_WORLD_RANK",
    b"OMPI_COMM_WORLD_LOCAL_RANK",
    b"OMPI_COMM_WORLD_SIZE",
    b"PMI_RANK",
    b"PMI_SIZE",
    b"MPI_LOCALRANKID",
    b"SLURM_PROCID",
    b"SLURM_LOCALID",
    b"SLURM_NTASKS",
    b"SLURM_NODEID",
    b"CUDA_VISIBLE_DEVICES",
];

/// At most this many ranks of one node are listed in a bundle.
pub const MAX_RANKS: usize = 256;

/// What a job's bundle says about its ranks on this node: the launcher, the job's size and
/// rendezvous, this node's rank, and each rank's process, local rank and GPUs.
pub fn identity(ranks: &std::collections::BTreeMap<u32, RankRef>) -> Option<serde_json::Value> {
    let first = ranks.values().next()?;
    let list: Vec<serde_json::Value> = ranks.iter().take(MAX_RANKS).map(|(pid, r)| serde_json::json!({ "pid": pid, "rank": r.rank, "local_rank": r.local_rank, "gpus": r.gpus, "cuda_visible_devices": r.cuda_visible_devices })).collect();
    Some(serde_json::json!({
        "launcher": first.launcher,
        "world_size": first.world_size,
        "node_rank": first.node_rank,
        "master": first.master,
        "run_id": first.run_id,
        "ranks": list,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kv: &[&str]) -> Vec<u8> {
        kv.join("\0").into_bytes()
    }

    #[test]
    fn each_launchers_rank_and_nothing_else() {
        let t = from_environ(&env(&[
            "HOME=/root",
            "RANK=9",
            "LOCAL_RANK=1",
            "WORLD_SIZE=16",
            "GROUP_RANK=1",
            "MASTER_ADDR=n1.cluster",
            "MASTER_PORT=29500",
            "TORCHELASTIC_RUN_ID=job-4711",
            "CUDA_VISIBLE_DEVICES=0,1",
            "AWS_SECRET_ACCESS_KEY=x",
        ]))
        .unwrap();
        assert_eq!(
            (t.launcher, t.rank, t.local_rank, t.world_size, t.node_rank),
            ("torch", 9, Some(1), Some(16), Some(1))
        );
        assert_eq!(
            (
                t.master.as_deref(),
                t.run_id.as_deref(),
                t.cuda_visible_devices.as_deref()
            ),
            (Some("n1.cluster:29500"), Some("job-4711"), Some("0,1"))
        );
        assert!(
            !serde_json::to_string(&t).unwrap().contains("SECRET"),
            "only the launcher's keys are kept"
        );
        let m = from_environ(&env(&[
            "OMPI_COMM_WORLD_RANK=3",
            "OMPI_COMM_WORLD_SIZE=8",
            "OMPI_COMM_WORLD_LOCAL_RANK=3",
        ]))
        .unwrap();
        assert_eq!((m.launcher, m.rank, m.world_size), ("mpi", 3, Some(8)));
        assert_eq!(
            from_environ(&env(&["PMI_RANK=2", "PMI_SIZE=4"]))
                .unwrap()
                .launcher,
            "pmi"
        );
        let s = from_environ(&env(&[
            "SLURM_PROCID=5",
            "SLURM_NTASKS=12",
            "SLURM_NODEID=2",
        ]))
        .unwrap();
        assert_eq!((s.launcher, s.rank, s.node_rank), ("slurm", 5, Some(2)));
        // torchrun's RANK wins over Slurm's (torchrun under srun: its ranks are the job's).
        assert_eq!(
            from_environ(&env(&["SLURM_PROCID=0", "RANK=7", "WORLD_SIZE=8"]))
                .unwrap()
                .rank,
            7
        );
        assert_eq!(
            from_environ(&env(&["HOME=/root", "RANK=3"])),
            None,
            "a RANK alone is any program's variable"
        );
    }

    /// The values are the job's own words: anything out of shape is dropped, not kept.
    #[test]
    fn values_out_of_shape_are_dropped() {
        let t = from_environ(&env(&[
            "RANK=1",
            "WORLD_SIZE=99999999999",
            "MASTER_ADDR=evil\nhost <b>",
            "TORCHELASTIC_RUN_ID=a/../b",
            "CUDA_VISIBLE_DEVICES=$(rm -rf /)",
        ]))
        .unwrap();
        assert_eq!(
            (t.world_size, t.master, t.run_id, t.cuda_visible_devices),
            (None, None, None, None)
        );
        assert_eq!(from_environ(&env(&["RANK=-1", "WORLD_SIZE=2"])), None);
    }
}
