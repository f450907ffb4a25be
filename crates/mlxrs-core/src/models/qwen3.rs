//! Qwen3: the Llama decoder with per-head RMSNorm on queries and keys (qk-norm), no biases.
use super::llama::{Model, Variant};
use crate::error::Result;
use crate::weights::Weights;
use serde_json::Value;

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    let bias = super::Cfg(config).b_or("attention_bias", false);
    Model::load_variant(config, w, Variant { qkv_bias: bias, o_bias: bias, qk_norm: true }, false)
}
