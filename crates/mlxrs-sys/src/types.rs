//! mlx-c's plain types, laid out as the C headers declare them.
#![allow(non_camel_case_types)]
use std::ffi::c_void;
use std::os::raw::c_int;

macro_rules! handles {
    ($($name:ident),* $(,)?) => {$(
        /// An opaque mlx-c handle (`struct { void* ctx; }`).
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct $name { pub ctx: *mut c_void }
        impl $name {
            /// The null handle (what `*_new()` returns before a result is written into it).
            pub const fn null() -> Self { Self { ctx: std::ptr::null_mut() } }
        }
    )*};
}

handles!(
    mlx_array,
    mlx_closure,
    mlx_closure_kwargs,
    mlx_closure_value_and_grad,
    mlx_closure_custom,
    mlx_closure_custom_jvp,
    mlx_closure_custom_vmap,
    mlx_device,
    mlx_device_info,
    mlx_distributed_group,
    mlx_function_exporter,
    mlx_imported_function,
    mlx_fast_cuda_kernel_config,
    mlx_fast_cuda_kernel,
    mlx_fast_metal_kernel_config,
    mlx_fast_metal_kernel,
    mlx_io_reader,
    mlx_io_writer,
    mlx_map_string_to_array,
    mlx_map_string_to_string,
    mlx_stream,
    mlx_string,
    mlx_vector_array,
    mlx_vector_vector_array,
    mlx_vector_int,
    mlx_vector_string,
);

pub type mlx_dtype = c_int;
pub const MLX_BOOL: mlx_dtype = 0;
pub const MLX_UINT8: mlx_dtype = 1;
pub const MLX_UINT16: mlx_dtype = 2;
pub const MLX_UINT32: mlx_dtype = 3;
pub const MLX_UINT64: mlx_dtype = 4;
pub const MLX_INT8: mlx_dtype = 5;
pub const MLX_INT16: mlx_dtype = 6;
pub const MLX_INT32: mlx_dtype = 7;
pub const MLX_INT64: mlx_dtype = 8;
pub const MLX_FLOAT16: mlx_dtype = 9;
pub const MLX_FLOAT32: mlx_dtype = 10;
pub const MLX_FLOAT64: mlx_dtype = 11;
pub const MLX_BFLOAT16: mlx_dtype = 12;
pub const MLX_COMPLEX64: mlx_dtype = 13;

pub type mlx_device_type = c_int;
pub const MLX_CPU: mlx_device_type = 0;
pub const MLX_GPU: mlx_device_type = 1;

pub type mlx_compile_mode = c_int;
/// fft.h's mlx_fft_norm (native/patches/0003): 0 backward, 1 ortho, 2 forward.
pub type mlx_fft_norm = c_int;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct mlx_optional_int {
    pub value: c_int,
    pub has_value: bool,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct mlx_optional_float {
    pub value: f32,
    pub has_value: bool,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct mlx_optional_dtype {
    pub value: mlx_dtype,
    pub has_value: bool,
}

pub type mlx_error_handler_func = unsafe extern "C" fn(msg: *const std::os::raw::c_char, data: *mut c_void);
pub type mlx_closure_fn_payload =
    unsafe extern "C" fn(res: *mut mlx_vector_array, input: mlx_vector_array, payload: *mut c_void) -> c_int;
pub type mlx_payload_dtor = unsafe extern "C" fn(payload: *mut c_void);

/// Map iterators carry the map's context beside their own.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mlx_map_string_to_array_iterator {
    pub ctx: *mut c_void,
    pub map_ctx: *mut c_void,
}
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mlx_map_string_to_string_iterator {
    pub ctx: *mut c_void,
    pub map_ctx: *mut c_void,
}
