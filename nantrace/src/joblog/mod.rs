//! The job's own failure lines: CUDA, NCCL/IB/RoCE, PyTorch distributed, DataLoader, host
//! memory, GPU memory limits, storage and software errors, with the code each one carries.
//!
//! Rules are tried in order and the first match wins; the order encodes "the innermost cause
//! wins": a watchdog line that wraps `CUDA error: unspecified launch failure` is a GPU fault,
//! an NCCL `unhandled system error` about `posix_fallocate` in /dev/shm is host shared memory,
//! an `ibv_reg_mr` failure that names the memlock limit is configuration. Lines that are
//! progress or boilerplate (`NCCL INFO`, the "CUDA kernel errors might be asynchronously
//! reported" hint, allocator notes that say they are not a failure) are never evidence.
//!
//! [`Reader`] keeps a little state per stream so that a multi-line Python traceback is read as
//! one error: frame lines are skipped, and every exception of a chain gets the same group id
//! (the first one printed is the innermost cause). The formats, with real examples, are in
//! docs/log-formats.md; the corpus test is tests/joblog_corpus.rs.
use std::collections::HashMap;
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

/// What a failure line says about where the fault is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobFamily {
    /// GPU hardware or driver: uncorrectable ECC, GPU lost, unspecified launch failure...
    GpuHw,
    /// A GPU fault that hardware or software can cause (illegal address, cuBLAS failure).
    GpuAmbiguous,
    /// NCCL/IB/RoCE/socket/UCX errors between nodes.
    Network,
    /// A collective that stopped making progress (watchdog, heartbeat): cause not yet known.
    Hang,
    /// Host RAM or shared memory: OOM-killed workers, /dev/shm too small, MemoryError.
    HostMemory,
    /// The job asked for more GPU memory than there is: a limit, not a fault.
    GpuOom,
    /// I/O errors, stale handles, full disks, object-store timeouts.
    Storage,
    /// Bugs and configuration: asserts, shapes, versions, missing libraries, limits.
    Software,
}

impl JobFamily {
    pub fn as_str(self) -> &'static str {
        match self {
            JobFamily::GpuHw => "gpu_hw",
            JobFamily::GpuAmbiguous => "gpu_ambiguous",
            JobFamily::Network => "network",
            JobFamily::Hang => "hang",
            JobFamily::HostMemory => "host_memory",
            JobFamily::GpuOom => "gpu_oom",
            JobFamily::Storage => "storage",
            JobFamily::Software => "software",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            JobFamily::GpuHw,
            JobFamily::GpuAmbiguous,
            JobFamily::Network,
            JobFamily::Hang,
            JobFamily::HostMemory,
            JobFamily::GpuOom,
            JobFamily::Storage,
            JobFamily::Software,
        ]
        .into_iter()
        .find(|f| f.as_str() == s)
    }
}

/// One classified failure line.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobFault {
    pub family: JobFamily,
    /// The rule's id (`cuda_ecc`, `ib_completion`...): docs/log-formats.md lists them.
    pub kind: &'static str,
    /// What the rule means, in words.
    pub what: &'static str,
    /// The error code found (CUDA error name/number, NCCL result, IB status, errno, signal).
    pub code: Option<String>,
    /// A generic line that a more specific one near it explains (`unhandled system error`).
    pub generic: bool,
    /// The job is about to die (a trigger of its own when the family can be the machine).
    pub fatal: bool,
    /// Rank printed in the line's prefix (`[rank3]:`, `[default3]:`, `3: `, `[1,3]<stderr>:`).
    pub rank: Option<u32>,
    /// Lines of one traceback or exception chain share a group (0 = not in a traceback).
    pub group: u32,
}

struct Rule {
    kind: &'static str,
    family: Option<JobFamily>,
    what: &'static str,
    re: &'static str,
    /// The CUDA name and number of the error when the line says it in words only.
    canonical: Option<&'static str>,
    generic: bool,
    fatal: bool,
}

const fn r(kind: &'static str, family: JobFamily, what: &'static str, re: &'static str) -> Rule {
    Rule {
        kind,
        family: Some(family),
        what,
        re,
        canonical: None,
        generic: false,
        fatal: true,
    }
}

impl Rule {
    const fn code(mut self, c: &'static str) -> Self {
        self.canonical = Some(c);
        self
    }
    const fn generic(mut self) -> Self {
        self.generic = true;
        self
    }
    const fn nonfatal(mut self) -> Self {
        self.fatal = false;
        self
    }
}

/// Lines that are never evidence, whatever else they contain.
const fn ignore(kind: &'static str, re: &'static str) -> Rule {
    Rule {
        kind,
        family: None,
        what: "not evidence",
        re,
        canonical: None,
        generic: false,
        fatal: false,
    }
}

use JobFamily::{GpuAmbiguous, GpuHw, GpuOom, Hang, HostMemory, Network, Software, Storage};

/// A CUDA error given only as its number, in the shapes runtimes print it
/// (`cudaGetDeviceProperties returned 35`, THCudaCheck `error=30`, `cudaStat (0 vs. 39)`).
macro_rules! cuda_code {
    ($codes:literal) => {
        concat!(r"(?i:\bcuda[a-z]\w*(?:\(\))? (?:returned|failed with (?:error )?(?:code )?)\s*:?\s*|THCudaCheck FAIL[^\n]*error=|CUDA error:? |cuda runtime error \(|cudaStat \(0 vs\. )", $codes, r"\b")
    };
}

