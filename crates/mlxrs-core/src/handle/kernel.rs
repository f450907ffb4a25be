//! User GPU kernels: mlx-c's `mlx_fast_cuda_kernel_*` and `mlx_fast_metal_kernel_*` (MLX's
//! `mx.fast.cuda_kernel` / `mx.fast.metal_kernel`), and which GPU backend the loaded MLX has.
use super::array::{Array, Dtype};
use super::check;
use super::ops::VecArray;
use super::runtime::{current_stream, init};
use crate::error::{Error, Result};
use mlxrs_sys as sys;
use std::ffi::CString;

/// Whether the loaded MLX has its CUDA backend (and a CUDA device).
pub fn cuda_is_available() -> bool {
    if init().is_err() {
        return false;
    }
    let mut r = false;
    // SAFETY: mlx-c writes one bool through the pointer.
    unsafe { sys::mlx_cuda_is_available(&mut r) == 0 && r }
}

/// Whether the loaded MLX has its Metal backend.
pub fn metal_is_available() -> bool {
    if init().is_err() {
        return false;
    }
    let mut r = false;
    // SAFETY: mlx-c writes one bool through the pointer.
    unsafe { sys::mlx_metal_is_available(&mut r) == 0 && r }
}

/// A compile-time constant of a kernel (`constexpr int`/`bool`, or `using NAME = type`).
#[derive(Clone, Copy, Debug)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(Dtype),
}

/// Kernel text without its comments, indentation and blank lines (newlines kept, for the
/// preprocessor). MLX builds a custom kernel's whole source text on every call and hashes it on every
/// evaluation (`CustomKernel::eval_gpu`'s module name), so its length is host time on every step.
pub(crate) fn compact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_block = false;
    for line in text.lines() {
        let mut kept = String::new();
        let mut chars = line.chars().peekable();
        let mut in_str = false;
        while let Some(c) = chars.next() {
            if in_block {
                if c == '*' && chars.peek() == Some(&'/') {
                    chars.next();
                    in_block = false;
                }
                continue;
            }
            if in_str {
                kept.push(c);
                if c == '\\' {
                    kept.extend(chars.next());
                } else if c == '"' {
                    in_str = false;
                }
                continue;
            }
            match (c, chars.peek()) {
                ('/', Some('/')) => break,
                ('/', Some('*')) => {
                    chars.next();
                    in_block = true;
                }
                ('"', _) => {
                    in_str = true;
                    kept.push(c);
                }
                _ => kept.push(c),
            }
        }
        let kept = kept.trim();
        if !kept.is_empty() {
            out.push_str(kept);
            out.push('\n');
        }
    }
    out
}

struct Strings(sys::mlx_vector_string);

impl Strings {
    fn new(names: &[&str]) -> Result<Strings> {
        let owned = names
            .iter()
            .map(|n| CString::new(*n))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| Error::Invalid("kernel name contains NUL".into()))?;
        let mut ptrs: Vec<*const std::os::raw::c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: mlx-c copies the strings before returning.
        Ok(Strings(unsafe { sys::mlx_vector_string_new_data(ptrs.as_mut_ptr(), ptrs.len()) }))
    }
}

impl Drop for Strings {
    fn drop(&mut self) {
        // SAFETY: created by mlx_vector_string_new_data, freed once.
        unsafe { sys::mlx_vector_string_free(self.0) };
    }
}

