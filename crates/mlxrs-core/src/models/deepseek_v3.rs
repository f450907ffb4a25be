//! DeepSeek-V3 (mlx-lm's `models/deepseek_v3.py`): multi-head latent attention (MLA) and a MoE
//! with glm4_moe's grouped sigmoid router ([`Router::GroupedSigmoid`]) and shared experts.
//!
//! MLA: queries through a low-rank `q_a_proj` → RMSNorm → `q_b_proj` (`q_lora_rank`; a plain
//! `q_proj` without it), each head's `qk_nope_head_dim` + `qk_rope_head_dim` dims split; keys and
//! values from one compressed latent of `kv_lora_rank` dims (`kv_a_proj_with_mqa` → RMSNorm) plus
//! one rotary key of `qk_rope_head_dim` dims shared by all heads. The cache holds exactly what
//! mlx-lm's does: per token the normed latent (as the "keys", `[B, 1, T, kv_lora_rank]`) and the
//! rotated key (as the "values", `[B, 1, T, qk_rope_head_dim]`) — the compressed KV cache
//! ([`AttnKind::Latent`] counts its bytes). The checkpoint's `kv_b_proj` is split at load (as
//! mlx-lm's sanitize does) into `embed_q` (latent → per-head nope keys, `[heads, kv_lora_rank,
//! qk_nope_head_dim]`) and `unembed_out` (latent → per-head values, `[heads, v_head_dim,
//! kv_lora_rank]`). A prefill expands the latent into per-head keys and values; a decode step
//! instead folds `embed_q` into the query and `unembed_out` into the output, attending over the
//! latent itself. The rope part enters every score as an additive mask. The rotary embedding is
//! traditional (interleaved), YaRN's `mscale_all_dim` squared into the softmax scale.
use super::arch::{self, Arch, AttnKind, FfnKind, LayerLayout};
use super::layers::{Embedding, Ffn, Linear, MoeSpec, RmsNorm, Rope};
use super::{limits, CausalLm, Cfg, ModelShape};
use crate::cache::{causal_mask, Caches, Fetched, LayerCache, LayerCaches, Mask, Masks};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, AttnMask};
use crate::weights::{Matrix, QuantSpec, Weights};
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "deepseek_v3",
    model_types: &["deepseek_v3"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w)?)),
    layout,
    gguf: None,
};

/// The MLA geometry of a config, every field checked.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub hidden: i32,
    pub heads: i32,
    pub q_lora_rank: Option<i32>,
    pub kv_lora_rank: i32,
    pub nope: i32,
    pub rope: i32,
    pub v_head: i32,
}

impl MlaDims {
    pub fn from_config(c: &Cfg) -> Result<MlaDims> {
        use limits::*;
        let rope = c.size("qk_rope_head_dim", Some(64), HEAD_DIM)?;
        if rope % 2 != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: qk_rope_head_dim {rope} is odd (the rotary embedding rotates pairs)"
            )));
        }
        Ok(MlaDims {
            hidden: c.size("hidden_size", Some(4096), HIDDEN)?,
            heads: c.size("num_attention_heads", Some(32), HEADS)?,
            q_lora_rank: match c.get("q_lora_rank") {
                None if c.0.get("q_lora_rank").is_some() => None, // an explicit null: a plain q_proj
                None => Some(1536),
                Some(_) => Some(c.size("q_lora_rank", None, HIDDEN)?),
            },
            kv_lora_rank: c.size("kv_lora_rank", Some(512), HIDDEN)?,
            nope: c.size("qk_nope_head_dim", Some(128), HEAD_DIM)?,
            rope,
            v_head: c.size("v_head_dim", Some(128), HEAD_DIM)?,
        })
    }
}

