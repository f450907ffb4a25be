//! mlxrs's engine core: safe MLX handles ([`handle`]), and on top of them the models, KV cache,
//! sampling and decode loop. `unsafe` lives only in mlxrs-sys and [`handle`].
#![deny(unsafe_code)]

pub mod error;
#[allow(unsafe_code)]
pub mod handle;
pub mod info;

pub use error::{Error, Result};
pub use handle::{Array, Dtype};
pub mod cache;
pub mod models;
pub mod weights;
pub mod safetensors;
pub mod sample;
pub mod generate;
pub mod tokenizer;
pub mod template;
pub mod engine;
pub mod guide;
pub mod gguf;
pub mod plan;
pub mod download;
pub mod native_pack;
pub mod vision;
pub mod lora;
