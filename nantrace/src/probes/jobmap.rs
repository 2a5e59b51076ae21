//! The watched jobs' membership (`JOB_MAP` in the eBPF crate): one byte per pid, 1 = a job's.
//!
//! The map is created `BPF_F_MMAPABLE` and mapped here shared, so userspace sets and clears
//! single bytes in the kernel's own copy. A `bpf_map_update_elem` would write a whole 8-byte
//! element and could undo the kernel side's write to a neighbouring pid's byte (a fork in the
//! job at that moment); a byte store cannot.
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::sync::atomic::{AtomicU8, Ordering};

use aya::maps::MapData;
use nantrace_common::{JOB_MAP_PIDS, JOB_MAP_WORDS};

use super::ProbeError;

pub struct JobMap {
    /// Kept so the map outlives the mapping's users (the mapping also holds a reference).
    _map: MapData,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory that the kernel writes concurrently; every access here
// goes through `AtomicU8`, so sharing it between threads adds nothing the kernel does not.
unsafe impl Send for JobMap {}
// SAFETY: as above.
unsafe impl Sync for JobMap {}

impl JobMap {
    pub fn new(map: MapData) -> Result<Self, ProbeError> {
        let info = map
            .info()
            .map_err(|e| ProbeError::Map("JOB_MAP", e.to_string()))?;
        let len = info.max_entries() as usize * info.value_size() as usize;
        if info.max_entries() != JOB_MAP_WORDS || len != JOB_MAP_PIDS as usize {
            return Err(ProbeError::Map(
                "JOB_MAP",
                format!(
                    "{} entries of {} bytes, expected {JOB_MAP_WORDS} of 8",
                    info.max_entries(),
                    info.value_size()
                ),
            ));
        }
        // SAFETY: a shared read-write mapping of the map's fd over exactly its value area; the
        // kernel refuses it unless the map is an mmapable array. The pointer is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ProbeError::Map(
                "JOB_MAP",
                format!("mmap: {}", std::io::Error::last_os_error()),
            ));
        }
        Ok(Self {
            _map: map,
            ptr: ptr.cast(),
            len,
        })
    }

    fn byte(&self, pid: u32) -> Result<&AtomicU8, ProbeError> {
        let i = pid as usize;
        if i >= self.len {
            return Err(ProbeError::Map(
                "JOB_MAP",
                format!("pid {pid} above PID_MAX_LIMIT"),
            ));
        }
        // SAFETY: `i` is inside the live mapping; AtomicU8 has the alignment and size of u8.
        Ok(unsafe { AtomicU8::from_ptr(self.ptr.add(i)) })
    }

    pub fn set(&self, pid: u32, on: bool) -> Result<(), ProbeError> {
        self.byte(pid)?.store(u8::from(on), Ordering::Relaxed);
        Ok(())
    }

    pub fn get(&self, pid: u32) -> bool {
        self.byte(pid).is_ok_and(|b| b.load(Ordering::Relaxed) != 0)
    }

    /// Up to `max` pids and tids marked now, in order (a scan of 4 MiB, byte loads).
    pub fn marked(&self, max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for i in 0..self.len {
            // SAFETY: every index is inside the live mapping.
            if unsafe { AtomicU8::from_ptr(self.ptr.add(i)) }.load(Ordering::Relaxed) != 0 {
                out.push(i as u32);
                if out.len() >= max {
                    break;
                }
            }
        }
        out
    }

    /// Pids and tids marked now (a scan of 4 MiB; byte loads, as the bytes are written).
    pub fn count(&self) -> usize {
        // SAFETY: every index is inside the live mapping.
        (0..self.len)
            .filter(|&i| {
                unsafe { AtomicU8::from_ptr(self.ptr.add(i)) }.load(Ordering::Relaxed) != 0
            })
            .count()
    }
}

impl Drop for JobMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