/// mlx-lm's sanitize: per-expert `mlp.experts.{e}.{gate,down,up}_proj` stacked into
/// `mlp.switch_mlp.*`; `self_attn.kv_b_proj` split into `embed_q` / `unembed_out` (through its
/// dequantized values when quantized, re-quantized with its bits and group size); the
/// multi-token-prediction layers (`model.layers.{num_hidden_layers}` on) and rotary buffers dropped.
/// DeepSeek's own FP8 checkpoints (`quant_method: fp8`, `weight_scale_inv` per 128×128 block) are
/// dequantized to bfloat16 first, as mlx-lm does ([`crate::weights::dequantize_fp8`]);
/// compressed-tensors int4 checkpoints are refused: convert them with mlx-lm first.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let c = Cfg(config);
    let layers = c.size("num_hidden_layers", None, limits::LAYERS)?;
    if let Some(k) = w.keys().find(|k| k.ends_with("weight_packed")).cloned() {
        return Err(Error::Unsupported(format!(
            "weight {k}: a compressed-tensors checkpoint (convert it with mlx_lm.convert first)"
        )));
    }
    w.retain(|k| {
        let mtp = k
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<i32>().ok())
            .is_some_and(|i| i >= layers);
        !mtp && !k.contains("rotary_emb.inv_freq")
    });
    crate::weights::dequantize_fp8(config, w)?;
    let d = MlaDims::from_config(&c)?;
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        if w.contains(&format!("{p}.experts.0.gate_proj.weight")) {
            let n = c.size("n_routed_experts", None, limits::EXPERTS)?;
            let projs = [("gate_proj", "gate_proj"), ("down_proj", "down_proj"), ("up_proj", "up_proj")];
            arch::stack_experts(w, &p, n, "switch_mlp", &projs)?;
        }
        split_kv_b(w, &format!("model.layers.{l}.self_attn"), &d)?;
    }
    Ok(())
}

/// `{p}.kv_b_proj` `[heads * (nope + v_head), kv_lora_rank]` into `{p}.embed_q` (`[heads,
/// kv_lora_rank, nope]`) and `{p}.unembed_out` (`[heads, v_head, kv_lora_rank]`), as mlx-lm does.
pub(crate) fn split_kv_b(w: &mut Weights, p: &str, d: &MlaDims) -> Result<()> {
    let name = format!("{p}.kv_b_proj.weight");
    if !w.contains(&name) {
        return Ok(());
    }
    let mut v = w.take(&name)?;
    let quant = if w.contains(&format!("{p}.kv_b_proj.scales")) {
        let scales = w.take(&format!("{p}.kv_b_proj.scales"))?;
        let biases = w.remove(&format!("{p}.kv_b_proj.biases"));
        let (cols, groups) = (v.dim(-1), scales.dim(-1));
        // mlx-lm infers bits and group size from the packed shapes, and re-quantizes affine only
        if !scales.dtype().is_float() {
            return Err(Error::Unsupported(format!(
                "weight {name}: kv_b_proj quantized in a microscaling mode ({} scales) is not supported (mlx-lm's \
                 sanitize splits and re-quantizes it affine only); convert the model from its unquantized weights",
                scales.dtype().name()
            )));
        }
        let bits = cols * 32 / d.kv_lora_rank;
        if groups == 0 || d.kv_lora_rank % groups != 0 || !(2..=8).contains(&bits) {
            return Err(Error::ModelLoad(format!(
                "weight {name}: its shape {:?} does not fit kv_lora_rank {}",
                v.shape(),
                d.kv_lora_rank
            )));
        }
        let q = QuantSpec::affine(d.kv_lora_rank / groups, bits);
        v = mx::dequantize(&v, &scales, biases.as_ref(), q.group_size, q.bits, q.mode)?;
        Some(q)
    } else {
        None
    };
    let head = d.nope + d.v_head;
    if v.shape() != [d.heads * head, d.kv_lora_rank] {
        return Err(Error::ModelLoad(format!(
            "weight {name} has shape {:?} but config.json implies [{}, {}] (num_attention_heads × (qk_nope_head_dim + v_head_dim), kv_lora_rank)",
            v.shape(),
            d.heads * head,
            d.kv_lora_rank
        )));
    }
    let v = mx::reshape(&v, &[d.heads, head, d.kv_lora_rank])?;
    let wk = mx::contiguous(&mx::swapaxes(&mx::slice_axis(&v, 1, 0, d.nope)?, -1, -2)?)?;
    let wv = mx::contiguous(&mx::slice_axis(&v, 1, d.nope, head)?)?;
    for (to, m) in [("embed_q", wk), ("unembed_out", wv)] {
        match quant {
            Some(q) => {
                let (qw, s, b) = mx::quantize(&m, q.group_size, q.bits)?;
                w.insert(format!("{p}.{to}.weight"), qw);
                w.insert(format!("{p}.{to}.scales"), s);
                w.insert(format!("{p}.{to}.biases"), b);
            }
            None => w.insert(format!("{p}.{to}.weight"), m),
        }
    }
    Ok(())
}

