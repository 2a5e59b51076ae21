//! The job's process tree: fork, exec, exit, fatal signals.
use crate::{EventHeader, COMM_LEN};

pub const EXEC_FILENAME_LEN: usize = 128;

/// `sched:sched_process_fork` of a job process. Header = the parent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkEvent {
    pub hdr: EventHeader,
    pub child_pid: u32,
    pub _pad: u32,
    pub child_comm: [u8; COMM_LEN],
}

/// `sched:sched_process_exec` of a job process.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ExecEvent {
    pub hdr: EventHeader,
    pub filename: [u8; EXEC_FILENAME_LEN],
}

/// Exit code or fatal signal last seen for a thread group (kernel map value).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitInfo {
    /// `exit_group(code)` argument, or -1 when the process did not call it.
    pub code: i32,
    /// Fatal signal generated for it, 0 when none.
    pub signal: i32,
}

/// `sched:sched_process_exit` with `group_dead` (the whole process is gone).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitEvent {
    pub hdr: EventHeader,
    /// -1 when unknown (killed by a signal, or the exit was not seen).
    pub code: i32,
    pub signal: i32,
    /// 1 when the kernel dumped a core (the 0x80 bit of the wait status; BTF path only: the
    /// tracefs path does not know and reports 0).
    pub core_dumped: u32,
    pub _pad: u32,
}

/// `signal:signal_generate` of a fatal signal to a job process. Header = the sender.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignalEvent {
    pub hdr: EventHeader,
    pub sig: i32,
    pub code: i32,
    pub target_pid: u32,
    pub result: i32,
    pub target_comm: [u8; COMM_LEN],
}