/// The rules, in priority order (the first match wins). Keep docs/log-formats.md in step.
const RULES: &[Rule] = &[
    // Never evidence.
    ignore("nccl_info", r"\bNCCL INFO\b"),
    // Only when the hint is the line (a line that starts with the error itself is the error).
    ignore("cuda_async_hint", r"(?i)^\W*(?:CUDA kernel errors might be asynchronously reported|For debugging consider passing CUDA_LAUNCH_BLOCKING|Compile with .?TORCH_USE_CUDA_DSA|HIP kernel errors might be|Search for .cudaError\w+. in https://docs\.nvidia\.com)"),
    ignore("not_a_failure", r"(?i)this is not a failure|is not a failure, but|may not be a failure|retrying allocation|will retry|Retrying in \d|entering retry loop|The client socket has failed to connect|waiting for (?:the )?(?:master|store|rendezvous)"),
    // A literal in code or configuration (`RETRYABLE = ['unspecified launch failure', ...]`).
    ignore("literal", r#"^\s*[A-Za-z_][\w.]*\s*=\s*[\[{(]?\s*['"]"#),
    // The one C++ frame that is a failure by itself: the NCCL watchdog's timeout check at the
    // top of its stack (a log that kept only the frames: incidents 014, 025, hangs 003).
    r("nccl_watchdog_frame", Hang, "collective timed out (NCCL watchdog; only its C++ stack in view)", r"^\s*frame #\d+: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout\b"),
    ignore("cxx_frame", r"^\s*(?:frame #\d+:|Exception raised from |\d+\s+0x[0-9a-f]+ |#\d+ 0x[0-9a-f]+ in )"),
    ignore("deprecation", r"(?i)\bis deprecated\b|\bdeprecat(?:ed|ion) warning|FutureWarning|DeprecationWarning"),
    ignore("env_dump", r"(?i)^\s*(?:export\s+)?[A-Z][A-Z0-9_]*=\S*\s*$"),
    ignore("teardown", r#"(?i)"should dump" flag|Failed to get exception dump flag|failed to shutdown the rendezvous|has shut down too early|killed by signal: (?:Terminated|Interrupt)|^\s*traceback\s*:\s*Signal \d+ \(SIG(?:ABRT|TERM|INT)\)|^\s*Aborted(?: \(core dumped\))?\s*$"#),
    ignore("ulimit_listing", r"^\s*max locked memory\s+\(kbytes"),
    ignore("zero_count", r"(?i)\b(?:0|no) (?:errors?|failures?|processes) (?:found|killed|detected)|\bkilled 0\b|errors?\s*[:=]\s*0\b"),
    // Host shared memory, before storage (ENOSPC in /dev/shm) and NCCL's generic system error.
    r("shm_missing", Software, "shared memory segment of a peer not found (processes in different IPC namespaces / containers)", r"(?i)(?:shmutils|shm\.h|/dev/shm)[^\n]*No such file or directory|attaching to shared memory segment[^\n]*No such file"),
    r("shm_exhausted", HostMemory, "shared memory (/dev/shm) too small or exhausted", r"(?i)insufficient shared memory|shared memory \(shm\)|/dev/shm|posix_fallocate|shm_open|unable to (?:open|write to|mmap) shared memory|shared memory (?:segment|file)[^\n]*(?:fail|error|no space)|creating shared memory segment|__shm_|ncclShm"),
    // Memlock limit: configuration, before the ibv and host ENOMEM rules.
    r("memlock_limit", Software, "locked-memory (memlock) limit too low for RDMA", r"(?i)\bmemlock\b|ulimit -l|RLIMIT_MEMLOCK|locked memory limit|ibv_reg_mr[^\n]*Cannot allocate memory|ibv_reg_mr[^\n]*\berrno\s*12\b"),
    // GPU memory limit.
    r("gpu_oom", GpuOom, "GPU out of memory (a resource limit, not a fault)", r"(?i)CUDA out of memory|torch\.(?:cuda\.)?OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|Cuda failure '?out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|\bRESOURCE_EXHAUSTED\b|OOM when allocating|out of memory (?:on|in) (?:device|GPU)|HIP out of memory|cuMemAlloc\w*[^\n]*OUT_OF_MEMORY|XlaRuntimeError: RESOURCE_EXHAUSTED|Out of memory while trying to allocate|failed to allocate [\d.]+\s*[KMGT]?i?B[^\n]* (?:from|on) device|NVML_ERROR_INSUFFICIENT_RESOURCES|BufferAssignment OOM|THCudaCheck FAIL[^\n]*out of memory|Cuda failure (?:\d+ )?'?out of memory").code("cudaErrorMemoryAllocation (2)"),
    // GPU hardware and driver.
    r("cuda_ecc", GpuHw, "uncorrectable ECC error", r"(?i)uncorrectable ECC|ECC_UNCORRECTABLE|cudaErrorECCUncorrectable|ECCUncorrectable|cuda runtime error \(39\)|CUDA error (?:214|39)\b").code("cudaErrorECCUncorrectable (214)"),
    r("gpu_lost", GpuHw, "GPU lost / fallen off the bus", r"(?i)GPU is lost|fallen off the bus|GPU has fallen|NVML_ERROR_GPU_IS_LOST|GPU_IS_LOST|GPU lost from the bus|Unable to determine the device handle for GPU|lost (?:the )?connection to (?:the )?GPU|cudaErrorDevicesUnavailable[^\n]*lost"),
    r("cuda_launch_failure", GpuHw, "unspecified launch failure", r"(?i)unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|cudaErrorLaunchFailure|cuda runtime error \(4\)").code("cudaErrorLaunchFailure (719)"),
    r("cuda_launch_timeout", GpuHw, "kernel launch timed out", r"(?i)the launch timed out and was terminated|CUDA_ERROR_LAUNCH_TIMEOUT|cudaErrorLaunchTimeout|cuda runtime error \(6\)").code("cudaErrorLaunchTimeout (702)"),
    r("nvlink_error", GpuHw, "NVLink error", r"(?i)uncorrectable NVLink|NVLINK_UNCORRECTABLE|cudaErrorNvlinkUncorrectable|NVLink (?:error|failure|fault) (?:detected|occurred|on link|reported)|NVLink (?:fatal|link down|training failed)|nvlink[^\n]{0,40}(?:fatal|uncorrectable)").code("cudaErrorNvlinkUncorrectable (220)"),
    r("cuda_unknown_error", GpuHw, "CUDA/driver 'unknown error'", r"(?i)CUDA error: unknown error|CUDA_ERROR_UNKNOWN|cudaErrorUnknown|cuda runtime error \(30\)|CUDA driver error: unknown error|CUDA unknown error|THCudaCheck FAIL[^\n]*unknown error|Cuda failure (?:\d+ )?'?unknown error").code("cudaErrorUnknown (999)"),
    r("driver_unreachable", GpuHw, "the NVIDIA driver or GPU stopped answering", r"(?i)couldn'?t communicate with the NVIDIA driver|NVML_ERROR_UNKNOWN|Unable to determine the device handle|GPU requires reset|NVML_ERROR_RESET_REQUIRED|Xid \((?:PCI:)?[0-9a-fA-F:.]+\): (?:48|62|64|74|79|92|94|95|119|120|140)\b|system not yet initialized|cudaErrorSystemNotReady|CUDA_ERROR_SYSTEM_NOT_READY|fabric ?manager[^\n]*(?:not running|failed|error|inactive \(dead\))"),
    // Python warnings are not failures (after the GPU rules: a CUDA driver error in a warning is one).
    ignore("python_warning", r"\b(?:UserWarning|RuntimeWarning|ResourceWarning|FutureWarning):"),
    // GPU, hardware or software.
    r("cuda_illegal_address", GpuAmbiguous, "illegal memory access (hardware or software)", r"(?i)illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress|cuda runtime error \(77\)|CUDA error 700\b").code("cudaErrorIllegalAddress (700)"),
    r("cuda_misaligned", GpuAmbiguous, "misaligned address (hardware or software)", r"(?i)misaligned address|CUDA_ERROR_MISALIGNED_ADDRESS|cudaErrorMisalignedAddress").code("cudaErrorMisalignedAddress (716)"),
    r("cuda_illegal_instruction", GpuAmbiguous, "illegal instruction on the GPU (hardware or software)", r"(?i)illegal instruction was encountered|CUDA_ERROR_ILLEGAL_INSTRUCTION|cudaErrorIllegalInstruction|hardware stack error|cudaErrorHardwareStackError|CUDA_ERROR_HARDWARE_STACK_ERROR|invalid program counter|cudaErrorInvalidPc").code("cudaErrorIllegalInstruction (715)"),
    r("cublas_cudnn_failed", GpuAmbiguous, "cuBLAS/cuDNN execution failed (hardware or software)", r"(?i:the GPU program failed to execute)|CUBLAS_STATUS_EXECUTION_FAILED|CUDNN_STATUS_EXECUTION_FAILED|CUBLAS_STATUS_INTERNAL_ERROR|CUDNN_STATUS_INTERNAL_ERROR|CUDNN_STATUS_MAPPING_ERROR|CUBLAS_STATUS_MAPPING_ERROR|CUFFT_EXEC_FAILED|CUSOLVER_STATUS_EXECUTION_FAILED|CUSOLVER_STATUS_INTERNAL_ERROR"),
    r("gpu_busy_unavailable", GpuAmbiguous, "CUDA device busy or unavailable (exclusive mode, another process, or a GPU in a bad state)", r"(?i)busy or unavailable|cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICE_UNAVAILABLE").code("cudaErrorDevicesUnavailable (46)"),
    r("no_gpu_visible", Software, "no GPU visible to the job (CUDA_VISIBLE_DEVICES, container runtime, driver not loaded)", r"(?i)no CUDA-capable device is detected|No CUDA GPUs are available|cudaErrorNoDevice|CUDA_ERROR_NO_DEVICE|CUDA driver initialization failed|Found no NVIDIA driver|NVIDIA driver on your system is too old").code("cudaErrorNoDevice (100)"),
    r("pytorch_internal_assert", Software, "PyTorch internal assertion (a framework bug)", r"INTERNAL ASSERT FAILED|please report a bug to PyTorch"),
    // Software and configuration that CUDA reports.
    r("device_side_assert", Software, "device-side assert (a bug in the job or its data)", r"(?i)device-side assert(?:ion)? triggered|CUDA_ERROR_ASSERT|cudaErrorAssert|Assertion `[^`']*[`'] failed|\.cu:\d+: \w+: block: \[").code("cudaErrorAssert (710)"),
    r("invalid_device", Software, "invalid device ordinal (CUDA_VISIBLE_DEVICES / rank mapping)", r"(?i)invalid device ordinal|cudaErrorInvalidDevice\b|CUDA_ERROR_INVALID_DEVICE").code("cudaErrorInvalidDevice (101)"),
    r("no_kernel_image", Software, "no kernel image for this GPU (wheel not built for its compute capability)", r"(?i)no kernel image is available|cudaErrorNoKernelImageForDevice|CUDA_ERROR_NO_BINARY_FOR_GPU|is not compatible with the current PyTorch installation|CUDA capability sm_\d+ is not compatible|no binary for gpu").code("cudaErrorNoKernelImageForDevice (209)"),
    r("driver_mismatch", Software, "driver/runtime version mismatch", r"(?i)driver version is insufficient|cudaErrorInsufficientDriver|CUDA_ERROR_SYSTEM_DRIVER_MISMATCH|cudaErrorSystemDriverMismatch|unsupported display driver / cuda driver combination|Driver/library version mismatch|version mismatch[^\n]*(?:driver|NVML|NCCL|CUDA)|forward compatibility was attempted|compiled with CUDA \S+ but|The NVIDIA driver on your system is too old|Found no NVIDIA driver|CUDA_ERROR_COMPAT_NOT_SUPPORTED|cuDNN version incompatibility|PTX was compiled with an unsupported toolchain|cudaErrorUnsupportedPtxVersion").code("cudaErrorInsufficientDriver (35)"),
    r("cuda_misuse", Software, "invalid CUDA call (argument, configuration, resources)", r"(?i)CUDA error: invalid (?:argument|configuration argument|resource handle|value)|cudaErrorInvalidValue|cudaErrorInvalidConfiguration|too many resources requested for launch|cudaErrorLaunchOutOfResources|CUBLAS_STATUS_INVALID_VALUE|CUBLAS_STATUS_NOT_SUPPORTED|CUDNN_STATUS_BAD_PARAM|CUDNN_STATUS_NOT_SUPPORTED|CUBLAS_STATUS_NOT_INITIALIZED|CUDNN_STATUS_NOT_INITIALIZED|operation not permitted when stream is capturing|CUDA error: operation not supported|Cuda failure (?:\d+ )?'?invalid (?:argument|device|value|resource handle)|error=\d+ : invalid (?:argument|configuration argument|device function|resource handle|value)|named symbol not found|invalid device function|cudaErrorSymbolNotFound|cudaErrorInvalidDeviceFunction"),
    r("nccl_unhandled_cuda", GpuAmbiguous, "NCCL: unhandled CUDA error", r"(?i)unhandled cuda error|ncclUnhandledCudaError|NCCL WARN Cuda failure").generic(),
    // CUDA errors given only as a number (`cudaGetDeviceProperties returned 35`, THCudaCheck
    // `error=30`, `cudaStat (0 vs. 39)`); both the old (<= CUDA 10.0) and the current numbering.
    r("cuda_code_hw", GpuHw, "CUDA error number of a hardware/driver fault (ECC, launch failure, unknown)", cuda_code!("(?:214|39|719|999|30)")),
    r("cuda_code_ambiguous", GpuAmbiguous, "CUDA error number of an illegal/misaligned address (hardware or software)", cuda_code!("(?:700|77|716|715|714)")),
    r("cuda_code_oom", GpuOom, "CUDA error number 2 (out of memory)", cuda_code!("2")),
    r("cuda_code_config", Software, "CUDA error number of a configuration problem (driver too old, no device, invalid device, no kernel image, assert)", cuda_code!("(?:35|100|101|209|710|38|10|48|59|803|804)")),
    // NCCL's topology search gave up: an NCCL older than the system's GPUs/NVLink, a wrong
    // topology file, or a GPU or link missing from the layout (milabench#183: NCCL 2.14 on H100).
    r("nccl_topology", Software, "NCCL could not map the GPUs' PCIe/NVLink topology (an NCCL older than this system, a wrong NCCL_TOPO_FILE, or GPUs given to a VM or container without their NVLink peers: compare nvidia-smi topo -m with what NCCL_DEBUG=INFO lists)", r"(?i)Failed to find reverse path|ncclTopoCompute\w*[^\n]*fail|topology (?:detection|search) failed|Failed to compute (?:topology )?paths"),
    // Network.
    r("ib_completion", Network, "InfiniBand/RoCE work completion error", r"(?i)Got completion (?:from peer \S+ )?with (?:error|status)|\bwc(?:\.|_)status\s*[=:]|completion with error|IBV_WC_\w+_ERR|transport retry counter exceeded|RNR retry counter exceeded|Work Request Flushed Error|ibv_poll_cq[^\n]*(?:fail|error)"),
    r("ibv_failure", Network, "RDMA verbs call failed", r"(?i)\bibv_\w+(?:\(\))? failed|Call to ibv_\w+ failed|ibv_\w+ (?:returned|error)|NET/IB ?: [^\n]*(?:failed|error|Error)|rdma_\w+ failed|mlx5\w*: [^\n]*(?:error|fail)|No IB devices? found|IB port \d+ (?:is )?down|ibv_open_device"),
    r("ucx_error", Network, "UCX transport error", r"(?:\bUCX\s+ERROR\b|ib_mlx5_log\.c|\bucp_\w+[^\n]*(?:failed|error)|\buct_\w+[^\n]*(?:failed|error)|UCX_ERROR|Transport retry count exceeded|UCS_ERR_\w+)"),
    r("nccl_net", Network, "NCCL network transport error", r"(?i)NCCL WARN (?:NET|Net|net)(?:/\w+)? ?:|NCCL WARN [^\n]*(?:socket|Socket|Connection|connection (?:closed|reset|refused)|peer|timed out|timeout)|NCCL WARN Net[^\n]*Connection closed|NET/Socket|NET/OFI[^\n]*(?:error|fail)|NCCL WARN [^\n]*proxy"),
    // gloo's collective timeout: a peer rank never sent or received (a hang), as NCCL's
    // watchdog timeout; not the network by itself (tests/torch_job.rs: a rank stopped in Python).
    r("gloo_timeout", Hang, "collective timed out (gloo: a peer rank never sent or received)", r"(?i:gloo|transport/tcp)[^\n]*Timed out waiting \d+ ?ms for (?:recv|send) operation"),
    r("socket_reset", Network, "socket / TCPStore / rendezvous connection lost or timed out", r"(?i)(?:TCPStore|rendezvous|Rendezvous|c10d|gloo|Gloo|socket|Socket|store|recvValue|sendBytes|recvBytes|DistNetworkError|DistStoreError|ProcessGroup|tcp|TCP|pair\.cc|connect)[^\n]*(?:Connection reset by peer|Connection refused|Connection closed by (?:remote )?peer|Broken pipe|Connection timed out|No route to host|Network is unreachable|timed out after|Socket Timeout|Timed out after \d+ seconds|errno: ?(?:104|110|111|113)|Connection was likely closed)|(?:Connection reset by peer|Broken pipe|Connection refused)[^\n]*(?:socket|tensorpipe|gloo|TCPStore|store)|connect\(\) timed out|DistNetworkError|RendezvousConnectionError|RendezvousTimeoutError|Socket Timeout|Connection reset by peer|failed to recv, got 0 bytes|Connection closed by (?:remote )?peer"),
    r("rdma_transport", Network, "RDMA/RoCE transport error", r"(?:\bRoCE\b|\bRDMA\b|\bInfiniBand\b|\bInfiniband\b|\bIB\b)[^\n]*(?i:link (?:down|flap)|port (?:down|error)|retry exceeded|timeout|timed out|\berror\b)"),
    // Storage.
    r("eio", Storage, "I/O error (EIO)", r"(?i)\[Errno 5\]|Input/output error|\bEIO\b|errno 5\b|I/O error").code("EIO (errno 5)"),
    // torch.save's writer says only `File X cannot be opened.` (inline_container.cc) whatever
    // the errno (ronin#51: a full disk; also a missing or read-only directory); h5py's write
    // failure is `file write failed` with its errno.
    r("checkpoint_write_failed", Storage, "checkpoint write failed (disk full, quota, I/O error, or a missing or read-only directory)", r"(?i)PytorchStreamWriter failed writing|file write failed|failed to write checkpoint|error writing checkpoint|(?-i:\bFile \S+ cannot be opened\.)"),
    r("estale", Storage, "stale file handle (network filesystem)", r"(?i)\[Errno 116\]|Stale (?:file|NFS file) handle|\bESTALE\b").code("ESTALE (errno 116)"),
    r("enospc", Storage, "no space left on device", r"(?i)\[Errno 28\]|No space left on device|\bENOSPC\b|out of disk space|not enough (?:free )?disk space").code("ENOSPC (errno 28)"),
    r("edquot", Storage, "disk quota exceeded", r"(?i)\[Errno 122\]|Disk quota exceeded|\bEDQUOT\b").code("EDQUOT (errno 122)"),
    r("erofs", Storage, "read-only file system (remounted after errors?)", r"(?i)\[Errno 30\]|Read-only file system|\bEROFS\b").code("EROFS (errno 30)"),
    r("fs_disconnected", Storage, "network or FUSE filesystem went away", r"(?i)Transport endpoint is not connected|\[Errno 107\]|\[Errno 121\]|Remote I/O error|\bENOTCONN\b|Host is down|\[Errno 112\]|LustreError|lustre[^\n]*evicted|mmfs\w*: [^\n]*(?:Error|error)").code("ENOTCONN (errno 107)"),
    r("object_store_timeout", Storage, "object store / remote dataset read timed out or throttled", r"(?:ReadTimeoutError|ConnectTimeoutError|ServerTimeoutError|Read timed out|\bSlowDown\b|503 Slow Down|RequestTimeout\b|IncompleteRead|ResponseStreamingError|EndpointConnectionError|ClientPayloadError)|(?i:s3|gcs|gcsfs|s3fs|fsspec|botocore|boto3|azure|huggingface\.co|storage\.googleapis|amazonaws)[^\n]*(?i:timed out|TimeoutError|read timeout|connect timeout|connection (?:reset|aborted|broken)|throttl)"),
    // Host memory.
    r("dataloader_killed", HostMemory, "DataLoader worker killed (host OOM killer or shared memory)", r"(?i)DataLoader worker \(pids?\(?s?\)?\s*[\d, ]+\)?\s*(?:is killed by signal: (?:Killed|Bus error)|exited unexpectedly)|worker[^\n]*killed by signal: (?:Killed|Bus error)"),
    r("slurm_oom", HostMemory, "the scheduler reports the task ran out of host memory", r"(?i)srun: error: [^\n]*task \d+: Out Of Memory|slurmstepd: error: [^\n]*(?:oom|Out Of Memory)|task \d+: Out Of Memory"),
    r("bus_error", HostMemory, "bus error (usually /dev/shm too small for DataLoader tensors)", r"(?i)\bBus error\b|SIGBUS|signal: Bus error").code("SIGBUS"),
    r("oom_killed", HostMemory, "killed by the host OOM killer", r"(?i)OOM Killed|OOMKilled|Detected [1-9]\d* oom[-_]kill event|oom[-_]kill event|out of memory: killed process|Memory cgroup out of memory|killed by the OOM|exitcode\s*:\s*-9\b|terminated with signal SIGKILL|Signal 9 \(SIGKILL\)|died with <Signals\.SIGKILL: 9>|exit(?:ed)? with (?:exit )?code 137\b|finished with exit code 137\b|returned non-zero exit status -9\b|got signal: 9\b").code("SIGKILL"),
    r("shell_killed", HostMemory, "killed (SIGKILL, usually the host OOM killer)", r"(?:: line \d+:\s+\d+\s+Killed\s)|^\s*(?:\S+: line \d+:\s+)?(?:\[\d+\][+-]?\s+)?(?:\d+\s+)?(?:Killed|Getötet|Processus arrêté|Terminado \(killed\)|Matado|Ucciso|Morto|Убито|Убит|已杀死|已殺死|強制終了|죽었음|Zabity|Zabit|Dood|Avslutad|Tué)(?:\s*$|\s{2,}\S)").code("SIGKILL"),
    r("host_memory_error", HostMemory, "host memory allocation failed", r"(?:(?:^|[\s\]:])MemoryError(?::|\s*$)|std::bad_alloc|throw_bad_alloc|CPUAllocator|posix_memalign\([^\n]*\b12 vs 0|\bbad_alloc\b|Cannot allocate memory|\[Errno 12\]|DefaultCPUAllocator: (?:can't allocate|not enough) memory|Unable to allocate [\d.]+ [KMGT]i?B for an array|out of memory \(host\)|host memory allocation failed|ENOMEM|malloc(?:\(\))? failed|failed to allocate[^\n]*(?:pinned|host) memory)").code("ENOMEM (errno 12)"),
    // Collective hangs (after every concrete cause: a watchdog line that names one is that cause).
    r("nccl_watchdog_timeout", Hang, "collective timed out (NCCL watchdog)", r"(?i)Watchdog caught collective operation timeout|collective operation timeout|WorkNCCL\(SeqNum=\d+[^)]*\) ran for \d+ milliseconds before timing out|ran for \d+ milliseconds before timing out|NCCL (?:operation )?timed out|NCCL timeout (?:reached|exceeded|expired)|Timed out waiting \d+ ?ms for|ProcessGroupNCCL[^\n]*(?:timeout|timed out)|watchdog (?:thread )?(?:timeout|timed out)|collective[^\n]*timed out|barrier[^\n]*timed out|Timeout\(ms\)=\d+\) ran for|failure detected by watchdog|preparing to dump debug info|Watchdog caught|ran for \d+ ms before timing out|waiting for remainder of ranks|will cause deadlock|stalled ranks"),
    r("heartbeat_timeout", Hang, "heartbeat monitor timed out (a rank stopped making progress)", r"(?i)heartbeat monitor|Heartbeat monitor timed out|heartbeat (?:timeout|timed out|lost|missed)|no heartbeat|watchdog got stuck|Received a Rank \d+ Watchdog timeout"),
    r("nccl_ops_failed_or_timed_out", Hang, "NCCL operations failed or timed out (the process is taken down)", r"Some NCCL operations have failed or timed out").generic(),
    r("nccl_aborted", Hang, "NCCL communicator aborted (after an error or timeout elsewhere)", r"(?i)NCCL communicator was aborted|communicator (?:was )?aborted|ncclCommAbort|NCCL Abort|process group (?:was )?(?:aborted|terminated)").generic(),
    // Generic network results (a more specific line nearby is the cause).
    r("nccl_system_error", Network, "NCCL unhandled system error (network, or a system call)", r"(?i)unhandled system error|ncclSystemError").generic().code("ncclSystemError"),
    r("nccl_remote_error", Network, "remote rank exited or there was a network error", r"(?i)remote process exited or there was a network error|ncclRemoteError|remote peer (?:closed|exited|crashed)|peer (?:rank )?\d* ?(?:exited|crashed|closed)").generic().code("ncclRemoteError"),
    r("nccl_internal_error", Network, "NCCL internal error", r"(?i)NCCL error[^\n]*internal error|NCCL WARN [^\n]*(?:Error|error|failed)").generic().code("ncclInternalError"),
    // Software.
    r("nccl_invalid_usage", Software, "NCCL invalid usage / mismatched collectives / two ranks on one GPU", r"(?i)ncclInvalidUsage|Duplicate GPU detected|invalid usage|ncclInvalidArgument|mismatch(?:ed)? (?:between )?collectives?|Detected mismatch between collectives|collective sequence number mismatch|Tensors must be CUDA and dense|Tensors must be contiguous").code("ncclInvalidUsage"),
    r("missing_library", Software, "missing or incompatible library", r"(?i)cannot open shared object file|undefined symbol|ModuleNotFoundError|ImportError|Could not load (?:dynamic )?library|Could not find module|libcudart|libcudnn[^\n]*not found|DLL load failed"),
    r("shape_or_device_mismatch", Software, "shape, dtype or device mismatch", r"(?i)shapes cannot be multiplied|size mismatch|shape mismatch|must match the size of tensor|Sizes of tensors must match|expected scalar type|Expected all tensors to be on the same device|Expected object of (?:scalar type|device type)|cannot reshape|Dimension out of range|incompatible shapes|Incompatible shapes|dimension mismatch|doesn't match the broadcast shape"),
    r("segfault", Software, "segmentation fault / abort in the job (a crash of its code or a library)", r"(?i)Segmentation fault|SIGSEGV|Fatal Python error|double free|free\(\): invalid|stack smashing|SIGILL|Illegal instruction|killed by signal: Segmentation fault").nonfatal(),
    r("python_exception", Software, "Python exception in the job's code", r"^\s*(?:[\w.]+\.)?(?:ValueError|TypeError|KeyError|IndexError|AttributeError|NameError|AssertionError|NotImplementedError|ZeroDivisionError|FileNotFoundError|RecursionError|SyntaxError|UnboundLocalError|IsADirectoryError|PermissionError|JSONDecodeError|UnicodeDecodeError|StopIteration|OverflowError)(?::|$)"),
];

/// Every rule in one set: one pass over the line finds the first rule that matches.
/// Compiled without Unicode (ASCII `\b`, `\w` and case folding): the set then runs on the
/// lazy DFA at tens of MB/s instead of falling back to the PikeVM on the first non-ASCII byte
/// of a progress bar. Non-ASCII literals (`Getötet`) still match their UTF-8 bytes.
static COMPILED: LazyLock<regex::bytes::RegexSet> = LazyLock::new(|| {
    regex::bytes::RegexSetBuilder::new(RULES.iter().map(|r| r.re))
        .unicode(false)
        .dfa_size_limit(32 << 20)
        .size_limit(64 << 20)
        .build()
        .expect("joblog rules compile")
});

static ANSI: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])").unwrap()
});
/// Rank prefixes: `[rank3]:`, `[default3]:`, `3: ` (srun -l), `[1,3]<stderr>:` (Open MPI),
/// `[Rank 3]`, `rank3:` and torch's `[PG 0 Rank 3]`.
static RANK: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:\[(?:rank|default|Rank |RANK )(\d+)\]:?|(\d{1,5}): |\[\d+,(\d+)\]<std(?:out|err)>:|rank(\d+): )|\[PG \d+ Rank (\d+)\]|\[Rank (\d+)\]|\brank (\d+)\b").unwrap()
});
static CODE_NAME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(cudaError\w+|CUDA_ERROR_\w+|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|CUFFT_\w+|CUSOLVER_STATUS_\w+|nccl(?:Unhandled\w+|System|Internal|InvalidArgument|InvalidUsage|Remote)(?:Error)?|NVML_ERROR_\w+|IBV_WC_\w+|UCS_ERR_\w+|RESOURCE_EXHAUSTED)\b").unwrap()
});
static CUDA_NUM: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:cuda runtime error|CUDA error|cuda error code|error code)\s*[:=]?\s*\(?(\d{1,3})\)?").unwrap()
});
static ERRNO: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\[Errno (\d+)\]|errno[ =:]+(\d+)").unwrap());
static IB_STATUS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:with (?:error|status)|wc[._]status|status)\s*[=:]?\s*(\d{1,2})\b").unwrap()
});
static VENDOR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)vendor[ _]err(?:or)?\s*[=:]?\s*(\d+|0x[0-9a-f]+)").unwrap());
static WATCHDOG: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"SeqNum=(\d+),\s*OpType=(\w+)(?:[^)]*?Timeout\(ms\)=(\d+))?(?:[^\n]*?ran for (\d+) milliseconds)?").unwrap()
});
static SIGNAL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"killed by signal: ([A-Za-z ]+?)\.?\s*$|signal: ([A-Za-z ]+)").unwrap()
});
static TRACEBACK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(?:Original )?Traceback \(most recent call last\):").unwrap());
static FRAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"^\s+File "[^"]*", line \d+|^\s{2,}\S|^\s*[~^]+\s*$"#).unwrap());
static CHAIN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:The above exception was the direct cause of the following exception:|During handling of the above exception, another exception occurred:)").unwrap()
});