/// Latent attention everywhere; dense FFNs in the first `first_k_dense_replace` layers and off
/// the `moe_layer_freq` grid, the MoE elsewhere.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let c = Cfg(config);
    let freq = c.size("moe_layer_freq", Some(1), limits::LAYERS)?;
    mla_layout(&c, freq, Some(11008))
}

/// The layer layout of a latent-attention MoE (deepseek_v3's, mistral4's): dense FFNs
/// (`intermediate_size`, default `inter_default`) in the first `first_k_dense_replace` layers and
/// off the every-`freq`-layers grid, the MoE elsewhere.
pub fn mla_layout(c: &Cfg, freq: i32, inter_default: Option<i64>) -> Result<Vec<LayerLayout>> {
    let d = MlaDims::from_config(c)?;
    let layers = c.size("num_hidden_layers", None, limits::LAYERS)?;
    let moe = super::glm4_moe::moe(c, true)?;
    let first_dense = c.opt_i("first_k_dense_replace").unwrap_or(0);
    let inter = c.size("intermediate_size", inter_default, limits::INTERMEDIATE)?;
    let attn = AttnKind::Latent { rank: d.kv_lora_rank, rope_dims: d.rope, index_dims: 0 };
    Ok((0..layers)
        .map(|i| LayerLayout {
            attn,
            kv_heads: 1,
            head_dim: d.kv_lora_rank,
            ffn: match moe {
                Some(m) if i >= first_dense && i % freq == 0 => m,
                _ => FfnKind::Dense { intermediate: inter },
            },
        })
        .collect())
}

/// mlx-lm's `MultiLinear`: one `[out, in]` matrix per head, `[heads, out, in]`, dense or quantized.
enum MultiLinear {
    Dense(Array),
    Quant { w: Array, scales: Array, biases: Option<Array>, q: QuantSpec },
}

impl MultiLinear {
    fn load(ws: &mut Weights, prefix: &str, heads: i32, out: i32, inp: i32) -> Result<MultiLinear> {
        Ok(match ws.take_experts(prefix, heads, out, inp)? {
            Matrix::Dense(w) => MultiLinear::Dense(w),
            Matrix::Quant { w, scales, biases, q } => MultiLinear::Quant { w, scales, biases, q },
        })
    }

    /// `x @ W^T` (`transpose`) or `x @ W`, per head.
    fn forward(&self, x: &Array, transpose: bool) -> Result<Array> {
        match self {
            MultiLinear::Dense(w) if transpose => mx::matmul(x, &mx::swapaxes(w, -1, -2)?),
            MultiLinear::Dense(w) => mx::matmul(x, w),
            MultiLinear::Quant { w, scales, biases, q } => {
                mx::quantized_matmul(x, w, scales, biases.as_ref(), transpose, q.group_size, q.bits, q.mode)
            }
        }
    }
}

