//! Mistral Small 4 (mlx-lm's `models/mistral4.py`): deepseek_v3's decoder ([`super::deepseek_v3`]:
//! multi-head latent attention over a compressed latent cache, dense MLPs in the first
//! `first_k_dense_replace` layers, then a MoE with shared experts) with, where mlx-lm's
//! `Mistral4Attention` and `Mistral4MoE` differ:
//! - the rotary parameters in `rope_parameters` (its `rope_theta`, mlx-lm's default 100000 when it
//!   has none; itself the rope scaling and the YaRN softmax scale, none for a `default` rope), the
//!   rope interleaved unless `rope_interleave` is false;
//! - Llama 4's position-dependent query scale ([`MlaVariant::llama4_scale`], from
//!   `rope_parameters.llama_4_scaling_beta` and `.original_max_position_embeddings`, both required
//!   as in mlx-lm) on both query parts after the rope;
//! - a prefill attending over per-head keys with the rope part concatenated
//!   ([`MlaVariant::concat_prefill`]); a decode step over the latent as deepseek_v3's;
//! - a softmax router over `n_group` groups without a score bias ([`Router::GroupedSoftmax`]);
//! - `tie_word_embeddings` honoured; no multi-token-prediction layers dropped.
//!
//! Checkpoints: Hugging Face's per-expert `mlp.experts.{e}.*` and fused `mlp.experts.gate_up_proj`
//! / `mlp.experts.down_proj` layouts are both stacked into `switch_mlp` (mlx-lm's sanitize);
//! Mistral's FP8 checkpoints (`*_scale_inv`: per 128×128 block, per tensor or per expert) are
//! dequantized to bfloat16 at load as mlx-lm does ([`crate::weights::dequantize_fp8`]);
//! compressed-tensors int4 checkpoints are refused (convert them with mlx-lm first).
use super::arch::{self, Arch, LayerLayout};
use super::deepseek_v3::{self, MlaDims, MlaVariant};
use super::layers::Router;
use super::{limits, Cfg};
use crate::error::{Error, Result};
use crate::handle as mx;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "mistral4",
    model_types: &["mistral4"],
    sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: None,
};

/// The config as deepseek_v3's loader reads it (mlx-lm's `__post_init__`): `rope_theta` from
/// `rope_parameters` (100000 without one there) and `rope_parameters` as the `rope_scaling`, its
/// `mscale_all_dim` dropped for a `default` rope (mlx-lm's `apply_yarn_mscale` ignores it there).
/// Also the Llama 4 query scale's `(beta, original_max_position_embeddings)`.
fn remap(config: &Value) -> Result<(Value, (f64, f64))> {
    let rp = super::ministral3::RopeParameters::of(config, "mistral4")?;
    let (params, llama4) = (rp.params, rp.llama4);
    let theta = match params.get("rope_theta") {
        None => 100000.0,
        Some(_) => rp.num("rope_theta", true)?,
    };
    let mut scaling = params.clone();
    let ty = params.get("type").or_else(|| params.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
    if ty == "default" {
        if let Some(o) = scaling.as_object_mut() {
            o.remove("mscale_all_dim");
        }
    }
    let mut c = config.clone();
    c["rope_theta"] = theta.into();
    c["rope_scaling"] = scaling;
    Ok((c, llama4))
}

/// mlx-lm's sanitize: the fused `mlp.experts.gate_up_proj` `[experts, 2 × width, hidden]` split
/// into `switch_mlp.gate_proj` / `up_proj` and `mlp.experts.down_proj` renamed, per-expert
/// tensors stacked; `kv_b_proj` split into `embed_q` / `unembed_out` as deepseek_v3's; rotary
/// buffers dropped.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let c = Cfg(config);
    let layers = c.size("num_hidden_layers", None, limits::LAYERS)?;
    if let Some(k) = w.keys().find(|k| k.ends_with("weight_packed") || k.ends_with("weight_shape")).cloned() {
        return Err(Error::Unsupported(format!(
            "weight {k}: a compressed-tensors checkpoint (convert it with mlx_lm.convert first)"
        )));
    }
    w.retain(|k| !k.contains("rotary_emb.inv_freq"));
    crate::weights::dequantize_fp8(config, w)?;
    let d = MlaDims::from_config(&c)?;
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        let gate_up = format!("{p}.experts.gate_up_proj");
        if w.contains(&gate_up) {
            let t = w.take(&gate_up)?;
            if t.ndim() != 3 || t.dim(1) % 2 != 0 {
                return Err(Error::ModelLoad(format!(
                    "weight {gate_up} has shape {:?}, not [experts, 2 × width, hidden]",
                    t.shape()
                )));
            }
            let mut halves = mx::split(&t, 2, 1)?.into_iter();
            let (Some(gate), Some(up)) = (halves.next(), halves.next()) else {
                return Err(Error::Mlx(format!("{gate_up}: split in two gave fewer parts")));
            };
            w.insert(format!("{p}.switch_mlp.gate_proj.weight"), gate);
            w.insert(format!("{p}.switch_mlp.up_proj.weight"), up);
        }
        let down = format!("{p}.experts.down_proj");
        if w.contains(&down) {
            let t = w.take(&down)?;
            w.insert(format!("{p}.switch_mlp.down_proj.weight"), t);
        }
        if w.contains(&format!("{p}.experts.0.gate_proj.weight")) {
            let n = c.size("n_routed_experts", None, limits::EXPERTS)?;
            let projs = [("gate_proj", "gate_proj"), ("down_proj", "down_proj"), ("up_proj", "up_proj")];
            arch::stack_experts(w, &p, n, "switch_mlp", &projs)?;
        }
        deepseek_v3::split_kv_b(w, &format!("model.layers.{l}.self_attn"), &d)?;
    }
    Ok(())
}