/// One user-kernel type over mlx-c's `mlx_fast_{cuda,metal}_kernel_*` (the two APIs are the same
/// shape; only the names and the last argument of `_new` differ).
macro_rules! user_kernel {
    ($(#[$doc:meta])* $name:ident, $config:ident, $handle:ty, $config_handle:ty, $last_new_arg:expr,
     $new:path, $free:path, $apply:path, $cfg_new:path, $cfg_free:path, $add_output:path, $set_grid:path,
     $set_group:path, $arg_int:path, $arg_bool:path, $arg_dtype:path) => {
        $(#[$doc])*
        pub struct $name($handle);

        // SAFETY: the handle owns an immutable MLX kernel function object (a std::function over its
        // source and names); applying it only builds graph nodes, which MLX does under its own locks.
        unsafe impl Send for $name {}
        unsafe impl Sync for $name {}

        struct $config($config_handle);

        impl Drop for $config {
            fn drop(&mut self) {
                // SAFETY: created by the config's `_new`, freed once.
                unsafe { $cfg_free(self.0) };
            }
        }

        impl $name {
            /// `ensure_row_contiguous`: inputs copied to row-contiguous first (so the source may index
            /// them flat).
            pub fn new(
                name: &str,
                inputs: &[&str],
                outputs: &[&str],
                source: &str,
                header: &str,
                ensure_row_contiguous: bool,
            ) -> Result<$name> {
                init()?;
                let (ins, outs) = (Strings::new(inputs)?, Strings::new(outputs)?);
                let c = |s: &str| CString::new(s).map_err(|_| Error::Invalid(format!("kernel {name}: text contains NUL")));
                let (n, src, hdr) = (c(name)?, c(&compact(source))?, c(&compact(header))?);
                // SAFETY: every pointer is valid for the call; mlx-c copies what it keeps.
                let k = unsafe {
                    $new(n.as_ptr(), ins.0, outs.0, src.as_ptr(), hdr.as_ptr(), ensure_row_contiguous, $last_new_arg)
                };
                if k.ctx.is_null() {
                    // MLX's message (e.g. "[cuda_kernel] No CUDA back-end." off CUDA), as the handler
                    // captured it
                    let e = check(1).err().map_or_else(|| "failed".to_string(), |e| e.to_string());
                    return Err(Error::Mlx(format!("kernel {name}: {e}")));
                }
                Ok($name(k))
            }

            /// The kernel over `inputs` on the current stream: outputs of `outputs` (shape, dtype),
            /// `grid` threads in blocks (threadgroups) of `block`.
            pub fn apply(
                &self,
                inputs: &[&Array],
                outputs: &[(&[i32], Dtype)],
                grid: (i32, i32, i32),
                block: (i32, i32, i32),
                template: &[(&str, TemplateArg)],
            ) -> Result<Vec<Array>> {
                // SAFETY: a fresh config, freed by its guard.
                let cfg = $config(unsafe { $cfg_new() });
                for (shape, dtype) in outputs {
                    // SAFETY: the shape slice is valid for the call; mlx-c copies it.
                    check(unsafe { $add_output(cfg.0, shape.as_ptr(), shape.len(), dtype.raw()) })?;
                }
                // SAFETY: plain values into the config.
                check(unsafe { $set_grid(cfg.0, grid.0, grid.1, grid.2) })?;
                check(unsafe { $set_group(cfg.0, block.0, block.1, block.2) })?;
                for (name, arg) in template {
                    let n = CString::new(*name).map_err(|_| Error::Invalid("template name contains NUL".into()))?;
                    // SAFETY: the name is valid for the call; mlx-c copies it.
                    check(unsafe {
                        match arg {
                            TemplateArg::Int(v) => $arg_int(cfg.0, n.as_ptr(), *v),
                            TemplateArg::Bool(v) => $arg_bool(cfg.0, n.as_ptr(), *v),
                            TemplateArg::Dtype(d) => $arg_dtype(cfg.0, n.as_ptr(), d.raw()),
                        }
                    })?;
                }
                let ins = VecArray::new(inputs);
                let mut out = VecArray::new(&[]);
                super::ops::count_op();
                // SAFETY: every handle is live for the call; the result vector is owned by `out`.
                check(unsafe { $apply(&mut out.0, self.0, ins.0, cfg.0, current_stream()) })?;
                out.to_vec()
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: created by `_new`, freed once.
                unsafe { $free(self.0) };
            }
        }
    };
}

user_kernel!(
    /// A CUDA kernel body compiled by MLX at first use (NVRTC), per set of template arguments: inputs
    /// are `const T* name` (with `name_shape` / `_strides` / `_ndim` when the source names them),
    /// outputs `T* name`; `grid` counts threads, as Metal's does.
    CudaKernel, CudaConfig, sys::mlx_fast_cuda_kernel, sys::mlx_fast_cuda_kernel_config,
    0, // shared memory
    sys::mlx_fast_cuda_kernel_new, sys::mlx_fast_cuda_kernel_free, sys::mlx_fast_cuda_kernel_apply,
    sys::mlx_fast_cuda_kernel_config_new, sys::mlx_fast_cuda_kernel_config_free,
    sys::mlx_fast_cuda_kernel_config_add_output_arg, sys::mlx_fast_cuda_kernel_config_set_grid,
    sys::mlx_fast_cuda_kernel_config_set_thread_group, sys::mlx_fast_cuda_kernel_config_add_template_arg_int,
    sys::mlx_fast_cuda_kernel_config_add_template_arg_bool, sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype
);

user_kernel!(
    /// A Metal kernel body compiled by MLX at first use (`mx.fast.metal_kernel`), per set of template
    /// arguments: inputs `const device T* name` (scalars as `const constant T&`), outputs
    /// `device T* name`; `grid` counts threads. MLX refuses it without its Metal backend.
    MetalKernel, MetalConfig, sys::mlx_fast_metal_kernel, sys::mlx_fast_metal_kernel_config,
    false, // atomic outputs
    sys::mlx_fast_metal_kernel_new, sys::mlx_fast_metal_kernel_free, sys::mlx_fast_metal_kernel_apply,
    sys::mlx_fast_metal_kernel_config_new, sys::mlx_fast_metal_kernel_config_free,
    sys::mlx_fast_metal_kernel_config_add_output_arg, sys::mlx_fast_metal_kernel_config_set_grid,
    sys::mlx_fast_metal_kernel_config_set_thread_group, sys::mlx_fast_metal_kernel_config_add_template_arg_int,
    sys::mlx_fast_metal_kernel_config_add_template_arg_bool, sys::mlx_fast_metal_kernel_config_add_template_arg_dtype
);

#[cfg(test)]
mod compact_tests {
    use super::compact;

    #[test]
    fn compact_drops_comments_and_indentation_only() {
        let src = "  // a comment line\n    int a = 1; // trailing\n\n#define M(x) \\\n    (x) /* inline */ + 1\n  asm(\"dp4a // not a comment\" : \"+r\"(a));\n/* block\n   over lines */ int b;\n";
        assert_eq!(
            compact(src),
            "int a = 1;\n#define M(x) \\\n(x)  + 1\nasm(\"dp4a // not a comment\" : \"+r\"(a));\nint b;\n"
        );
    }
}