/// Where a latent-attention layer departs from deepseek_v3's (mistral4's `Mistral4Attention`).
#[derive(Clone, Copy, Debug)]
pub struct MlaVariant {
    /// The rotary embedding interleaved (mlx-lm's `traditional`).
    pub interleave: bool,
    /// Llama 4's position-dependent query scale (mistral4), `(beta, original_max_position_embeddings)`:
    /// both query parts times `1 + beta * ln(1 + floor(position / original_max))` after the rope.
    pub llama4_scale: Option<(f64, f64)>,
    /// A prefill attends over the expanded keys with the rope part concatenated to each head's
    /// (mistral4), not added as a mask (deepseek_v3).
    pub concat_prefill: bool,
}

impl MlaVariant {
    pub const DEEPSEEK: MlaVariant = MlaVariant { interleave: true, llama4_scale: None, concat_prefill: false };
}

/// mlx-lm's `_get_llama_4_attn_scale` at `offsets` (one per row, `[B, 1, 1, 1]`... when several)
/// for `l` positions each: `1 + beta * log(1 + floor((arange(l) + offset) / original_max))` in
/// float32, then `dtype`; shaped `[rows, 1, l, 1]` to scale queries `[B, H, L, D]`.
pub(crate) fn llama4_scale(offsets: &[i32], l: i32, (beta, max): (f64, f64), dtype: mx::Dtype) -> Result<Array> {
    let pos: Vec<i32> = offsets.iter().flat_map(|&o| (0..l).map(move |i| o + i)).collect();
    let pos = mx::astype(&Array::from_slice(&pos, &[offsets.len() as i32, 1, l, 1])?, mx::Dtype::Float32)?;
    let f32s = |v: f64| mx::scalar_as(v, mx::Dtype::Float32);
    let fl = mx::floor(&mx::divide(&pos, &f32s(max)?)?)?;
    let s = mx::add(&f32s(1.0)?, &mx::multiply(&f32s(beta)?, &mx::log(&mx::add(&f32s(1.0)?, &fl)?)?)?)?;
    mx::astype(&s, dtype)
}

enum QProj {
    Full(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// Multi-head latent attention (mlx-lm's `DeepseekV3Attention`) over a cache of latents.
pub struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_norm: RmsNorm,
    embed_q: MultiLinear,
    unembed_out: MultiLinear,
    o_proj: Linear,
    d: MlaDims,
    scale: f32,
    rope: Rope,
    /// deepseek_v32's sparse-attention indexer (its keys cached after the latent).
    indexer: Option<super::deepseek_v32::Indexer>,
    variant: MlaVariant,
}

impl Mla {
    /// `indexer`: Some(whether its rope is interleaved) for deepseek_v32's indexer.
    fn load(w: &mut Weights, p: &str, c: &Cfg, d: MlaDims, indexer: Option<bool>, variant: MlaVariant) -> Result<Mla> {
        let bias = c.b_or("attention_bias", false);
        let qk = d.nope + d.rope;
        let q = match d.q_lora_rank {
            None => QProj::Full(Linear::load(w, &format!("{p}.q_proj"), false, d.heads * qk, d.hidden)?),
            Some(r) => QProj::LowRank {
                a: Linear::load(w, &format!("{p}.q_a_proj"), bias, r, d.hidden)?,
                norm: RmsNorm::load(w, &format!("{p}.q_a_layernorm"), 1e-6, r)?,
                b: Linear::load(w, &format!("{p}.q_b_proj"), false, d.heads * qk, r)?,
            },
        };
        let mut scale = (qk as f32).powf(-0.5);
        let scaling = c.get("rope_scaling");
        if let Some(s) = scaling {
            let mscale_all = s.get("mscale_all_dim").and_then(Value::as_f64).unwrap_or(0.0);
            let factor = s.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
            if mscale_all != 0.0 && factor > 1.0 {
                let m = (0.1 * mscale_all * factor.ln() + 1.0) as f32;
                scale = scale * m * m;
            }
        }
        Ok(Mla {
            q,
            kv_a: Linear::load(w, &format!("{p}.kv_a_proj_with_mqa"), bias, d.kv_lora_rank + d.rope, d.hidden)?,
            kv_norm: RmsNorm::load(w, &format!("{p}.kv_a_layernorm"), 1e-6, d.kv_lora_rank)?,
            embed_q: MultiLinear::load(w, &format!("{p}.embed_q"), d.heads, d.kv_lora_rank, d.nope)?,
            unembed_out: MultiLinear::load(w, &format!("{p}.unembed_out"), d.heads, d.v_head, d.kv_lora_rank)?,
            o_proj: Linear::load(w, &format!("{p}.o_proj"), bias, d.hidden, d.heads * d.v_head)?,
            d,
            scale,
            rope: Rope::from_config(d.rope, c.f_or("rope_theta", 10000.0) as f32, variant.interleave, scaling)?,
            indexer: match indexer {
                Some(interleave) => Some(super::deepseek_v32::Indexer::load(w, p, c, &d, interleave)?),
                None => None,
            },
            variant,
        })
    }

