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
pub mod describe;
pub mod download;
pub mod engine;
pub mod generate;
pub mod gguf;
pub mod guide;
pub mod lora;
pub mod models;
pub mod native_pack;
pub mod plan;
pub mod safetensors;
pub mod sample;
pub mod template;
pub mod tokenizer;
pub mod vision;
pub mod weights;
