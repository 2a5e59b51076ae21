//! `ras:aer_event`: a decoded PCIe AER error (only when the kernel has CONFIG_PCIEAER).
use crate::EventHeader;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AerEvent {
    pub hdr: EventHeader,
    pub status: u32,
    /// 0 = uncorrected non-fatal, 1 = uncorrected fatal, 2 = corrected (kernel's aer_severity).
    pub severity: u32,
    pub tlp_header_valid: u32,
    pub tlp_header: [u32; 4],
    pub _pad: u32,
    pub dev_name: [u8; 32],
}