    /// Every projection of `x` `[B, L, hidden]` (nothing rotated yet), for all rows at once.
    fn project(&self, x: &Array) -> Result<Proj> {
        let (b, l) = (x.dim(0), x.dim(1));
        let d = &self.d;
        let (q, qr) = match &self.q {
            QProj::Full(p) => (p.forward(x)?, None),
            QProj::LowRank { a, norm, b } => {
                let qr = norm.forward(&a.forward(x)?)?;
                (b.forward(&qr)?, Some(qr))
            }
        };
        let q = mx::transpose_axes(&mx::reshape(&q, &[b, l, d.heads, d.nope + d.rope])?, &[0, 2, 1, 3])?;
        let kv = self.kv_a.forward(x)?;
        let latent = mx::slice_axis(&kv, 2, 0, d.kv_lora_rank)?;
        let k_pe = mx::slice_axis(&kv, 2, d.kv_lora_rank, d.kv_lora_rank + d.rope)?;
        let index = match (&self.indexer, &qr) {
            (Some(ix), Some(qr)) => Some([ix.query(qr)?, ix.key(x)?, ix.weights(x)?]),
            _ => None,
        };
        Ok(Proj {
            q_nope: mx::slice_axis(&q, 3, 0, d.nope)?,
            q_pe: mx::slice_axis(&q, 3, d.nope, d.nope + d.rope)?,
            latent: mx::expand_dims(&self.kv_norm.forward(&latent)?, 1)?,
            k_pe: mx::transpose_axes(&mx::reshape(&k_pe, &[b, l, 1, d.rope])?, &[0, 2, 1, 3])?,
            index,
        })
    }

    /// Attention of rotated queries over the cached latents and rope keys: `[B, L, heads *
    /// v_head_dim]` (before `o_proj`). `mask` (boolean, broadcast against the scores) hides keys,
    /// as mlx-lm's `where` does; `causal`: no mask array, but a causal prefill (mlx-lm's "causal",
    /// which only [`MlaVariant::concat_prefill`] reads: the others are given the array).
    fn attend(
        &self,
        q_nope: &Array,
        q_pe: &Array,
        latent: &Array,
        k_pe: &Array,
        mask: Option<&Array>,
        causal: bool,
    ) -> Result<Array> {
        let (b, l) = (q_nope.dim(0), q_nope.dim(2));
        let out = if l > 1 && self.variant.concat_prefill {
            // mistral4: per-head keys [nope | rope] against queries [nope | rope], one softmax
            let k = self.embed_q.forward(latent, false)?;
            let v = self.unembed_out.forward(latent, true)?;
            let k_pe = mx::broadcast_to(k_pe, &[b, self.d.heads, k_pe.dim(2), self.d.rope])?;
            let q = mx::concatenate(&[q_nope, q_pe], -1)?;
            let k = mx::concatenate(&[&k, &k_pe], -1)?;
            let m = match (mask, causal) {
                (Some(m), _) => AttnMask::Array(m),
                (None, true) => AttnMask::Causal,
                (None, false) => AttnMask::None,
            };
            super::sdpa::attention(&q, &k, &v, self.scale, m, None)?
        } else {
            let sc = mx::scalar_as(self.scale as f64, q_pe.dtype())?;
            let mut pe = mx::matmul(&mx::multiply(q_pe, &sc)?, &mx::swapaxes(k_pe, -1, -2)?)?;
            if let Some(m) = mask {
                pe = mx::where_(m, &pe, &mx::scalar_as(super::layers::finfo_min(pe.dtype()), pe.dtype())?)?;
            }
            if l == 1 {
                let q = self.embed_q.forward(q_nope, true)?;
                let o = super::sdpa::attention(&q, latent, latent, self.scale, AttnMask::Array(&pe), None)?;
                self.unembed_out.forward(&o, true)?
            } else {
                let k = self.embed_q.forward(latent, false)?;
                let v = self.unembed_out.forward(latent, true)?;
                super::sdpa::attention(q_nope, &k, &v, self.scale, AttnMask::Array(&pe), None)?
            }
        };
        mx::reshape(&mx::transpose_axes(&out, &[0, 2, 1, 3])?, &[b, l, -1])
    }

