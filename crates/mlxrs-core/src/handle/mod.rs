//! Safe handles over mlx-c: the only module of mlxrs-core that contains `unsafe`.
//!
//! Every mlx-c call goes through [`check`], which turns a non-zero return into
//! [`Error::Mlx`](crate::Error::Mlx) carrying MLX's own message (captured by the error handler this
//! module installs once per process in place of mlx-c's default, which calls `exit()`).
mod array;
mod blocks;
mod f32mm;
mod half;
mod host;
pub(crate) mod kernel;
mod ops;
mod packed;
mod runtime;

pub use array::{async_eval, async_eval_stage, eval, eval_epoch, eval_stage, Array, Dtype, Element};
pub use blocks::{host_blocks_matmul, BlocksRef, GROUP_STEP};
pub use f32mm::{host_matmul, small_matmul, small_matmul_calls, GRAPH_MAX_ROWS, SMALL_MAX_ROWS};
pub use half::{
    attention_scratch_bytes as half_attention_scratch_bytes, half_attention_calls, half_gather_calls,
    half_matmul_calls, host_half_attention, host_half_gather_matmul, host_half_matmul, HalfAttention, HalfRef,
    HalfType, ATTN_SCRATCH_BYTES as HALF_ATTN_SCRATCH_BYTES, TILE_BYTES as HALF_TILE_BYTES,
};
pub use host::host_threads;
#[cfg(test)]
pub(crate) use host::PARALLEL_FOR_CALLS;
pub use kernel::{cuda_is_available, metal_is_available, CudaKernel, MetalKernel, TemplateArg};
pub use ops::*;
pub use packed::{host_packed_matmul, packed_matmul_calls, PackedRef, Scales, PACKED_GROUP_STEP};
pub use runtime::{
    active_memory, cache_memory, clear_cache, default_device, device_memory_size, init, memory_limit, peak_memory,
    reset_peak_memory, set_memory_limit, synchronize, with_stream, Device, DeviceKind, Stream,
};

use crate::error::{Error, Result};
use std::cell::RefCell;
use std::os::raw::c_int;

thread_local! {
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

unsafe extern "C" fn on_mlx_error(msg: *const std::os::raw::c_char, _data: *mut std::ffi::c_void) {
    let text = if msg.is_null() {
        "MLX error (no message)".to_string()
    } else {
        // SAFETY: mlx-c passes a NUL-terminated message valid for the duration of the call.
        unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy().into_owned()
    };
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(text));
}

pub(crate) fn install_error_handler() {
    // SAFETY: the handler only copies the message into a thread-local; it never unwinds.
    unsafe { (mlxrs_sys::extra().mlx_set_error_handler)(Some(on_mlx_error), std::ptr::null_mut(), None) };
}

/// Turn an mlx-c return code into a Result, taking the message the handler captured.
#[inline]
pub(crate) fn check(rc: c_int) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let msg = LAST_ERROR.with(|e| e.borrow_mut().take()).unwrap_or_else(|| format!("mlx-c call failed (code {rc})"));
    Err(Error::Mlx(msg))
}

/// Copy an mlx-c string handle out and free it.
pub(crate) fn take_string(s: mlxrs_sys::mlx_string) -> String {
    // SAFETY: `s` is a live string handle owned by the caller; we read then free it.
    unsafe {
        let p = mlxrs_sys::mlx_string_data(s);
        let out = if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() };
        mlxrs_sys::mlx_string_free(s);
        out
    }
}
