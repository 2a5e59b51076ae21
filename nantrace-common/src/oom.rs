//! `oom:mark_victim`: the OOM killer chose a victim.
use crate::{EventHeader, COMM_LEN};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OomEvent {
    pub hdr: EventHeader,
    pub victim_pid: u32,
    pub uid: u32,
    /// Pages, as the tracepoint reports them (userspace converts to bytes).
    pub total_vm: u64,
    pub anon_rss: u64,
    pub file_rss: u64,
    pub shmem_rss: u64,
    pub pgtables: u64,
    pub oom_score_adj: i32,
    /// 1 when the victim was a job process (judged in the kernel at kill time).
    pub victim_job: u32,
    pub victim_comm: [u8; COMM_LEN],
}