    /// The rotated queries times [`MlaVariant::llama4_scale`] at `offsets` (one per row), when
    /// the variant has one.
    fn scale_queries(&self, q_nope: Array, q_pe: Array, offsets: &[i32]) -> Result<(Array, Array)> {
        match self.variant.llama4_scale {
            Some(p) => {
                let s = llama4_scale(offsets, q_nope.dim(2), p, q_nope.dtype())?;
                Ok((mx::multiply(&q_nope, &s)?, mx::multiply(&q_pe, &s)?))
            }
            None => Ok((q_nope, q_pe)),
        }
    }

    /// One row's projections `p` over its own cache: rotary embedding at the cache's offset, cache
    /// update (the indexer's key after the latent), the indexer's choice, attention.
    fn attend_row(&self, p: Proj, mask: &Mask, cache: &mut LayerCache) -> Result<Array> {
        let (n, offset) = (p.q_nope.dim(2), cache.offset());
        let (q_nope, q_pe) = self.scale_queries(p.q_nope, self.rope.forward(&p.q_pe, offset)?, &[offset])?;
        let k_pe = self.rope.forward(&p.k_pe, offset)?;
        let (index, keys) = match (&self.indexer, p.index) {
            (Some(ix), Some([iq, ik, wts])) => {
                let ik = ix.rope().forward(&ik, offset)?;
                (Some((ix, ix.rope().forward(&iq, offset)?, wts)), mx::concatenate(&[&p.latent, &ik], -1)?)
            }
            _ => (None, p.latent),
        };
        let (keys, mut k_pe) = match cache.update_and_fetch(keys, k_pe)? {
            Fetched::Dense(k, v) => (k, v),
            // mlx-lm's MLA cannot read a quantized cache either (the engine refuses kv_bits first)
            Fetched::Quant { .. } => {
                return Err(Error::Unsupported(
                    "a quantized KV cache (kv_bits) with multi-head latent attention".into(),
                ))
            }
        };
        // mistral4's prefill takes mlx-lm's "causal" as it is
        let causal = matches!(mask, Mask::Causal) && self.variant.concat_prefill && n > 1;
        let mut mask = match mask {
            Mask::None => None,
            Mask::Causal if causal => None,
            Mask::Causal => Some(causal_mask(n, offset, None)?),
            Mask::Array(a) => Some(a.clone()),
        };
        let latent = match index {
            Some((ix, iq, wts)) => {
                let rank = self.d.kv_lora_rank;
                // copied out of the shared rows: mlx-lm keeps the two in caches of their own, and on
                // CUDA a matmul or SDPA over a last-axis slice of a wider buffer takes another kernel
                // (float32 results 1e-3 apart, enough to move the indexer's top-k)
                let mut latent = mx::contiguous(&mx::slice_axis(&keys, 3, 0, rank)?)?;
                let ik = mx::contiguous(&mx::slice_axis(&keys, 3, rank, rank + ix.head_dim())?)?;
                if let Some(idx) = ix.select(&wts, &iq, &ik, mask.as_ref())? {
                    super::deepseek_v32::sparsify(&idx, &mut latent, &mut k_pe, &mut mask)?;
                }
                latent
            }
            None => keys,
        };
        self.attend(&q_nope, &q_pe, &latent, &k_pe, mask.as_ref(), causal)
    }

