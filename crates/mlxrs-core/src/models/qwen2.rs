//! Qwen2: the Llama decoder with biases on the q/k/v projections.
use super::llama::{Model, Variant};
use crate::error::Result;
use crate::weights::Weights;
use serde_json::Value;

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    Model::load_variant(config, w, Variant { qkv_bias: true, o_bias: false, qk_norm: false }, false)
}
