//! `printk:console`: one kernel log record as it is written.
use crate::EventHeader;

/// Bytes of message kept per record (longer records set `FLAG_TRUNCATED`).
pub const PRINTK_MSG_LEN: usize = 472;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct PrintkEvent {
    pub hdr: EventHeader,
    /// Bytes of `msg` that hold the message (without the trailing NUL).
    pub len: u32,
    pub _pad: u32,
    pub msg: [u8; PRINTK_MSG_LEN],
}
