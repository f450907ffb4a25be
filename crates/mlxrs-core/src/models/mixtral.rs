//! Mixtral: the Mistral decoder whose every FFN is a sparse mixture of experts under
//! `block_sparse_moe` (the top k router logits, a softmax over them, SwiGLU experts), as mlx-lm's
//! `models/mixtral.py`. Like mlx-lm, it attends over every position (a config's `sliding_window`
//! is not used), takes the head dim as `hidden_size / num_attention_heads` and builds a plain RoPE.
use super::arch::{self, Arch, AttnKind, FfnKind, LayerLayout};
use super::layers::{MoeSpec, Router};
use super::llama::{Extra, Model, Variant};
use super::{limits, Cfg, DimDefaults};
use crate::error::{Error, Result};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "mixtral",
    model_types: &["mixtral"],
    sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: None,
};

/// The config as mlx-lm's `ModelArgs` reads it: its defaults for the fields a config may leave
/// out, and no `head_dim` (mixtral's attention derives it).
fn args(config: &Value) -> Value {
    super::with_defaults(
        config,
        &["head_dim"],
        &[
            ("num_local_experts", Value::from(8)),
            ("num_experts_per_tok", Value::from(2)),
            ("rms_norm_eps", Value::from(1e-5)),
            ("rope_theta", Value::from(1e6)),
            ("tie_word_embeddings", Value::from(false)),
        ],
    )
}

/// mlx-lm's sanitize: a tied lm_head dropped; the per-expert `block_sparse_moe.experts.{e}.w1/w2/w3`
/// (each `weight`, and `scales`/`biases` when quantized) stacked into
/// `block_sparse_moe.switch_mlp.{gate,down,up}_proj` `[experts, out, in]`.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let config = &args(config);
    let c = Cfg(config);
    if c.b_or("tie_word_embeddings", false) {
        w.remove("lm_head.weight");
    }
    w.retain(|k| !k.contains("self_attn.rotary_emb.inv_freq"));
    if !w.contains("model.layers.0.block_sparse_moe.experts.0.w1.weight") {
        return Ok(());
    }
    let layers = c.size("num_hidden_layers", None, limits::LAYERS)?;
    let n = c.size("num_local_experts", None, limits::EXPERTS)?;
    for l in 0..layers {
        let projs = [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")];
        arch::stack_experts(w, &format!("model.layers.{l}.block_sparse_moe"), n, "switch_mlp", &projs)?;
    }
    Ok(())
}

/// Full attention and a MoE FFN (`num_local_experts` of width `intermediate_size`,
/// `num_experts_per_tok` per token) in every layer.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let config = &args(config);
    let c = Cfg(config);
    let moe = FfnKind::Moe {
        experts: c.size("num_local_experts", None, limits::EXPERTS)?,
        top_k: c.size("num_experts_per_tok", None, limits::EXPERTS)?,
        intermediate: c.size("intermediate_size", None, limits::INTERMEDIATE)?,
        shared: 0,
        // a softmax over the chosen k: their weights sum to one
        norm_topk_prob: true,
    };
    if let FfnKind::Moe { experts, top_k, .. } = moe {
        if top_k > experts {
            return Err(Error::ModelLoad(format!(
                "config.json: num_experts_per_tok {top_k} exceeds num_local_experts {experts}"
            )));
        }
    }
    arch::uniform(config, DimDefaults::default(), |_| AttnKind::Full, |_, _| Ok(moe))
}

pub const EXTRA: Extra = Extra {
    ffn_name: "block_sparse_moe",
    moe: MoeSpec { router: Router::TopKSoftmax, ..MoeSpec::QWEN3 },
    rope_dims: None,
    tie: None,
    sinks: false,
};

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    let config = &args(config);
    let v = Variant { qkv_bias: false, o_bias: false, qk_norm: false, rope_scaling: false };
    Model::load_extra(config, w, v, false, layout(config)?, &EXTRA)
}
