//! Qwen2: the Llama decoder with biases on the q/k/v projections.
use super::arch::Arch;
use super::llama::{Model, Variant};
use crate::error::Result;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "qwen2",
    model_types: &["qwen2"],
    sanitize: super::llama::sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout: super::llama::layout,
    gguf: Some("qwen2"),
};

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    Model::load_variant(
        config,
        w,
        Variant { qkv_bias: true, o_bias: false, qk_norm: false, rope_scaling: true },
        false,
        super::llama::layout(config)?,
    )
}
