//! The few CUDA driver API calls `gpucheck` needs, from the driver's own `libcuda.so.1` loaded
//! at run time (no CUDA toolkit at build or run time; a node without a driver gets an error,
//! not a failure to start).
use std::ffi::{c_char, c_void, CStr, CString};

type CuResult = i32;
pub type Device = i32;
pub type DevPtr = u64;
type Ctx = *mut c_void;
type Module = *mut c_void;
pub type Function = *mut c_void;

/// The driver API, resolved once.
pub struct Cuda {
    _lib: libloading::Library,
    init: unsafe extern "C" fn(u32) -> CuResult,
    device_count: unsafe extern "C" fn(*mut i32) -> CuResult,
    device_get: unsafe extern "C" fn(*mut Device, i32) -> CuResult,
    device_name: unsafe extern "C" fn(*mut c_char, i32, Device) -> CuResult,
    device_pci: unsafe extern "C" fn(*mut c_char, i32, Device) -> CuResult,
    ctx_retain: unsafe extern "C" fn(*mut Ctx, Device) -> CuResult,
    ctx_release: unsafe extern "C" fn(Device) -> CuResult,
    ctx_set: unsafe extern "C" fn(Ctx) -> CuResult,
    ctx_sync: unsafe extern "C" fn() -> CuResult,
    module_load: unsafe extern "C" fn(
        *mut Module,
        *const c_void,
        u32,
        *mut i32,
        *mut *mut c_void,
    ) -> CuResult,
    module_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(DevPtr) -> CuResult,
    mem_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    dtoh: unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> CuResult,
    htod: unsafe extern "C" fn(DevPtr, *const c_void, usize) -> CuResult,
    launch: unsafe extern "C" fn(
        Function,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

// SAFETY: the driver API is thread-safe; each thread sets its own current context.
unsafe impl Sync for Cuda {}
// SAFETY: as above.
unsafe impl Send for Cuda {}

macro_rules! sym {
    ($lib:expr, $name:literal) => {
        // SAFETY: the symbol is the driver API function of that name and signature (CUDA
        // driver API reference); the library outlives the pointer (kept in `Cuda`).
        *unsafe { $lib.get($name) }.map_err(|e| {
            format!(
                "libcuda.so.1 has no {}: {e}",
                String::from_utf8_lossy(&$name[..$name.len() - 1])
            )
        })?
    };
}

impl Cuda {
    /// Load the driver and initialise it. The error says what is missing.
    pub fn load() -> Result<Cuda, String> {
        // SAFETY: loading the NVIDIA driver's library runs its initialisers, as any CUDA program does.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }
            .map_err(|e| format!("no NVIDIA driver: libcuda.so.1 cannot be loaded ({e})"))?;
        let c = Cuda {
            init: sym!(lib, b"cuInit\0"),
            device_count: sym!(lib, b"cuDeviceGetCount\0"),
            device_get: sym!(lib, b"cuDeviceGet\0"),
            device_name: sym!(lib, b"cuDeviceGetName\0"),
            device_pci: sym!(lib, b"cuDeviceGetPCIBusId\0"),
            ctx_retain: sym!(lib, b"cuDevicePrimaryCtxRetain\0"),
            ctx_release: sym!(lib, b"cuDevicePrimaryCtxRelease_v2\0"),
            ctx_set: sym!(lib, b"cuCtxSetCurrent\0"),
            ctx_sync: sym!(lib, b"cuCtxSynchronize\0"),
            module_load: sym!(lib, b"cuModuleLoadDataEx\0"),
            module_function: sym!(lib, b"cuModuleGetFunction\0"),
            mem_alloc: sym!(lib, b"cuMemAlloc_v2\0"),
            mem_free: sym!(lib, b"cuMemFree_v2\0"),
            mem_info: sym!(lib, b"cuMemGetInfo_v2\0"),
            dtoh: sym!(lib, b"cuMemcpyDtoH_v2\0"),
            htod: sym!(lib, b"cuMemcpyHtoD_v2\0"),
            launch: sym!(lib, b"cuLaunchKernel\0"),
            error_name: sym!(lib, b"cuGetErrorName\0"),
            _lib: lib,
        };
        // SAFETY: plain driver call.
        c.check(unsafe { (c.init)(0) }, "cuInit")?;
        Ok(c)
    }

    fn check(&self, r: CuResult, what: &str) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null).
        unsafe { (self.error_name)(r, &mut name) };
        let n = if name.is_null() {
            format!("CUDA error {r}")
        } else {
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        };
        Err(format!("{what}: {n} ({r})"))
    }