/// The name of an `ibv_wc_status` value.
pub fn ib_status(n: u32) -> &'static str {
    match n {
        1 => "local length error",
        2 => "local QP operation error",
        4 => "local protection error",
        5 => "work request flushed (a consequence of an earlier error)",
        8 => "local access error",
        9 => "remote invalid request",
        10 => "remote access error",
        11 => "remote operation error",
        12 => "transport retry counter exceeded (link, peer or fabric trouble)",
        13 => "RNR retry counter exceeded (the peer stopped posting receives)",
        19 => "fatal error",
        20 => "response timeout",
        21 => "general error",
        _ => "see ibv_wc_status",
    }
}

/// Strip ANSI escapes (colour codes inside `loss: \e[31mnan\e[0m` must not hide anything).
pub fn strip_ansi(line: &str) -> std::borrow::Cow<'_, str> {
    if line.contains('\x1b') {
        ANSI.replace_all(line, "")
    } else {
        std::borrow::Cow::Borrowed(line)
    }
}

/// The rank printed in the line's prefix, if any, and the line without that prefix.
pub fn rank_of(line: &str) -> (Option<u32>, &str) {
    let Some(c) = RANK.captures(line) else {
        return (None, line);
    };
    let rank = (1..c.len())
        .find_map(|i| c.get(i))
        .and_then(|m| m.as_str().parse().ok());
    let whole = c.get(0).expect("match");
    // Only a prefix is removed; a rank named inside the message stays in the text.
    let rest = if whole.start() == 0 {
        &line[whole.end()..]
    } else {
        line
    };
    (rank, rest)
}

