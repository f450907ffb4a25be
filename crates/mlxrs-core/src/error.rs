//! One error type for the core; mlxrs-py maps each variant to a class in `mlxrs.errors`.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX raised: the text is MLX's own message.
    #[error("{0}")]
    Mlx(String),
    /// The native runtime could not be found, opened or does not match.
    #[error(transparent)]
    Runtime(#[from] mlxrs_sys::LoadError),
    /// No native runtime anywhere, and the native pack could not be fetched on first need (none
    /// published for this platform, or the fetch failed): every place tried and why.
    #[error("{0}")]
    NoRuntime(String),
    /// Bad arguments caught before reaching MLX (shape/data length, dtype).
    #[error("{0}")]
    Invalid(String),
    /// A model directory or file could not be loaded.
    #[error("{0}")]
    ModelLoad(String),
    /// A model_type mlxrs has no implementation for.
    #[error("{0}")]
    Unsupported(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The engine's queue is full: retry later (a 429 with Retry-After in the server).
    #[error("{0}")]
    Busy(String),
    /// The engine thread died (a panic inside its step loop): what was in flight and every later
    /// request of the session fail with this.
    #[error("{0}")]
    Engine(String),
}

pub type Result<T> = std::result::Result<T, Error>;
