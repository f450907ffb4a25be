//! gpt-oss (mlx-lm's `models/gpt_oss.py`): the Llama decoder with biases on every attention
//! projection, per-head attention sinks, sliding-window and full layers alternating (`layer_types`,
//! else sliding first), and in every layer a MoE: the router's (biased) top k logits, a softmax
//! over them, experts with biases and gpt-oss's clamped SwiGLU ([`ExpertAct::SwigluOai`]). The
//! LM head is never tied. bf16/fp32 checkpoints load, MLX-quantized ones in any mode (mlx-lm's
//! affine or mxfp4), and the released ones with MXFP4 experts in Hugging Face's `*_blocks` layout
//! (see [`sanitize`]).
use super::arch::{self, Arch, AttnKind, FfnKind, LayerLayout};
use super::layers::{ExpertAct, MoeSpec, Router};
use super::llama::{Extra, Model, Variant};
use super::{limits, Cfg, DimDefaults};
use crate::error::{Error, Result};
use crate::handle as mx;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "gpt_oss",
    model_types: &["gpt_oss"],
    sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: None,
};

/// The config with mlx-lm's `ModelArgs` defaults for the fields it may leave out.
fn args(config: &Value) -> Value {
    super::with_defaults(
        config,
        &[],
        &[
            ("num_local_experts", Value::from(128)),
            ("num_experts_per_tok", Value::from(4)),
            ("rms_norm_eps", Value::from(1e-5)),
            ("head_dim", Value::from(64)),
            ("sliding_window", Value::from(128)),
            ("rope_theta", Value::from(150000)),
        ],
    )
}

/// mlx-lm's sanitize for the Hugging Face layout: the experts' interleaved `gate_up_proj` (and
/// its bias) split into `gate_proj` (even rows) and `up_proj` (odd rows); `down_proj_bias` renamed.
/// The released checkpoints' MXFP4 experts (`*_blocks` uint8 `[experts, rows, groups, 16]`, two
/// e2m1 values a byte, and `*_scales` uint8 `[experts, rows, groups]`) become MLX's mxfp4 layout:
/// the blocks viewed as uint32 `[experts, rows, groups × 4]`, split the same way (their config's
/// `quantization_config.quant_method` "mxfp4" gives the mode). A checkpoint already in mlx-lm's
/// layout is left alone.
pub fn sanitize(_config: &Value, w: &mut Weights) -> Result<()> {
    if w.keys().any(|k| k.contains("gate_proj.weight")) {
        return Ok(());
    }
    let keys: Vec<String> = w.keys().cloned().collect();
    for k in keys {
        if k.contains("gate_up_proj_bias") {
            let v = w.take(&k)?;
            let (g, u) = split_interleaved(&v, -1)?;
            w.insert(k.replace("gate_up_proj_bias", "gate_proj.bias"), g);
            w.insert(k.replace("gate_up_proj_bias", "up_proj.bias"), u);
        } else if k.contains("gate_up_proj") {
            let v = mxfp4_blocks(&k, w.take(&k)?)?;
            let (g, u) = split_interleaved(&v, -2)?;
            let k = k.replace("_blocks", ".weight").replace("_scales", ".scales");
            w.insert(k.replace("gate_up_proj", "gate_proj"), g);
            w.insert(k.replace("gate_up_proj", "up_proj"), u);
        } else if k.contains("down_proj_bias") {
            let v = w.take(&k)?;
            w.insert(k.replace("down_proj_bias", "down_proj.bias"), v);
        } else if k.contains("down_proj_blocks") || k.contains("down_proj_scales") {
            let v = mxfp4_blocks(&k, w.take(&k)?)?;
            w.insert(k.replace("_blocks", ".weight").replace("_scales", ".scales"), v);
        }
    }
    Ok(())
}

/// A `*_blocks` tensor (uint8 `[.., groups, 16]`) as MLX's packed mxfp4 weight (uint32 `[..,
/// groups × 4]`, the same bytes); any other tensor as it is.
fn mxfp4_blocks(name: &str, v: mx::Array) -> Result<mx::Array> {
    if !name.ends_with("_blocks") {
        return Ok(v);
    }
    let shape = v.shape();
    if v.dtype() != mx::Dtype::Uint8 || shape.len() < 2 || shape[shape.len() - 1] != 16 {
        return Err(Error::ModelLoad(format!(
            "weight {name} is {} {shape:?}: MXFP4 blocks are uint8 [.., groups, 16] (32 e2m1 values per group)",
            v.dtype().name()
        )));
    }
    let words = mx::view(&v, mx::Dtype::Uint32)?;
    let mut to = shape[..shape.len() - 2].to_vec();
    to.push(shape[shape.len() - 2] * 4);
    mx::reshape(&words, &to)
}

