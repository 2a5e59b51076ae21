//! The one way the BTF programs read a kernel struct: a member at an offset userspace found
//! in the kernel's BTF. Below `btf.rs` (the programs) and `blkid.rs` (their request table),
//! which both read structs with it.

/// A plain load of a `T` at `base + off`. The verifier knows `off` (a read-only global) and
/// checks it against the struct's BTF; a fault reads zero.
#[inline(always)]
pub(crate) fn load<T: Copy + Default>(base: *const u8, off: u32) -> T {
    if base.is_null() || off == nantrace_common::MISSING {
        return T::default();
    }
    // SAFETY: `base` is a kernel struct pointer given by the tracepoint; the offset is a
    // member of that struct per the kernel's BTF; the load is checked by the verifier.
    unsafe { core::ptr::read_volatile(base.add(off as usize) as *const T) }
}
