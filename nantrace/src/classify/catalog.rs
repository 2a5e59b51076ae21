//! NVIDIA's Xid and NVSwitch SXid catalogs (`nantrace/data/*.tsv`, every documented code with
//! what it implicates and NVIDIA's recommended action), parsed once.
use std::collections::HashMap;
use std::sync::LazyLock;

use super::Severity;

/// One row of NVIDIA's Xid (or NVSwitch SXid) catalog.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogEntry {
    pub name: &'static str,
    pub implicates: &'static str,
    pub action: &'static str,
    pub severity: Severity,
}

fn parse_catalog(text: &'static str) -> HashMap<u32, CatalogEntry> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let mut c = l.split('\t');
            let code = c.next()?.trim().parse().ok()?;
            let name = c.next()?.trim();
            let implicates = c.next()?.trim();
            let action = c.next()?.trim();
            let severity = Severity::parse(c.next()?.trim())?;
            Some((
                code,
                CatalogEntry {
                    name,
                    implicates,
                    action,
                    severity,
                },
            ))
        })
        .collect()
}

static XID_CATALOG: LazyLock<HashMap<u32, CatalogEntry>> =
    LazyLock::new(|| parse_catalog(include_str!("../../data/xid-catalog.tsv")));
static SXID_CATALOG: LazyLock<HashMap<u32, CatalogEntry>> =
    LazyLock::new(|| parse_catalog(include_str!("../../data/sxid-catalog.tsv")));

/// NVIDIA's catalog entry for an Xid (data/xid-catalog.tsv, every documented code).
pub fn xid_entry(xid: u32) -> Option<&'static CatalogEntry> {
    XID_CATALOG.get(&xid)
}

pub fn sxid_entry(sxid: u32) -> Option<&'static CatalogEntry> {
    SXID_CATALOG.get(&sxid)
}

/// The Xid's name and nantrace's severity: Critical = the GPU or its memory is unusable until
/// reset, Error = the job's work on it is lost or suspect, Warning = watch it, Info = context.
pub fn xid_info(xid: u32) -> (&'static str, Severity) {
    xid_entry(xid).map_or(
        (
            "Xid not in NVIDIA's catalog (newer driver?)",
            Severity::Warning,
        ),
        |e| (e.name, e.severity),
    )
}

/// Does NVIDIA's catalog say this Xid can be the application's own fault (13, 31, 43...)?
pub fn xid_maybe_application(xid: u32) -> bool {
    xid_entry(xid).is_none_or(|e| {
        matches!(
            e.implicates,
            "application" | "hardware_or_application" | "info"
        )
    })
}

/// NVIDIA's recommended action, in words.
pub fn action_text(action: &str) -> &'static str {
    match action {
        "none" => "no action (informational)",
        "restart_app" => "restart the application",
        "reset_gpu" => "reset the GPU (nvidia-smi -r) before reuse",
        "reboot_node" => "reboot the node",
        "check_nvlink" => "follow NVIDIA's NVLink workflow (check links, reset GPU)",
        "contact_support" => "contact NVIDIA support / hardware service",
        "update_sw" => "update the driver or firmware",
        "check_mechanicals" => "check power, cooling and seating",
        "ecc_workflow" => {
            "follow NVIDIA's ECC workflow (row remap / page retirement, reset the GPU)"
        }
        _ => "see NVIDIA's Xid catalog",
    }
}