/// The even and odd entries of `v` along `axis` (`v[..., ::2, :]` and `v[..., 1::2, :]`).
fn split_interleaved(v: &mx::Array, axis: i32) -> Result<(mx::Array, mx::Array)> {
    let ax = if axis < 0 { v.ndim() as i32 + axis } else { axis };
    let n = v.dim(ax);
    if n % 2 != 0 {
        return Err(Error::ModelLoad(format!("gate_up_proj has an odd {n} rows: not interleaved gate/up")));
    }
    let mut shape = v.shape();
    shape[ax as usize] = n / 2;
    shape.insert(ax as usize + 1, 2);
    let pairs = mx::reshape(v, &shape)?;
    let g = mx::contiguous(&mx::squeeze(&mx::slice_axis(&pairs, ax + 1, 0, 1)?, &[ax + 1])?)?;
    let u = mx::contiguous(&mx::squeeze(&mx::slice_axis(&pairs, ax + 1, 1, 2)?, &[ax + 1])?)?;
    Ok((g, u))
}

/// The layers `layer_types` marks `sliding_attention` attend over the last `sliding_window`
/// positions, the others over all (no `layer_types`: sliding, full, sliding, ...); a MoE in every
/// layer.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let config = &args(config);
    let c = Cfg(config);
    let n = c.size("num_hidden_layers", None, limits::LAYERS)?;
    let types: Vec<String> = match c.get("layer_types").and_then(Value::as_array) {
        Some(a) => a.iter().map(|t| t.as_str().unwrap_or("").to_string()).collect(),
        None => (0..n).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }.to_string()).collect(),
    };
    if types.len() != n as usize {
        return Err(Error::ModelLoad(format!(
            "config.json: layer_types has {} entries for num_hidden_layers {n}",
            types.len()
        )));
    }
    if let Some(t) = types.iter().find(|t| !matches!(t.as_str(), "sliding_attention" | "full_attention")) {
        return Err(Error::ModelLoad(format!(
            "config.json: layer_types entry {t:?} is not sliding_attention or full_attention"
        )));
    }
    // mlx-lm takes the masks from the first layer of each kind: both must be there
    for want in ["sliding_attention", "full_attention"] {
        if !types.iter().any(|t| t == want) {
            return Err(Error::ModelLoad(format!(
                "config.json: layer_types has no {want} layer (mlx-lm's gpt_oss needs both kinds)"
            )));
        }
    }
    let window = c.size("sliding_window", None, limits::POSITIONS)?;
    let moe = FfnKind::Moe {
        experts: c.size("num_local_experts", None, limits::EXPERTS)?,
        top_k: c.size("num_experts_per_tok", None, limits::EXPERTS)?,
        intermediate: c.size("intermediate_size", None, limits::INTERMEDIATE)?,
        shared: 0,
        norm_topk_prob: true,
    };
    if let FfnKind::Moe { experts, top_k, .. } = moe {
        if top_k > experts {
            return Err(Error::ModelLoad(format!(
                "config.json: num_experts_per_tok {top_k} exceeds num_local_experts {experts}"
            )));
        }
    }
    arch::uniform(
        config,
        DimDefaults::default(),
        |i| if types[i as usize] == "sliding_attention" { AttnKind::Sliding { window } } else { AttnKind::Full },
        |_, _| Ok(moe),
    )
}

pub const EXTRA: Extra = Extra {
    ffn_name: "mlp",
    moe: MoeSpec {
        router: Router::TopKSoftmaxTail,
        router_name: "router",
        router_bias: true,
        experts_name: "experts",
        expert_bias: true,
        act: ExpertAct::SwigluOai,
    },
    rope_dims: None,
    tie: Some(false),
    sinks: true,
};

pub fn load(config: &Value, w: Weights) -> Result<Model> {
    let config = &args(config);
    let v = Variant { qkv_bias: true, o_bias: true, qk_norm: false, rope_scaling: true };
    Model::load_extra(config, w, v, false, layout(config)?, &EXTRA)
}
