//! Unit tests of the parent module (real line shapes; see also tests/corpus.rs).
use super::*;

fn fam(line: &str) -> Option<JobFamily> {
    classify(line).map(|f| f.family)
}

#[test]
fn rules_compile_and_ids_are_unique() {
    let mut ids: Vec<&str> = rules().map(|r| r.0).collect();
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), n);
    assert_eq!(COMPILED.len(), RULES.len());
    for r in RULES {
        Regex::new(r.re).unwrap_or_else(|e| panic!("{}: {e}", r.kind));
    }
}

#[test]
fn innermost_cause_wins() {
    // A watchdog that died of a CUDA error is a GPU fault, not a hang.
    let f = classify("[rank2]: terminate called after throwing an instance of 'c10::DistBackendError' what():  [PG 0 Rank 2] Process group watchdog thread terminated with exception: CUDA error: unspecified launch failure").unwrap();
    assert_eq!(
        (f.family, f.kind, f.rank),
        (GpuHw, "cuda_launch_failure", Some(2))
    );
    // NCCL's system error about /dev/shm is host shared memory, not storage or network.
    let f = classify("misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-03Xa3b to 9637892 bytes, error: No space left on device").unwrap();
    assert_eq!(f.family, HostMemory);
    // ibv_reg_mr failing for memlock is configuration.
    assert_eq!(
        fam("NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory"),
        Some(Software)
    );
}

#[test]
fn framework_words_for_storage_and_nccl_topology() {
    // torch.save on a full disk (ronin#51) and h5py's write failure are storage.
    assert_eq!(
        fam("RuntimeError: File my_out/checkpoints/checkpoint_0.pt cannot be opened."),
        Some(Storage)
    );
    assert_eq!(fam("OSError: Can't write data (file write failed: time = Tue Dec  1 10:00:00 2026, filename = 'feat.h5', file descriptor = 3, errno = 28, error message = 'No space left on device', buf = 0x55d0, total write size = 4096, bytes this sub-write = 4096, bytes actually written = 18446744073709551615, offset = 0)"), Some(Storage));
    // h5py's other `Can't write data` causes (a file opened read-only) are not storage.
    assert_eq!(
        fam("OSError: Can't write data (no write intent on file)"),
        None
    );
    // NCCL's topology search failing is its version or the layout, not the network.
    let f = classify("opt-1_3b.0 [stderr] Failed to find reverse path from remNode 0/5f000 nlinks 4 to node 0/cb000").unwrap();
    assert_eq!((f.family, f.kind), (Software, "nccl_topology"));
    // NCCL's own search falling back is not a failure.
    assert_eq!(fam("node1:311:402 [0] NCCL INFO Could not find a path for pattern 4, falling back to simple order"), None);
}

#[test]
fn codes_are_extracted() {
    let f = classify("node1:1234:1290 [3] NCCL WARN NET/IB : Got completion from peer 10.1.2.3<41234> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.1.2.4").unwrap();
    assert_eq!(f.family, Network);
    assert_eq!(f.code.as_deref(), Some("ibv status 12 (transport retry counter exceeded (link, peer or fabric trouble)), vendor err 129"));
    let f = classify("[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2315, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600041 milliseconds before timing out.").unwrap();
    assert_eq!((f.family, f.rank), (Hang, Some(0)));
    assert_eq!(
        f.code.as_deref(),
        Some("ALLREDUCE SeqNum=2315 timeout 600000 ms ran 600041 ms")
    );
    let f = classify("RuntimeError: CUDA error: uncorrectable ECC error encountered").unwrap();
    assert_eq!(
        (f.family, f.code.as_deref()),
        (GpuHw, Some("cudaErrorECCUncorrectable (214)"))
    );
    let f = classify("RuntimeError: cuda runtime error (39) : uncorrectable ECC error encountered at /pytorch/aten/src/THC/THCCachingHostAllocator.cpp:265").unwrap();
    assert_eq!(f.family, GpuHw);
    let f = classify("OSError: [Errno 116] Stale file handle: '/mnt/nfs/ckpt/step_1000'").unwrap();
    assert_eq!(
        (f.family, f.code.as_deref()),
        (Storage, Some("ESTALE (errno 116)"))
    );
    let f = classify("RuntimeError: DataLoader worker (pid 21423) is killed by signal: Killed. ")
        .unwrap();
    assert_eq!(
        (f.family, f.code.as_deref()),
        (HostMemory, Some("signal Killed"))
    );
}

#[test]
fn traps_are_not_evidence() {
    for l in [
        "node1:1234:1234 [0] NCCL INFO comm 0x55d5 rank 0 nranks 8 cudaDev 0 busId 1b000 - Init COMPLETE",
        "node1:1234:1300 [0] NCCL INFO [Service thread] Connection closed by localRank 1",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "2023-01-01 W tensorflow/core/common_runtime/bfc_allocator.cc:290] Allocator (GPU_0_bfc) ran out of memory trying to allocate 2.26GiB with freed_by_count=0. The caller indicates that this is not a failure, but may mean that there could be performance gains if more memory were available.",
        "step 100 | loss 2.31 | lr 3e-4 | error_rate 0.12",
        "Epoch 3: 45%|████▌     | 450/1000 [01:23<01:42, 5.37it/s, loss=0.693]",
        "  File \"/opt/conda/lib/python3.10/site-packages/torch/cuda/__init__.py\", line 300, in _lazy_init",
    ] {
        assert_eq!(classify(l).map(|f| f.kind), None, "{l}");
    }
}

