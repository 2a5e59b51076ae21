//! `tcp:tcp_retransmit_skb`: a TCP segment was retransmitted.
use crate::EventHeader;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpRetransmitEvent {
    pub hdr: EventHeader,
    pub state: i32,
    pub sport: u16,
    pub dport: u16,
    /// AF_INET (2) or AF_INET6 (10).
    pub family: u16,
    pub _pad: [u16; 3],
    /// IPv4 addresses use the first 4 bytes.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}