    pub fn device_count(&self) -> Result<i32, String> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        self.check(unsafe { (self.device_count)(&mut n) }, "cuDeviceGetCount")?;
        Ok(n)
    }

    pub fn device(&self, ordinal: i32) -> Result<(Device, String, String), String> {
        let mut d = 0;
        // SAFETY: valid out-pointer.
        self.check(unsafe { (self.device_get)(&mut d, ordinal) }, "cuDeviceGet")?;
        let mut name = [0 as c_char; 256];
        let mut pci = [0 as c_char; 64];
        // SAFETY: buffers of the lengths given.
        self.check(
            unsafe { (self.device_name)(name.as_mut_ptr(), 256, d) },
            "cuDeviceGetName",
        )?;
        // SAFETY: as above.
        self.check(
            unsafe { (self.device_pci)(pci.as_mut_ptr(), 64, d) },
            "cuDeviceGetPCIBusId",
        )?;
        // SAFETY: the driver NUL-terminates both.
        let s = |b: &[c_char]| {
            unsafe { CStr::from_ptr(b.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        };
        Ok((d, s(&name), s(&pci)))
    }

    /// Make the device's primary context current on this thread.
    pub fn enter(&self, d: Device) -> Result<(), String> {
        let mut ctx: Ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is released in `leave`.
        self.check(
            unsafe { (self.ctx_retain)(&mut ctx, d) },
            "cuDevicePrimaryCtxRetain",
        )?;
        // SAFETY: a context the driver just gave us.
        self.check(unsafe { (self.ctx_set)(ctx) }, "cuCtxSetCurrent")
    }

    pub fn leave(&self, d: Device) {
        // SAFETY: releases the retain of `enter`.
        unsafe { (self.ctx_release)(d) };
    }

    pub fn sync(&self) -> Result<(), String> {
        // SAFETY: plain driver call on the current context.
        self.check(unsafe { (self.ctx_sync)() }, "cuCtxSynchronize")
    }

    /// JIT-load a PTX module and look up its kernels; a JIT error comes with the JIT's log.
    pub fn load_ptx(&self, ptx: &str, names: &[&str]) -> Result<Vec<Function>, String> {
        let src = CString::new(ptx).map_err(|_| "PTX holds a NUL".to_string())?;
        let mut log = vec![0u8; 8192];
        // CU_JIT_ERROR_LOG_BUFFER = 5, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6.
        let mut opts = [5i32, 6i32];
        let mut vals: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
        let mut m: Module = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX; two options with their values; the log buffer outlives the call.
        let r = unsafe {
            (self.module_load)(
                &mut m,
                src.as_ptr().cast(),
                2,
                opts.as_mut_ptr(),
                vals.as_mut_ptr(),
            )
        };
        if r != 0 {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(format!(
                "{}; JIT log: {}",
                self.check(r, "cuModuleLoadDataEx").unwrap_err(),
                String::from_utf8_lossy(&log[..end])
            ));
        }
        names
            .iter()
            .map(|n| {
                let c = CString::new(*n).expect("kernel name");
                let mut f: Function = std::ptr::null_mut();
                // SAFETY: a loaded module and a NUL-terminated name.
                self.check(unsafe { (self.module_function)(&mut f, m, c.as_ptr()) }, n)
                    .map(|()| f)
            })
            .collect()
    }

    pub fn mem_info(&self) -> Result<(usize, usize), String> {
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers.
        self.check(
            unsafe { (self.mem_info)(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free, total))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevPtr, String> {
        let mut p = 0;
        // SAFETY: valid out-pointer.
        self.check(unsafe { (self.mem_alloc)(&mut p, bytes) }, "cuMemAlloc")?;
        Ok(p)
    }

    pub fn free(&self, p: DevPtr) {
        // SAFETY: a pointer from `alloc`.
        unsafe { (self.mem_free)(p) };
    }

    pub fn to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<(), String> {
        // SAFETY: dst has the length copied.
        self.check(
            unsafe { (self.dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) },
            "cuMemcpyDtoH",
        )
    }

    pub fn to_device(&self, dst: DevPtr, src: &[u8]) -> Result<(), String> {
        // SAFETY: src has the length copied.
        self.check(
            unsafe { (self.htod)(dst, src.as_ptr().cast(), src.len()) },
            "cuMemcpyHtoD",
        )
    }

    /// Launch `f` on `grid` blocks of `block` threads with the given parameters (each a
    /// pointer to the argument's value, as cuLaunchKernel wants).
    ///
    /// # Safety
    /// `f` is a kernel of this module and `params` point to live values of exactly its
    /// parameter types, in order.
    pub unsafe fn launch(
        &self,
        f: Function,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), String> {
        // SAFETY: the caller's contract above.
        self.check(
            unsafe {
                (self.launch)(
                    f,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}
