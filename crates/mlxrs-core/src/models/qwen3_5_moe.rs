//! Qwen3.5-MoE (text): the Qwen3.5 decoder with a sparse MoE and a gated shared expert on every
//! layer; its checkpoint fuses each layer's expert gate and up projections into
//! `experts.gate_up_proj` `[experts, 2 * width, hidden]` (mlx-lm's `models/qwen3_5_moe.py`).
use super::arch::Arch;
use super::qwen3_next::{Flavor, Model, Params};
use crate::error::{Error, Result};
use crate::handle as mx;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "qwen3_5_moe",
    model_types: &["qwen3_5_moe"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w, Flavor::Qwen35)?)),
    layout: |c| Ok(Params::from_config(c, Flavor::Qwen35)?.layout()),
    gguf: None,
};

/// The wrapper's renames, then each `experts.gate_up_proj` split at the middle of its second axis
/// into `switch_mlp.gate_proj` and `switch_mlp.up_proj` (and `experts.down_proj` renamed), then
/// Qwen3.5's text sanitize.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    super::qwen3_5::rename_text_weights(w)?;
    let layers = super::Cfg(Params::text(config)).size("num_hidden_layers", Some(32), super::limits::LAYERS)?;
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        let key = format!("{p}.experts.gate_up_proj");
        if !w.contains(&key) {
            continue;
        }
        let gu = w.take(&key)?;
        if gu.ndim() != 3 || gu.dim(-2) % 2 != 0 {
            return Err(Error::ModelLoad(format!(
                "weight {key} has shape {:?}, not [experts, 2 * width, hidden]",
                gu.shape()
            )));
        }
        let mid = gu.dim(-2) / 2;
        w.insert(format!("{p}.switch_mlp.gate_proj.weight"), mx::slice_axis(&gu, -2, 0, mid)?);
        w.insert(format!("{p}.switch_mlp.up_proj.weight"), mx::slice_axis(&gu, -2, mid, 2 * mid)?);
        let down = w.take(&format!("{p}.experts.down_proj"))?;
        w.insert(format!("{p}.switch_mlp.down_proj.weight"), down);
    }
    super::qwen3_5::text_sanitize(config, w)
}