fn code_of(rule: &Rule, line: &str) -> Option<String> {
    if rule.kind == "ib_completion" {
        let status = IB_STATUS
            .captures(line)
            .and_then(|c| c[1].parse::<u32>().ok());
        let vendor = VENDOR.captures(line).map(|c| c[1].to_string());
        return match (status, vendor) {
            (Some(s), v) => Some(format!(
                "ibv status {s} ({}){}",
                ib_status(s),
                v.map_or(String::new(), |v| format!(", vendor err {v}"))
            )),
            (None, Some(v)) => Some(format!("vendor err {v}")),
            (None, None) => CODE_NAME.find(line).map(|m| m.as_str().to_string()),
        };
    }
    if rule.family == Some(Hang) {
        if let Some(c) = WATCHDOG.captures(line) {
            let mut s = format!("{} SeqNum={}", &c[2], &c[1]);
            if let Some(t) = c.get(3) {
                s.push_str(&format!(" timeout {} ms", t.as_str()));
            }
            if let Some(t) = c.get(4) {
                s.push_str(&format!(" ran {} ms", t.as_str()));
            }
            return Some(s);
        }
    }
    if rule.kind == "dataloader_killed" {
        if let Some(c) = SIGNAL.captures(line) {
            return c
                .get(1)
                .or(c.get(2))
                .map(|m| format!("signal {}", m.as_str().trim()));
        }
    }
    if let Some(m) = CODE_NAME.find(line) {
        let n = CUDA_NUM
            .captures(line)
            .map(|c| format!(" ({})", &c[1]))
            .unwrap_or_default();
        return Some(format!("{}{n}", m.as_str()));
    }
    if rule.family == Some(Storage) || rule.kind == "host_memory_error" {
        if let Some(c) = ERRNO.captures(line) {
            let n = c.get(1).or(c.get(2)).map_or("", |m| m.as_str());
            if let Some(canon) = rule
                .canonical
                .filter(|c| c.contains(&format!("errno {n})")))
            {
                return Some(canon.to_string());
            }
            return Some(format!("errno {n}"));
        }
    }
    if let Some(c) = CUDA_NUM.captures(line) {
        if let Some(canon) = rule.canonical {
            return Some(canon.to_string());
        }
        return Some(format!("CUDA error {}", &c[1]));
    }
    rule.canonical.map(String::from)
}

