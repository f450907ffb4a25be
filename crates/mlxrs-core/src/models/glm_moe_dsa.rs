//! GLM-5 (mlx-lm's `models/glm_moe_dsa.py`): deepseek_v32's decoder ([`super::deepseek_v32`]:
//! MLA, the sparse-attention indexer, the grouped sigmoid MoE) with the rotary parameters in
//! `rope_parameters` (its `rope_theta`, and itself as the `rope_scaling`) and the indexer's rope
//! interleaved unless `indexer_rope_interleave` says otherwise.
use super::arch::{Arch, LayerLayout};
use super::{deepseek_v3, deepseek_v32};
use crate::error::{Error, Result};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "glm_moe_dsa",
    model_types: &["glm_moe_dsa"],
    sanitize: deepseek_v3::sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: None,
};

/// The config as deepseek_v32 reads it: `rope_theta` and `rope_scaling` from `rope_parameters`
/// (mlx-lm's `__post_init__`).
pub fn remap(config: &Value) -> Result<Value> {
    let params = config.get("rope_parameters").filter(|p| p.is_object()).ok_or_else(|| {
        Error::ModelLoad("config.json: rope_parameters is missing or not an object (glm_moe_dsa)".into())
    })?;
    let theta = params.get("rope_theta").filter(|t| t.as_f64().is_some_and(|t| t > 0.0)).ok_or_else(|| {
        Error::ModelLoad("config.json: rope_parameters.rope_theta is missing or not a positive number".into())
    })?;
    let mut c = config.clone();
    c["rope_theta"] = theta.clone();
    c["rope_scaling"] = params.clone();
    Ok(c)
}

pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    deepseek_v32::layout(&remap(config)?)
}

pub fn load(config: &Value, w: Weights) -> Result<deepseek_v3::Model> {
    deepseek_v32::load_interleave(&remap(config)?, w, true)
}