/// Latent attention everywhere; dense FFNs (`intermediate_size`) in the first
/// `first_k_dense_replace` layers, the MoE after (every layer from there: no `moe_layer_freq`).
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    deepseek_v3::mla_layout(&Cfg(config), 1, None)
}

/// The softmax grouped router of the config: `n_group`, `topk_group`, `routed_scaling_factor`
/// (their fit to the expert count is checked when the MoE loads).
fn router(c: &Cfg) -> Result<Router> {
    Ok(Router::GroupedSoftmax {
        n_group: c.size("n_group", Some(1), limits::EXPERTS)?,
        topk_group: c.size("topk_group", Some(1), limits::EXPERTS)?,
        scaling: c.f_or("routed_scaling_factor", 1.0) as f32,
    })
}

pub fn load(config: &Value, w: Weights) -> Result<deepseek_v3::Model> {
    let (c, llama4) = remap(config)?;
    let cfg = Cfg(&c);
    let variant =
        MlaVariant { interleave: cfg.b_or("rope_interleave", true), llama4_scale: Some(llama4), concat_prefill: true };
    let tie = cfg.b_or("tie_word_embeddings", false);
    deepseek_v3::Model::load_variant(&c, w, router(&cfg)?, None, variant, layout(&c)?, tie)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::arch::{AttnKind, FfnKind};
    use serde_json::json;

    fn config() -> Value {
        json!({"model_type": "mistral4", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 4, "vocab_size": 512, "intermediate_size": 512, "kv_lora_rank": 128,
               "q_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
               "first_k_dense_replace": 1, "moe_layer_freq": 2, "norm_topk_prob": true,
               "rope_parameters": {"rope_type": "default", "llama_4_scaling_beta": 0.1,
                                   "original_max_position_embeddings": 32}})
    }

    /// Every layer caches one latent and one rope key; the MoE from first_k_dense_replace on in
    /// every layer (mlx-lm's mistral4 reads no moe_layer_freq).
    #[test]
    fn layout_is_latent_and_moe_after_the_dense_layers() {
        let l = layout(&config()).unwrap();
        assert!(l.iter().all(|l| l.attn == AttnKind::Latent { rank: 128, rope_dims: 32, index_dims: 0 }));
        let moe = FfnKind::Moe { experts: 8, top_k: 2, intermediate: 128, shared: 1, norm_topk_prob: true };
        assert_eq!(l.iter().map(|l| l.ffn).collect::<Vec<_>>(), [FfnKind::Dense { intermediate: 512 }, moe, moe]);
        assert_eq!(arch::find("mistral4").map(|a| a.name), Some("mistral4"));
    }

    #[test]
    fn remap_reads_rope_parameters_and_refuses_what_mlx_lm_needs() {
        let (c, l4) = remap(&config()).unwrap();
        assert_eq!(l4, (0.1, 32.0));
        assert_eq!(c["rope_theta"], json!(100000.0)); // mlx-lm's default when rope_parameters has none
        let mut y = config();
        y["rope_parameters"] = json!({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0, "rope_theta": 5000.0,
                                      "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 32});
        let (c, _) = remap(&y).unwrap();
        assert_eq!((c["rope_theta"].as_f64(), c["rope_scaling"]["mscale_all_dim"].as_f64()), (Some(5000.0), Some(1.0)));
        y["rope_parameters"]["rope_type"] = json!("default");
        assert!(remap(&y).unwrap().0["rope_scaling"].get("mscale_all_dim").is_none());
        for (k, v, err) in [
            ("llama_4_scaling_beta", Value::Null, "rope_parameters.llama_4_scaling_beta is missing"),
            (
                "original_max_position_embeddings",
                json!(0),
                "rope_parameters.original_max_position_embeddings is missing or not a positive",
            ),
        ] {
            let mut b = config();
            b["rope_parameters"][k] = v;
            assert!(remap(&b).unwrap_err().to_string().contains(err), "{k}");
        }
        let mut b = config();
        b.as_object_mut().unwrap().remove("rope_parameters");
        assert!(remap(&b).unwrap_err().to_string().contains("rope_parameters is missing"));
    }
}
