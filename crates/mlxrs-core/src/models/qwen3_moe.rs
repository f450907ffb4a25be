//! Qwen3-MoE: the Qwen3 decoder (qk-norm, no biases) whose FFN is a sparse mixture of experts
//! (softmax top-k router, SwiGLU experts) on every `decoder_sparse_step`-th layer not listed in
//! `mlp_only_layers`, a dense MLP elsewhere (mlx-lm's `models/qwen3_moe.py`).
use super::arch::{self, Arch, AttnKind, FfnKind, LayerLayout};
use super::llama::{Model, Variant};
use super::{limits, Cfg, DimDefaults};
use crate::error::{Error, Result};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "qwen3_moe",
    model_types: &["qwen3_moe"],
    sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: Some("qwen3moe"),
};

/// mlx-lm's sanitize: the Hugging Face layout's per-expert `mlp.experts.{e}.{proj}.weight` stacked
/// into `mlp.switch_mlp.{proj}.weight` `[experts, out, in]`; a tied lm_head dropped.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    super::llama::sanitize(config, w)?;
    let c = Cfg(config);
    let layers = c.size("num_hidden_layers", None, limits::LAYERS)?;
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        if !w.contains(&format!("{p}.experts.0.up_proj.weight")) {
            continue;
        }
        let n = c.size("num_experts", None, limits::EXPERTS)?;
        let projs = [("up_proj", "up_proj"), ("down_proj", "down_proj"), ("gate_proj", "gate_proj")];
        arch::stack_experts(w, &p, n, "switch_mlp", &projs)?;
    }
    Ok(())
}

/// Full attention everywhere (mlx-lm's qwen3_moe has no sliding window); a MoE FFN on the layers
/// mlx-lm gives one.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let c = Cfg(config);
    let experts = c.get("num_experts").and_then(Value::as_i64).unwrap_or(0);
    let moe = if experts > 0 {
        Some(FfnKind::Moe {
            experts: c.size("num_experts", None, limits::EXPERTS)?,
            top_k: c.size("num_experts_per_tok", None, limits::EXPERTS)?,
            intermediate: c.size("moe_intermediate_size", None, limits::INTERMEDIATE)?,
            shared: 0,
            norm_topk_prob: c.b_or("norm_topk_prob", false),
        })
    } else {
        None
    };
    if let Some(FfnKind::Moe { experts, top_k, .. }) = moe {
        if top_k > experts {
            return Err(Error::ModelLoad(format!(
                "config.json: num_experts_per_tok {top_k} exceeds num_experts {experts}"
            )));
        }
    }
    let step = c.size("decoder_sparse_step", Some(1), limits::LAYERS)?;
    let mlp_only: Vec<i64> = c
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default();
    arch::uniform(
        config,
        DimDefaults::default(),
        |_| AttnKind::Full,
        |i, d| match moe {
            Some(m) if !mlp_only.contains(&(i as i64)) && (i + 1) % step == 0 => Ok(m),
            _ => arch::dense(i, d),
        },
    )
}

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    Model::load_variant(
        config,
        w,
        Variant { qkv_bias: false, o_bias: false, qk_norm: true, rope_scaling: false },
        false,
        layout(config)?,
    )
}