/// Classify one line of the job's output (stateless: no traceback context).
pub fn classify(line: &str) -> Option<JobFault> {
    let clean = strip_ansi(line);
    let (rank, rest) = rank_of(&clean);
    classify_clean(rest, rank, 0)
}

fn classify_clean(rest: &str, rank: Option<u32>, group: u32) -> Option<JobFault> {
    let rest = rest.trim_end();
    if rest.len() < 4 {
        return None;
    }
    let idx = COMPILED.matches(rest.as_bytes()).into_iter().next()?;
    let rule = &RULES[idx];
    let family = rule.family?;
    Some(JobFault {
        family,
        kind: rule.kind,
        what: rule.what,
        code: code_of(rule, rest),
        generic: rule.generic,
        fatal: rule.fatal,
        rank,
        group,
    })
}

/// Every rule id with its family and meaning (docs and the corpus test read this).
pub fn rules() -> impl Iterator<Item = (&'static str, Option<JobFamily>, &'static str)> {
    RULES.iter().map(|r| (r.kind, r.family, r.what))
}

#[derive(Default, Clone, Copy)]
struct TbState {
    /// Inside a traceback (between its header and its exception line).
    frames: bool,
    /// The current exception chain's group id (0 = none).
    group: u32,
    /// Lines since the chain's last exception line (a chain ends after a few unrelated lines).
    since: u32,
}

