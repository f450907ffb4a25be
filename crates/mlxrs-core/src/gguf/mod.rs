//! llama.cpp's GGUF format: reading, dequantization, and import into a normal model directory.
pub mod dequant;
pub mod import;
pub mod reader;
pub mod tokenizer;

pub use reader::{GgmlType, GgufError, GgufFile, GgufHeader, MetaValue, TensorInfo};
