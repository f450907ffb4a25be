//! Process-wide runtime: loading, streams, devices, memory.
use super::{check, install_error_handler};
use crate::error::{Error, Result};
use mlxrs_sys as sys;
use std::cell::RefCell;
use std::sync::OnceLock;

static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// Load the native runtime (once; fetching the native pack on first need, see
/// [`crate::native_pack::load`]) and install mlx-c's error handler (once).
pub fn init() -> Result<&'static sys::Runtime> {
    let rt = crate::native_pack::load()?;
    INIT.get_or_init(|| {
        install_error_handler();
        if let Some(set) = sys::extra().mlxrs_set_parallel_for {
            // SAFETY: a plain function of the handle layer, registered once for the process
            unsafe { set(Some(super::host::parallel_for)) };
        }
        Ok(())
    })
    .clone()
    .map_err(Error::Mlx)?;
    Ok(rt)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// A device handle.
pub struct Device(pub(crate) sys::mlx_device);

impl Device {
    pub fn new(kind: DeviceKind, index: i32) -> Result<Device> {
        init()?;
        let t = match kind {
            DeviceKind::Cpu => sys::MLX_CPU,
            DeviceKind::Gpu => sys::MLX_GPU,
        };
        Ok(Device(unsafe { sys::mlx_device_new_type(t, index) }))
    }

    pub fn kind(&self) -> DeviceKind {
        let mut t = sys::MLX_CPU;
        unsafe { sys::mlx_device_get_type(&mut t, self.0) };
        if t == sys::MLX_GPU {
            DeviceKind::Gpu
        } else {
            DeviceKind::Cpu
        }
    }

    /// Make this the process's default device.
    pub fn set_default(&self) -> Result<()> {
        check(unsafe { sys::mlx_set_default_device(self.0) })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        unsafe { sys::mlx_device_free(self.0) };
    }
}

/// The default device (GPU where MLX has one, else CPU).
pub fn default_device() -> Result<Device> {
    init()?;
    let mut d = unsafe { sys::mlx_device_new() };
    check(unsafe { sys::mlx_get_default_device(&mut d) })?;
    Ok(Device(d))
}

/// The device's memory size in bytes, as MLX reports it (`memory_size`), if it does.
pub fn device_memory_size(dev: &Device) -> Option<usize> {
    unsafe {
        let mut info = sys::mlx_device_info_new();
        if sys::mlx_device_info_get(&mut info, dev.0) != 0 {
            sys::mlx_device_info_free(info);
            return None;
        }
        let mut out = None;
        for key in [c"memory_size", c"total_memory"] {
            let mut has = false;
            sys::mlx_device_info_has_key(&mut has, info, key.as_ptr());
            if has {
                let mut v = 0usize;
                if sys::mlx_device_info_get_size(&mut v, info, key.as_ptr()) == 0 {
                    out = Some(v);
                    break;
                }
            }
        }
        sys::mlx_device_info_free(info);
        out
    }
}

/// A stream handle.
pub struct Stream(pub(crate) sys::mlx_stream);

// SAFETY: MLX streams are plain (device, index) values; MLX synchronises work on them internally.
unsafe impl Send for Stream {}

impl Stream {
    /// A new stream on `dev` (mlx-lm's dedicated generation stream).
    pub fn new(dev: &Device) -> Result<Stream> {
        init()?;
        Ok(Stream(unsafe { sys::mlx_stream_new_device(dev.0) }))
    }

    /// The default stream of the default device.
    pub fn default_stream() -> Result<Stream> {
        let dev = default_device()?;
        let mut s = unsafe { sys::mlx_stream_new() };
        check(unsafe { sys::mlx_get_default_stream(&mut s, dev.0) })?;
        Ok(Stream(s))
    }

    pub fn synchronize(&self) -> Result<()> {
        check(unsafe { sys::mlx_synchronize(self.0) })
    }

    pub(crate) fn raw(&self) -> sys::mlx_stream {
        self.0
    }
}

impl Clone for Stream {
    fn clone(&self) -> Self {
        let mut s = unsafe { sys::mlx_stream_new() };
        unsafe { sys::mlx_stream_set(&mut s, self.0) };
        Stream(s)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        unsafe { sys::mlx_stream_free(self.0) };
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = unsafe { sys::mlx_string_new() };
        unsafe { sys::mlx_stream_tostring(&mut s, self.0) };
        f.write_str(&super::take_string(s))
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Stream>> = const { RefCell::new(None) };
}

/// The stream ops on this thread run on: the one set by [`with_stream`], else the default stream.
pub(crate) fn current_stream() -> sys::mlx_stream {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Stream::default_stream().ok();
        }
        c.as_ref().map(Stream::raw).unwrap_or(sys::mlx_stream::null())
    })
}

/// Run `f` with every op on this thread issued to `stream`.
pub fn with_stream<R>(stream: &Stream, f: impl FnOnce() -> R) -> R {
    let prev = CURRENT.with(|c| c.borrow_mut().replace(stream.clone()));
    struct Restore(Option<Stream>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let p = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = p);
        }
    }
    let _r = Restore(prev);
    f()
}

/// Wait for all work on the current stream.
pub fn synchronize() -> Result<()> {
    check(unsafe { sys::mlx_synchronize(current_stream()) })
}

fn read_size(f: unsafe fn(*mut usize) -> std::os::raw::c_int) -> usize {
    let mut v = 0usize;
    unsafe { f(&mut v) };
    v
}

pub fn active_memory() -> usize {
    read_size(sys::mlx_get_active_memory)
}
pub fn peak_memory() -> usize {
    read_size(sys::mlx_get_peak_memory)
}
pub fn cache_memory() -> usize {
    read_size(sys::mlx_get_cache_memory)
}
pub fn reset_peak_memory() {
    unsafe { sys::mlx_reset_peak_memory() };
}
pub fn clear_cache() {
    unsafe { sys::mlx_clear_cache() };
}
/// Set MLX's memory limit (the allocator's guideline for one evaluation: the memory plan's
/// `allocatorLimitBytes`, applied when the server loads a model); returns the previous one.
pub fn set_memory_limit(bytes: usize) -> Result<usize> {
    let mut prev = 0;
    check(unsafe { sys::mlx_set_memory_limit(&mut prev, bytes) })?;
    Ok(prev)
}
/// MLX's memory limit now.
pub fn memory_limit() -> Result<usize> {
    let mut v = 0;
    check(unsafe { sys::mlx_get_memory_limit(&mut v) })?;
    Ok(v)
}