/// Reads one stream of the job's output with traceback context, per rank.
#[derive(Default)]
pub struct Reader {
    states: HashMap<Option<u32>, TbState>,
    next_group: u32,
}

impl Reader {
    /// At most this many ranks keep traceback state (bounded memory on hostile input).
    const MAX_RANKS: usize = 4096;

    pub fn line(&mut self, line: &str) -> Option<JobFault> {
        let clean = strip_ansi(line);
        let (rank, rest) = rank_of(&clean);
        if !self.states.contains_key(&rank) && self.states.len() >= Self::MAX_RANKS {
            self.states.clear();
        }
        let mut st = self.states.get(&rank).copied().unwrap_or_default();
        let out = if TRACEBACK.is_match(rest.trim_start()) || CHAIN.is_match(rest.trim_start()) {
            if st.group == 0 || st.since > 3 {
                self.next_group += 1;
                st.group = self.next_group;
            }
            st.frames = true;
            st.since = 0;
            None
        } else if st.frames && FRAME.is_match(rest) {
            // A frame or its source line: code, not evidence.
            None
        } else {
            let in_chain = st.group != 0 && st.since <= 3;
            st.frames = false;
            let f = classify_clean(rest, rank, if in_chain { st.group } else { 0 });
            st.since = st.since.saturating_add(1);
            if f.is_some() && in_chain {
                st.since = 0;
            }
            f
        };
        self.states.insert(rank, st);
        out
    }
}

#[cfg(test)]
mod tests;
pub mod watchdog;