    /// A batch: the projections for all rows at once; then over the stacked KV (one decode token
    /// per row, all rows at once), or row by row over each row's own cache.
    fn forward_many(&self, x: &Array, masks: &Masks, caches: LayerCaches) -> Result<Array> {
        let p = self.project(x)?;
        let out = match (caches, masks) {
            (LayerCaches::Batch(..), _) if self.indexer.is_some() => {
                return Err(Error::Invalid(
                    "deepseek_v32's indexer over the stacked KV (the engine does not stack it)".into(),
                ))
            }
            (LayerCaches::Batch(kv, layer), Masks::Batch(mask, _)) => {
                let q_pe = self.rope.forward_rows(&p.q_pe, kv.offsets())?;
                let (q_nope, q_pe) = self.scale_queries(p.q_nope, q_pe, kv.offsets())?;
                let k_pe = self.rope.forward_rows(&p.k_pe, kv.offsets())?;
                let (latent, k_pe) = kv.update_and_fetch(layer, &p.latent, &k_pe)?;
                self.attend(&q_nope, &q_pe, &latent, &k_pe, Some(mask), false)?
            }
            (LayerCaches::Rows(mut caches), Masks::Rows(masks)) if caches.len() == 1 => {
                self.attend_row(p, &masks[0], caches[0])?
            }
            (LayerCaches::Rows(caches), Masks::Rows(masks)) => {
                let mut outs = Vec::with_capacity(caches.len());
                for (r, (cache, mask)) in caches.into_iter().zip(masks).enumerate() {
                    outs.push(self.attend_row(p.row(r as i32)?, mask, cache)?);
                }
                let refs: Vec<&Array> = outs.iter().collect();
                mx::concatenate(&refs, 0)?
            }
            _ => return Err(Error::Invalid("attention: masks and caches of different kinds".into())),
        };
        self.o_proj.forward(&out)
    }
}

/// An attention layer's projections of a batch ([`Mla::project`]).
struct Proj {
    /// `[B, H, L, nope]`
    q_nope: Array,
    /// `[B, H, L, rope]`
    q_pe: Array,
    /// The normed latent `[B, 1, L, rank]`.
    latent: Array,
    /// The rope key `[B, 1, L, rope]`.
    k_pe: Array,
    /// deepseek_v32's indexer: its queries `[B, heads, L, head_dim]`, key `[B, 1, L, head_dim]`
    /// and per-head weights `[B, L, heads]`.
    index: Option<[Array; 3]>,
}

impl Proj {
    /// Row `r` of every part.
    fn row(&self, r: i32) -> Result<Proj> {
        let cut = |a: &Array| mx::slice_axis(a, 0, r, r + 1);
        Ok(Proj {
            q_nope: cut(&self.q_nope)?,
            q_pe: cut(&self.q_pe)?,
            latent: cut(&self.latent)?,
            k_pe: cut(&self.k_pe)?,
            index: match &self.index {
                Some([a, b, c]) => Some([cut(a)?, cut(b)?, cut(c)?]),
                None => None,
            },
        })
    }
}

struct Block {
    attn: Mla,
    mlp: Ffn,
    in_norm: RmsNorm,
    post_norm: RmsNorm,
}

pub struct Model {
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    /// None: tied to the embedding.
    lm_head: Option<Linear>,
    shape: ModelShape,
    /// With deepseek_v32's indexer: full caches always, never stacked.
    indexed: bool,
}

impl Model {
    pub fn load(config: &Value, w: Weights) -> Result<Model> {
        let router = super::glm4_moe::grouped_router(&Cfg(config), "deepseek_v3")?;
        Model::load_with(config, w, router, None)
    }

