//! What the native runtime is and where it came from (`mlxrs.runtime_info()`, `--version`).
use crate::error::Result;
use crate::handle::{self, DeviceKind};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct RuntimeInfo {
    pub mlxrs_version: String,
    pub mlx_version: String,
    pub mlxc_version: String,
    pub backend: String,
    pub device: String,
    pub source: String,
    pub libmlxc: String,
    pub libmlx: Option<String>,
    pub blas: Option<String>,
    /// libmlxrs_blas, routing float32 matrix-vector products to the BLAS's gemv (Linux CPU).
    pub blas_gemv: Option<String>,
    /// libmlx was loaded before mlxrs could put the BLAS ahead of it (`mlx.core` imported first):
    /// MLX's CPU matrix products then run on MLX's own reference BLAS in this process.
    pub mlx_loaded_first: bool,
    pub memory_size: Option<usize>,
    pub active_memory: usize,
    pub peak_memory: usize,
}

/// `mlxrs info`'s tiny computation through MLX: `[[0,1,2],[3,4,5]] @ ones(3,2)`, as rows.
pub fn tiny_matmul() -> Result<Vec<Vec<f32>>> {
    handle::init()?;
    let a = handle::Array::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3])?;
    let b = handle::ones(&[3, 2], handle::Dtype::Float32)?;
    let c = handle::matmul(&a, &b)?;
    let cols = c.shape()[1] as usize;
    Ok(c.to_vec::<f32>()?.chunks(cols).map(<[f32]>::to_vec).collect())
}

/// Load the runtime if needed and describe it.
pub fn runtime_info() -> Result<RuntimeInfo> {
    let rt = handle::init()?;
    let (mlxc, mlx) = mlxrs_sys::loaded_versions().unwrap_or_default();
    let dev = handle::default_device()?;
    let gpu = dev.kind() == DeviceKind::Gpu;
    let backend = if !gpu {
        "cpu"
    } else if cfg!(target_os = "macos") {
        "metal"
    } else {
        "cuda"
    };
    Ok(RuntimeInfo {
        mlxrs_version: env!("CARGO_PKG_VERSION").to_string(),
        mlx_version: mlx,
        mlxc_version: mlxc,
        backend: backend.to_string(),
        device: if gpu { "gpu".into() } else { "cpu".into() },
        source: rt.source.to_string(),
        libmlxc: rt.libmlxc.display().to_string(),
        libmlx: rt.libmlx.as_ref().map(|p| p.display().to_string()),
        blas: rt.blas.as_ref().map(|p| p.display().to_string()),
        blas_gemv: rt.blas_gemv.as_ref().map(|p| p.display().to_string()),
        mlx_loaded_first: rt.mlx_loaded_first,
        memory_size: handle::device_memory_size(&dev),
        active_memory: handle::active_memory(),
        peak_memory: handle::peak_memory(),
    })
}