#[test]
fn everyday_lines_are_not_evidence() {
    // Found by a review: status dumps, config, paths and retries that name the words.
    for l in [
        "    HW Slowdown                           : Not Active",
        "        Double Bit ECC                    : 0",
        "oom_kill 0",
        "Loading checkpoint from /lustre/fs1/proj/ckpt/step_1000.pt",
        "/scratch/gpfs/user/error_analysis/run3 created",
        "ddp config: {'bucket_cap_mb': 25, 'timeout': 1800}",
        "blob_size=4096 timeout=30",
        "\u{25cf} nvidia-fabricmanager.service - NVIDIA fabric manager service",
        "Checking NVLink error counters... all zero, OK",
        "GPU hours lost to preemption: 12",
        "Setting NCCL timeout to 1800 s",
        "Killed 2 stale processes from the previous run",
        "MemoryError handling: retrying with a smaller batch",
        "exit code 137 means the process was killed",
        "wandb: Network error (ReadTimeout), entering retry loop.",
        "[W socket.cpp:601] [c10d] The client socket has failed to connect to [gpu-node-01]:29500 (errno: 111 - Connection refused).",
        "RETRYABLE_ERRORS = ['unspecified launch failure', 'an illegal memory access was encountered']",
    ] {
        assert_eq!(classify(l).map(|f| (f.family, f.kind)), None, "{l}");
    }
    // The same words where they are the error still count.
    assert_eq!(fam("MemoryError"), Some(HostMemory));
    assert_eq!(fam("Killed"), Some(HostMemory));
    assert_eq!(fam("slurmstepd: error: Detected 1 oom_kill event in StepId=123.0. Some of the step tasks have been OOM Killed."), Some(HostMemory));
    assert_eq!(fam("UserWarning: CUDA initialization: CUDA unknown error - this may be due to an incorrectly set up environment"), Some(GpuHw));
    assert_eq!(
        fam("UserWarning: [Errno 28] No space left on device.  joblib will operate in serial mode"),
        None
    );
}

#[test]
fn traceback_is_one_error_and_frames_are_skipped() {
    let mut r = Reader::default();
    let tb = [
        "Traceback (most recent call last):",
        "  File \"train.py\", line 10, in <module>",
        "    raise RuntimeError(\"CUDA error: an illegal memory access was encountered\")",
        "OSError: [Errno 5] Input/output error: '/data/shard-17.tar'",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        "  File \"train.py\", line 20, in <module>",
        "    main()",
        "ValueError: could not read batch",
    ];
    let got: Vec<JobFault> = tb.iter().filter_map(|l| r.line(l)).collect();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!((got[0].family, got[1].family), (Storage, Software));
    assert!(got[0].group != 0 && got[0].group == got[1].group);
    // Rank-prefixed tracebacks of two ranks interleaved keep their own state.
    let mut r = Reader::default();
    let got: Vec<JobFault> = [
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: Traceback (most recent call last):",
        "[rank0]:   File \"t.py\", line 3, in f",
        "[rank1]:   File \"t.py\", line 3, in f",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "[rank1]: RuntimeError: CUDA error: misaligned address",
    ]
    .iter()
    .filter_map(|l| r.line(l))
    .collect();
    assert_eq!(
        got.iter().map(|f| (f.family, f.rank)).collect::<Vec<_>>(),
        vec![(GpuOom, Some(0)), (GpuAmbiguous, Some(1))]
    );
}

#[test]
fn ansi_and_localized_killed() {
    assert_eq!(
        fam("\x1b[31mRuntimeError: CUDA error: unspecified launch failure\x1b[0m"),
        Some(GpuHw)
    );
    assert_eq!(fam("Killed"), Some(HostMemory));
    assert_eq!(fam("/var/spool/slurmd/job01/slurm_script: line 12: 48213 Killed                  python train.py"), Some(HostMemory));
    assert_eq!(fam("Getötet"), Some(HostMemory));
    assert_eq!(fam("Killed 0 processes"), None);
}

#[test]
fn reader_state_is_bounded() {
    let mut r = Reader::default();
    for i in 0..20_000 {
        r.line(&format!("[rank{i}]: Traceback (most recent call last):"));
    }
    assert!(r.states.len() <= Reader::MAX_RANKS);
}

/// A log that kept only the NCCL watchdog's C++ stack (incidents 014, 025, hangs 003) is a
/// collective timeout; every other frame, the watchdog's own included, stays no evidence (a
/// CUDA error raised on the watchdog thread prints `ncclCommWatchdog` frames too).
#[test]
fn the_watchdogs_timeout_frame_is_a_hang_and_other_frames_are_not() {
    let f = classify("frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x1d2 (0x7f9391ba8c62 in /x/site-packages/torch/lib/libtorch_cuda.so)").unwrap();
    assert_eq!((f.family, f.kind), (Hang, "nccl_watchdog_frame"));
    for other in [
        "frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x1a0 (0x7f9391bada80 in /x/libtorch_cuda.so)",
        "frame #3: c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x10c (0x7f9391baedcc in /x/libtorch_cuda.so)",
        "Exception raised from ncclCommWatchdog at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1521 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in /x/libc10.so)",
    ] {
        assert_eq!(classify(other).map(|f| f.kind), None, "{other}");
    }
}