    /// The decoder with the MoE routed by `router` and, when `indexer` is Some(interleaved rope),
    /// deepseek_v32's indexer in every layer.
    pub fn load_with(
        config: &Value,
        w: Weights,
        router: super::layers::Router,
        indexer: Option<bool>,
    ) -> Result<Model> {
        Model::load_variant(config, w, router, indexer, MlaVariant::DEEPSEEK, layout(config)?, false)
    }

    /// [`Model::load_with`] with the attention of `variant`, the layers of `layout`, and the LM
    /// head the embedding's transpose when `tie`.
    pub fn load_variant(
        config: &Value,
        mut w: Weights,
        router: super::layers::Router,
        indexer: Option<bool>,
        variant: MlaVariant,
        layout: Vec<LayerLayout>,
        tie: bool,
    ) -> Result<Model> {
        let c = Cfg(config);
        let d = MlaDims::from_config(&c)?;
        let vocab = c.size("vocab_size", Some(102400), limits::VOCAB)?;
        let eps = c.f_or("rms_norm_eps", 1e-6) as f32;
        let spec = MoeSpec { router, ..MoeSpec::QWEN3 };
        let mut layers = Vec::with_capacity(layout.len());
        for (i, l) in layout.iter().enumerate() {
            let p = format!("model.layers.{i}");
            layers.push(Block {
                attn: Mla::load(&mut w, &format!("{p}.self_attn"), &c, d, indexer, variant)?,
                mlp: Ffn::load_with(&mut w, &format!("{p}.mlp"), false, l.ffn, d.hidden, 0, &spec)?,
                in_norm: RmsNorm::load(&mut w, &format!("{p}.input_layernorm"), eps, d.hidden)?,
                post_norm: RmsNorm::load(&mut w, &format!("{p}.post_attention_layernorm"), eps, d.hidden)?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", vocab, d.hidden)?;
        let norm = RmsNorm::load(&mut w, "model.norm", eps, d.hidden)?;
        let lm_head = if tie { None } else { Some(Linear::load(&mut w, "lm_head", false, embed.rows(), d.hidden)?) };
        let dtype_bytes = embed.dtype().size();
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("deepseek_v3");
        let shape =
            ModelShape::new(model_type, layout, d.hidden, vocab, c.opt_i("max_position_embeddings"), dtype_bytes);
        Ok(Model { embed, layers, norm, lm_head, shape, indexed: indexer.is_some() })
    }

    /// Replace the per-layer layout (deepseek_v32's counts the indexer's keys).
    pub fn set_layout(&mut self, layout: Vec<LayerLayout>) {
        let s = &self.shape;
        self.shape = ModelShape::new(
            &s.model_type,
            layout,
            s.hidden_size,
            s.vocab_size,
            s.max_position_embeddings,
            s.dtype_bytes,
        );
    }
}

impl CausalLm for Model {
    fn forward_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.hidden_caches(tokens, caches, staging)?;
        self.embed.logits(self.lm_head.as_ref(), &h)
    }

    fn hidden_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.embed.forward(tokens)?;
        let masks = super::LayerMasks::new(caches, tokens.dim(1), self.layers.iter().map(|_| Some(false)), None)?;
        let h = super::run_layers(self.layers.len(), h, caches, staging, |i, h, caches| {
            let l = &self.layers[i];
            let mixer = |x: &Array| l.attn.forward_many(x, masks.get(false)?, caches.layer_mut(i));
            super::pre_norm_residual(h, &l.in_norm, mixer, &l.post_norm, |x| l.mlp.forward(x))
        })?;
        self.norm.forward(&h)
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }

    fn make_cache(&self, opts: &crate::cache::CacheOptions) -> Vec<LayerCache> {
        if self.indexed {
            return super::deepseek_v32::make_cache(self.layers.len(), opts);
        }
        arch::make_cache(&self.shape.layers, opts)
    }

    fn stackable(&self) -> bool {
        !self.indexed
    }
}
