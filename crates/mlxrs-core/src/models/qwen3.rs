//! Qwen3: the Llama decoder with per-head RMSNorm on queries and keys (qk-norm), no biases.
use super::arch::Arch;
use super::llama::{Model, Variant};
use crate::error::Result;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "qwen3",
    model_types: &["qwen3"],
    sanitize: super::llama::sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout: super::llama::layout,
    gguf: Some("qwen3"),
};

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    let bias = super::Cfg(config).b_or("attention_bias", false);
    Model::load_variant(
        config,
        w,
        Variant { qkv_bias: bias, o_bias: bias, qk_norm: true, rope_scaling: true },
        false,
        super::llama::layout(config)?,
    )
}
