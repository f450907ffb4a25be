//! Raw FFI to mlx-c, loaded at run time.
//!
//! Nothing here links against libmlxc at build time: [`load`] finds libmlxc (and libmlx) in mlxrs's
//! resolution order — `MLXRS_LIBMLXC`, a sidecar beside the extension module, the native-pack cache,
//! Homebrew — opens them with `libloading`, resolves every entry point into one [`Api`] table and
//! checks the mlx-c version. The generated free functions (`mlx_add`, …) call through that table.
//! This crate and the handle module of mlxrs-core are the only places with `unsafe`.
#![allow(non_camel_case_types)]

mod generated;
mod resolve;
pub mod types;

pub use generated::*;
pub use resolve::{
    candidate_backends, mlx_version_near, mlxrs_home, native_pack_dir, preload_blas_early, register_mlx_lib_dir,
    this_module_dir, BlasPreload, LoadError, Resolver, Runtime, Source, BUILT_FOR_MLX, BUILT_FOR_MLXC, LIBMLX, LIBMLXC,
    NATIVE_PACK_VERSION,
};
pub use types::*;

use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::OnceLock;

/// Entry points whose signatures carry function pointers (the generator skips those).
pub struct ExtraApi {
    pub mlx_set_error_handler: unsafe extern "C" fn(
        handler: Option<mlx_error_handler_func>,
        data: *mut c_void,
        dtor: Option<mlx_payload_dtor>,
    ),
    pub mlx_closure_new_func_payload: unsafe extern "C" fn(
        fun: mlx_closure_fn_payload,
        payload: *mut c_void,
        dtor: Option<mlx_payload_dtor>,
    ) -> mlx_closure,
    /// Present in libmlxc built by native/ (mlxrs_version.c): the mlx-c release it was built from.
    pub mlxrs_mlxc_version: Option<unsafe extern "C" fn() -> *const std::os::raw::c_char>,
    /// Present in libmlxc built by native/: the signature of every function of the mlx-c tree it was
    /// built from, one `name=(types) -> ret` per line (gen_bindings.py --c-table).
    pub mlxrs_mlxc_signatures: Option<unsafe extern "C" fn() -> *const std::os::raw::c_char>,
    /// native/mlxrs_ext.cpp: MLX 0.32's fused-attention switch (absent from a libmlxc built elsewhere).
    pub mlxrs_fast_scaled_dot_product_attention_fused: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            queries: mlx_array,
            keys: mlx_array,
            values: mlx_array,
            scale: f32,
            mask_mode: *const std::os::raw::c_char,
            mask_arr: mlx_array,
            sinks: mlx_array,
            force_fused: bool,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: MLX 0.32's gated DeltaNet recurrence kernel ([output, state]).
    pub mlxrs_fast_gated_delta_update: Option<
        unsafe extern "C" fn(
            res: *mut mlx_vector_array,
            queries: mlx_array,
            keys: mlx_array,
            values: mlx_array,
            gates: mlx_array,
            beta: mlx_array,
            initial_state: mlx_array,
            mask: mlx_array,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: `x · Wᵀ` (float32) through the caller's host kernel, as one op of MLX's
    /// graph on a CPU stream.
    pub mlxrs_host_matmul: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            x: mlx_array,
            w: mlx_array,
            kernel: HostMatmulKernel,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: `x · dequant(W)ᵀ` (float32 x; W as int8 values with float32 scales and
    /// optional biases per group along its rows) through the caller's host kernel, as one op of MLX's
    /// graph on a CPU stream. `biases` an empty handle (null ctx) for none.
    pub mlxrs_host_blocks_matmul: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            x: mlx_array,
            q: mlx_array,
            scales: mlx_array,
            biases: mlx_array,
            kernel: HostBlocksKernel,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: `x · dequant(W)ᵀ` (float32 x; W as MLX's affine quantization packs it:
    /// uint32 words of 4- or 8-bit values, scales and biases per group along its rows, float32,
    /// bfloat16 or float16) through the caller's host kernel, as one op of MLX's graph on a CPU stream.
    pub mlxrs_host_packed_matmul: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            x: mlx_array,
            w: mlx_array,
            scales: mlx_array,
            biases: mlx_array,
            bits: c_int,
            kernel: HostPackedKernel,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: `x · Wᵀ` (W bfloat16 or float16; x and the product float32 or of W's
    /// type) through the caller's host kernel, as one op of MLX's graph on a CPU stream; `gemm`:
    /// through the BLAS.
    pub mlxrs_host_half_matmul: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            x: mlx_array,
            w: mlx_array,
            gemm: bool,
            kernel: HostHalfKernel,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: `x[i] · W[idx[i]]ᵀ` row by row (the experts of a mixture: W `[experts,
    /// rows, cols]` bfloat16 or float16; x `[n, cols]` and the product float32 or of W's type; idx `[n]`
    /// int32 or uint32) through the caller's host kernel, as one op of MLX's graph on a CPU stream.
    pub mlxrs_host_half_gather_matmul: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            x: mlx_array,
            w: mlx_array,
            idx: mlx_array,
            gemm: bool,
            kernel: HostHalfGatherKernel,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: `softmax(scale · q kᵀ (+ causal mask, or a boolean `[Lq, Lk]` mask unless
    /// an empty handle)) v` for 16-bit floats through the caller's host kernel, as one op of MLX's graph
    /// on a CPU stream.
    pub mlxrs_host_half_attention: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            q: mlx_array,
            k: mlx_array,
            v: mlx_array,
            mask: mlx_array,
            scale: f32,
            causal: bool,
            kernel: HostHalfAttnKernel,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: one decode step's attention for rows with caches of their own (float32,
    /// CPU stream): queries `[B, heads, 1, D]`, keys and values of each row in turn.
    pub mlxrs_rows_decode_attention: Option<
        unsafe extern "C" fn(
            res: *mut mlx_array,
            queries: mlx_array,
            keys_values: mlx_vector_array,
            scale: f32,
            s: mlx_stream,
        ) -> c_int,
    >,
    /// native/mlxrs_ext.cpp: the pool its CPU primitives split their work over (None: threads of
    /// their own).
    pub mlxrs_set_parallel_for: Option<unsafe extern "C" fn(f: Option<ParallelFor>)>,
}

/// What [`ExtraApi::mlxrs_set_parallel_for`] registers: `body(ctx, begin, end)` over ranges covering
/// `0..items`, each at least `grain` long but the last, returning when every range has run.
pub type ParallelFor = unsafe extern "C" fn(items: i64, grain: i64, body: RangeBody, ctx: *mut c_void);

/// One range of a [`ParallelFor`] (it does not unwind).
pub type RangeBody = unsafe extern "C" fn(ctx: *mut c_void, begin: i64, end: i64);

/// The kernel [`ExtraApi::mlxrs_host_matmul`] calls on MLX's CPU thread: `y [n, rows] = x [n, cols] ·
/// Wᵀ` for `w` `[rows, cols]`, all row-major float32.
pub type HostMatmulKernel =
    unsafe extern "C" fn(w: *const f32, rows: usize, cols: usize, x: *const f32, n: usize, y: *mut f32);

/// What [`ExtraApi::mlxrs_host_blocks_matmul`]'s kernel computes (native/mlxrs_ext.cpp's
/// `mlxrs_host_blocks_args`, field for field): `y [n, rows] = x [n, cols] · dequant(W)ᵀ`, `q` `[rows,
/// cols]` int8, `s` and `b` (null: none) `[rows, cols / group]` float32, all row-major.
#[repr(C)]
pub struct HostBlocksArgs {
    pub q: *const i8,
    pub s: *const f32,
    pub b: *const f32,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub x: *const f32,
    pub n: usize,
    pub y: *mut f32,
}

/// The kernel [`ExtraApi::mlxrs_host_blocks_matmul`] calls on MLX's CPU thread.
pub type HostBlocksKernel = unsafe extern "C" fn(args: *const HostBlocksArgs);

/// What [`ExtraApi::mlxrs_host_packed_matmul`]'s kernel computes (native/mlxrs_ext.cpp's
/// `mlxrs_host_packed_args`, field for field): `y [n, rows] = x [n, cols] · dequant(W)ᵀ`, `w` `[rows,
/// cols · bits / 32]` uint32, `s` and `b` `[rows, cols / group]` of type `sdtype` (0 float32, 1
/// bfloat16, 2 float16), all row-major.
#[repr(C)]
pub struct HostPackedArgs {
    pub w: *const u32,
    pub s: *const c_void,
    pub b: *const c_void,
    pub sdtype: c_int,
    pub bits: c_int,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub x: *const f32,
    pub n: usize,
    pub y: *mut f32,
}

/// The kernel [`ExtraApi::mlxrs_host_packed_matmul`] calls on MLX's CPU thread.
pub type HostPackedKernel = unsafe extern "C" fn(args: *const HostPackedArgs);

/// What [`ExtraApi::mlxrs_host_half_matmul`]'s kernel computes (native/mlxrs_ext.cpp's
/// `mlxrs_host_half_args`, field for field): `y [n, rows] = x [n, cols] · Wᵀ`, `w` `[rows, cols]` 16-bit
/// floats of type `wdtype` (0 bfloat16, 1 float16), `x` and `y` float32 — or both of W's type where
/// `x16` is 1 (the product rounded once) — all row-major; `gemm` 1: through the BLAS, 0: W read in
/// place.
#[repr(C)]
pub struct HostHalfArgs {
    pub w: *const u16,
    pub wdtype: c_int,
    pub rows: usize,
    pub cols: usize,
    pub x: *const c_void,
    pub n: usize,
    pub y: *mut c_void,
    pub gemm: c_int,
    pub x16: c_int,
}

/// The kernel [`ExtraApi::mlxrs_host_half_matmul`] calls on MLX's CPU thread.
pub type HostHalfKernel = unsafe extern "C" fn(args: *const HostHalfArgs);

/// What [`ExtraApi::mlxrs_host_half_gather_matmul`]'s kernel computes (native/mlxrs_ext.cpp's
/// `mlxrs_host_half_gather_args`, field for field): `y[i] = x[i] · W[idx[i]]ᵀ` for `w` `[experts, rows,
/// cols]` 16-bit floats of type `wdtype` (0 bfloat16, 1 float16), `x` `[n, cols]` and `y` `[n, rows]`
/// float32 — or both of W's type where `x16` is 1 (each product rounded once) — and `idx` `[n]`; all
/// row-major; `gemm` 1: through the BLAS, 0: W read in place. An index past the experts gives a NaN row.
#[repr(C)]
pub struct HostHalfGatherArgs {
    pub w: *const u16,
    pub wdtype: c_int,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub x: *const c_void,
    pub idx: *const u32,
    pub n: usize,
    pub y: *mut c_void,
    pub gemm: c_int,
    pub x16: c_int,
}

/// The kernel [`ExtraApi::mlxrs_host_half_gather_matmul`] calls on MLX's CPU thread.
pub type HostHalfGatherKernel = unsafe extern "C" fn(args: *const HostHalfGatherArgs);

/// What [`ExtraApi::mlxrs_host_half_attention`]'s kernel computes (native/mlxrs_ext.cpp's
/// `mlxrs_host_half_attn_args`, field for field): `out [b, heads, lq, dv] = softmax(scale · q kᵀ (+
/// causal mask)) v` for `q` `[b, heads, lq, d]`, `k` `[b, kv_heads, lk, d]`, `v` `[b, kv_heads, lk, dv]`,
/// all row-major 16-bit floats of type `dtype` (0 bfloat16, 1 float16); `causal` 1: query i sees keys
/// up to `lk - lq + i`; `mask` (null: none) a boolean `[lq, lk]`: query i sees key j where it is true.
#[repr(C)]
pub struct HostHalfAttnArgs {
    pub q: *const u16,
    pub k: *const u16,
    pub v: *const u16,
    pub out: *mut u16,
    pub mask: *const bool,
    pub dtype: c_int,
    pub causal: c_int,
    pub scale: f32,
    pub b: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub lq: usize,
    pub lk: usize,
    pub d: usize,
    pub dv: usize,
}

/// The kernel [`ExtraApi::mlxrs_host_half_attention`] calls on MLX's CPU thread.
pub type HostHalfAttnKernel = unsafe extern "C" fn(args: *const HostHalfAttnArgs);

impl ExtraApi {
    unsafe fn resolve(lib: &libloading::Library) -> Result<Self, String> {
        // SAFETY: the symbol types match mlx-c's declarations in error.h and closure.h.
        unsafe {
            Ok(Self {
                mlx_set_error_handler: *lib
                    .get(b"mlx_set_error_handler\0")
                    .map_err(|_| "mlx_set_error_handler".to_string())?,
                mlx_closure_new_func_payload: *lib
                    .get(b"mlx_closure_new_func_payload\0")
                    .map_err(|_| "mlx_closure_new_func_payload".to_string())?,
                mlxrs_mlxc_version: lib.get(b"mlxrs_mlxc_version\0").ok().map(|s| *s),
                mlxrs_mlxc_signatures: lib.get(b"mlxrs_mlxc_signatures\0").ok().map(|s| *s),
                mlxrs_fast_scaled_dot_product_attention_fused: lib
                    .get(b"mlxrs_fast_scaled_dot_product_attention_fused\0")
                    .ok()
                    .map(|s| *s),
                mlxrs_fast_gated_delta_update: lib.get(b"mlxrs_fast_gated_delta_update\0").ok().map(|s| *s),
                mlxrs_host_matmul: lib.get(b"mlxrs_host_matmul\0").ok().map(|s| *s),
                mlxrs_host_blocks_matmul: lib.get(b"mlxrs_host_blocks_matmul\0").ok().map(|s| *s),
                mlxrs_host_packed_matmul: lib.get(b"mlxrs_host_packed_matmul\0").ok().map(|s| *s),
                mlxrs_host_half_matmul: lib.get(b"mlxrs_host_half_matmul\0").ok().map(|s| *s),
                mlxrs_host_half_gather_matmul: lib.get(b"mlxrs_host_half_gather_matmul\0").ok().map(|s| *s),
                mlxrs_host_half_attention: lib.get(b"mlxrs_host_half_attention\0").ok().map(|s| *s),
                mlxrs_rows_decode_attention: lib.get(b"mlxrs_rows_decode_attention\0").ok().map(|s| *s),
                mlxrs_set_parallel_for: lib.get(b"mlxrs_set_parallel_for\0").ok().map(|s| *s),
            })
        }
    }
}

pub(crate) struct Loaded {
    pub api: Api,
    pub extra: ExtraApi,
    pub runtime: Runtime,
}

static LOADED: OnceLock<Loaded> = OnceLock::new();

/// The resolved table. Callers must have called [`load`] successfully first (mlxrs-core does so
/// before it creates any handle); calling an mlx-c function before that is a programming error.
#[inline]
pub fn api() -> &'static Api {
    &LOADED.get().expect("mlx runtime not loaded: call mlxrs_sys::load() first").api
}

/// Function-pointer entry points (error handler, closures).
pub fn extra() -> &'static ExtraApi {
    &LOADED.get().expect("mlx runtime not loaded: call mlxrs_sys::load() first").extra
}

/// The BLAS's row-major/column-major single-precision matrix product, as CBLAS declares it:
/// `(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`, order 101 row-major,
/// transposes 111 none / 112 transposed.
pub type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
) -> ();

/// `cblas_sgemm` as the process resolves it for MLX (libmlxrs_blas's router where it is loaded, else
/// the BLAS MLX's CPU backend calls), looked up until found (then kept); None where no library in the
/// process defines it yet (no BLAS loaded globally).
pub fn cblas_sgemm() -> Option<Sgemm> {
    static SGEMM: OnceLock<Sgemm> = OnceLock::new();
    if let Some(f) = SGEMM.get() {
        return Some(*f);
    }
    #[cfg(unix)]
    {
        // SAFETY: looking a symbol up in the process's global scope runs no code; the symbol is
        // CBLAS's cblas_sgemm, whose C signature `Sgemm` spells out; the libraries defining it stay
        // loaded for the life of the process (the loader never closes them)
        let f = unsafe {
            let this = libloading::os::unix::Library::this();
            let f = this.get::<Sgemm>(b"cblas_sgemm\0").ok().map(|s| *s);
            std::mem::forget(this);
            f
        }?;
        Some(*SGEMM.get_or_init(|| f))
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The loaded runtime, if any.
pub fn runtime() -> Option<&'static Runtime> {
    LOADED.get().map(|l| &l.runtime)
}

static LOAD_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Find, open and check the native runtime once per process, with the default [`Resolver`]
/// (environment, sidecar beside this module, native-pack cache, Homebrew). Later calls return the
/// same runtime; a failed attempt may be retried (for example after setting `MLXRS_LIBMLXC`).
pub fn load() -> Result<&'static Runtime, LoadError> {
    if let Some(l) = LOADED.get() {
        return Ok(&l.runtime);
    }
    load_with(&Resolver::from_env())
}

/// [`load`] with an explicit resolver (tests point it at temporary directories).
pub fn load_with(resolver: &Resolver) -> Result<&'static Runtime, LoadError> {
    let _g = LOAD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = LOADED.get() {
        return Ok(&l.runtime);
    }
    let (runtime, lib) = resolver.open()?;
    // SAFETY: `lib` is a libmlxc we just opened; the generated signatures follow its headers and a
    // missing symbol is reported instead of used.
    let api = unsafe { Api::resolve(&lib) }.map_err(|sym| LoadError::Mismatch {
        path: runtime.libmlxc.clone(),
        detail: format!("symbol {sym} is missing: this libmlxc is not mlx-c v{BUILT_FOR_MLXC}"),
    })?;
    let extra = unsafe { ExtraApi::resolve(&lib) }.map_err(|sym| LoadError::Mismatch {
        path: runtime.libmlxc.clone(),
        detail: format!("symbol {sym} is missing"),
    })?;
    if let Some(table) = extra.mlxrs_mlxc_signatures {
        // SAFETY: returns a static NUL-terminated string.
        let table = unsafe { std::ffi::CStr::from_ptr(table()) }.to_string_lossy().into_owned();
        if let Some(detail) = signature_mismatch(&table) {
            return Err(LoadError::Mismatch { path: runtime.libmlxc.clone(), detail });
        }
    }
    let loaded = Loaded { api, extra, runtime };
    std::mem::forget(lib); // the library stays mapped for the life of the process
    let loaded = LOADED.get_or_init(|| loaded);
    check_versions(&loaded.runtime)?;
    Ok(&loaded.runtime)
}

fn check_versions(rt: &Runtime) -> Result<(), LoadError> {
    let (mlxc, mlx) = loaded_versions().unwrap_or_default();
    if !version_matches(&mlx, BUILT_FOR_MLX) {
        return Err(LoadError::Mismatch {
            path: rt.libmlx.clone().unwrap_or_else(|| rt.libmlxc.clone()),
            detail: format!("MLX reports version {mlx}, mlxrs was built for MLX {BUILT_FOR_MLX}"),
        });
    }
    // A library with a signature table passed the stricter check already (it may be another mlx-c
    // release with the same C API, e.g. upstream's commit built by --fetchcontent).
    let has_table = LOADED.get().is_some_and(|l| l.extra.mlxrs_mlxc_signatures.is_some());
    if mlxc != "unknown" && !has_table && !version_matches(&mlxc, BUILT_FOR_MLXC) {
        return Err(LoadError::Mismatch {
            path: rt.libmlxc.clone(),
            detail: format!("it is mlx-c {mlxc}, mlxrs was built for mlx-c {BUILT_FOR_MLXC}"),
        });
    }
    Ok(())
}

/// The versions the loaded libraries report: (mlx-c, MLX). mlx-c's release is known when libmlxc
/// was built by native/ ("unknown" otherwise: then the complete symbol table is the check).
pub fn loaded_versions() -> Option<(String, String)> {
    let l = LOADED.get()?;
    let mlx = read_string(|s| unsafe { mlx_version(s) });
    let mlxc = match l.extra.mlxrs_mlxc_version {
        // SAFETY: returns a static NUL-terminated string.
        Some(f) => unsafe { std::ffi::CStr::from_ptr(f()) }.to_string_lossy().into_owned(),
        None => "unknown".to_string(),
    };
    Some((mlxc, mlx))
}

/// Compare the library's signature table with the bindings' ([`SIGNATURES`]): the first bound
/// function whose signature differs, or that the table lacks, as a message (None: they agree).
/// Functions the library has beyond the bindings are fine.
pub fn signature_mismatch(table: &str) -> Option<String> {
    let lib: std::collections::HashMap<&str, &str> = table.lines().filter_map(|l| l.split_once('=')).collect();
    let bad: Vec<String> = SIGNATURES
        .iter()
        .filter(|(name, sig)| lib.get(name) != Some(sig))
        .map(|(name, sig)| match lib.get(name) {
            Some(theirs) => format!("{name}: library {theirs}, bindings {sig}"),
            None => format!("{name}: not in the library's table"),
        })
        .collect();
    let first = bad.first()?;
    Some(format!(
        "its C API differs from the one mlxrs's bindings were generated for ({} function(s); first: {first}). \
         Rebuild libmlxc with python native/build.py (mlx-c v{BUILT_FOR_MLXC} + native/patches)",
        bad.len()
    ))
}

/// `"0.5.0"` matches `"0.5.0"`, `"0.5.0.dev…"` and `"0.5.0-…"`.
pub fn version_matches(reported: &str, want: &str) -> bool {
    reported == want || reported.strip_prefix(want).is_some_and(|r| r.starts_with(['.', '-', '+']))
}

fn read_string(f: impl FnOnce(*mut mlx_string) -> c_int) -> String {
    // SAFETY: mlx_string_new gives an empty string handle that f fills; we copy it out and free it.
    unsafe {
        let mut s = mlx_string_new();
        let rc = f(&mut s);
        let out = if rc == 0 {
            let p = mlx_string_data(s);
            if p.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        } else {
            String::new()
        };
        mlx_string_free(s);
        out
    }
}
