//! GLM-4.5/4.6 MoE (mlx-lm's `models/glm4_moe.py`): the Llama decoder with q/k/v biases
//! (`attention_bias`), optional qk-norm (`use_qk_norm`), a partial rotary embedding
//! (`partial_rotary_factor`, a plain RoPE: `rope_scaling` unused as in mlx-lm), dense MLPs in the
//! first `first_k_dense_replace` layers and from there a MoE: a sigmoid router choosing among
//! `n_group` groups with `e_score_correction_bias` ([`Router::GroupedSigmoid`]), routed experts
//! weighted by `routed_scaling_factor`, plus `n_shared_experts` shared experts. The LM head is
//! never tied. The multi-token-prediction layer (`model.layers.{num_hidden_layers}`) is dropped.
use super::arch::{self, Arch, AttnKind, FfnKind, LayerLayout};
use super::layers::{MoeSpec, Router};
use super::llama::{Extra, Model, Variant};
use super::{limits, Cfg, DimDefaults};
use crate::error::{Error, Result};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "glm4_moe",
    model_types: &["glm4_moe"],
    sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: None,
};

/// mlx-lm's sanitize: per-expert `mlp.experts.{e}.{gate,down,up}_proj` stacked into
/// `mlp.switch_mlp.*`; the multi-token-prediction layer dropped.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let c = Cfg(config);
    let layers = c.size("num_hidden_layers", None, limits::LAYERS)?;
    let mtp = format!("model.layers.{layers}.");
    w.retain(|k| !k.starts_with(&mtp) && !k.contains("self_attn.rotary_emb.inv_freq"));
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        if !w.contains(&format!("{p}.experts.0.gate_proj.weight")) {
            continue;
        }
        let n = c.size("n_routed_experts", None, limits::EXPERTS)?;
        let projs = [("gate_proj", "gate_proj"), ("down_proj", "down_proj"), ("up_proj", "up_proj")];
        arch::stack_experts(w, &p, n, "switch_mlp", &projs)?;
    }
    Ok(())
}

/// The MoE of the config (None without `n_routed_experts`), its top-k checked; `norm_topk_prob`
/// `norm_default` when absent (false in mlx-lm's glm4_moe, true in its deepseek_v3).
pub fn moe(c: &Cfg, norm_default: bool) -> Result<Option<FfnKind>> {
    if c.get("n_routed_experts").is_none() {
        return Ok(None);
    }
    let experts = c.size("n_routed_experts", None, limits::EXPERTS)?;
    let top_k = c.size("num_experts_per_tok", None, limits::EXPERTS)?;
    if top_k > experts {
        return Err(Error::ModelLoad(format!(
            "config.json: num_experts_per_tok {top_k} exceeds n_routed_experts {experts}"
        )));
    }
    let shared = match c.get("n_shared_experts") {
        None => 0,
        Some(_) => c.size("n_shared_experts", None, limits::EXPERTS)?,
    };
    Ok(Some(FfnKind::Moe {
        experts,
        top_k,
        intermediate: c.size("moe_intermediate_size", None, limits::INTERMEDIATE)?,
        shared,
        norm_topk_prob: c.b_or("norm_topk_prob", norm_default),
    }))
}

/// Full attention; dense FFNs in the first `first_k_dense_replace` layers, the MoE after.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let c = Cfg(config);
    let moe = moe(&c, false)?;
    let first_dense = c.opt_i("first_k_dense_replace").unwrap_or(0);
    arch::uniform(
        config,
        DimDefaults::default(),
        |_| AttnKind::Full,
        |i, d| match moe {
            Some(m) if i >= first_dense => Ok(m),
            _ => arch::dense(i, d),
        },
    )
}

/// The `noaux_tc` grouped sigmoid router of the config (glm4_moe's and deepseek_v3's, `arch` in the
/// error): `scoring_func` / `topk_method` checked, `n_group`, `topk_group`,
/// `routed_scaling_factor` (their fit to the expert count is checked when the MoE loads).
pub fn grouped_router(c: &Cfg, arch: &str) -> Result<Router> {
    for (k, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
        if let Some(v) = c.get(k) {
            if v.as_str() != Some(want) {
                return Err(Error::Unsupported(format!(
                    "config.json: {k} {v} (mlx-lm's {arch} supports {want:?} only)"
                )));
            }
        }
    }
    let n_group = c.size("n_group", Some(1), limits::EXPERTS)?;
    let topk_group = c.size("topk_group", Some(1), limits::EXPERTS)?;
    let scaling = c.f_or("routed_scaling_factor", 1.0) as f32;
    Ok(Router::GroupedSigmoid { n_group, topk_group, scaling })
}

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    let c = Cfg(config);
    let router = grouped_router(&c, "glm4_moe")?;
    let head_dim = super::Dims::from_config(&c, DimDefaults::default())?.head_dim;
    let factor = c.f_or("partial_rotary_factor", 1.0);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(Error::ModelLoad(format!("config.json: partial_rotary_factor {factor} is not in (0, 1]")));
    }
    let extra = Extra {
        ffn_name: "mlp",
        moe: MoeSpec { router, ..MoeSpec::QWEN3 },
        rope_dims: Some((head_dim as f64 * factor) as i32),
        tie: Some(false),
        sinks: false,
    };
    let v = Variant {
        qkv_bias: c.b_or("attention_bias", false),
        o_bias: false,
        qk_norm: c.b_or("use_qk_norm", false),
        rope_scaling: false,
    };
    Model::load_extra(config, w, v, false, layout(config)?, &extra)
}
