//! DeepSeek-V3.2 (mlx-lm's `models/deepseek_v32.py`): deepseek_v3's MLA decoder plus the sparse
//! attention "lightning" indexer in every layer. The indexer scores every past position for each
//! query with its own small multi-head scorer (`index_n_heads` heads of `index_head_dim`, keys
//! LayerNormed and partly rotated, ReLU'd dot products weighted per head by `weights_proj`) and
//! the attention then reads only the `index_topk` best positions; while a sequence holds at most
//! `index_topk` tokens it attends to all of them, as mlx-lm does.
//!
//! Its cache: mlx-lm keeps a second `KVCache` per layer for the indexer's keys (`[B, 1, T,
//! index_head_dim]`, its values a zero copy). Here they are the last `index_head_dim` features of
//! the layer's cached keys (the latent and the indexer key side by side, one `LayerCache`), so the
//! prefix cache and trimming keep both in step; [`AttnKind::Latent`]'s `index_dims` counts them.
//! The stacked KV of the batched decode is not used for it ([`super::CausalLm::stackable`]): its padded
//! rows would make the top-k choice of a short row differ from the row alone. As in mlx-lm, the
//! caches are always full ones (`max_kv_size` does not bound them: its `make_cache` ignores it).
use super::arch::{Arch, AttnKind, LayerLayout};
use super::deepseek_v3::{self, MlaDims};
use super::layers::{Linear, Rope};
use super::{limits, Cfg};
use crate::cache::{CacheOptions, LayerCache};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "deepseek_v32",
    model_types: &["deepseek_v32"],
    sanitize: deepseek_v3::sanitize,
    load: |c, w| Ok(Box::new(load(c, w)?)),
    layout,
    gguf: None,
};

/// The indexer's sizes: `(index_n_heads, index_head_dim, index_topk)`, mlx-lm's defaults for
/// what the config leaves out.
pub fn index_dims(c: &Cfg) -> Result<(i32, i32, i32)> {
    Ok((
        c.size("index_n_heads", Some(64), limits::HEADS)?,
        c.size("index_head_dim", Some(128), limits::HEAD_DIM)?,
        c.size("index_topk", Some(2048), limits::POSITIONS)?,
    ))
}

/// deepseek_v3's layout with the indexer's keys in every layer's cache.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let (_, hd, _) = index_dims(&Cfg(config))?;
    Ok(deepseek_v3::layout(config)?
        .into_iter()
        .map(|l| match l.attn {
            AttnKind::Latent { rank, rope_dims, .. } => {
                LayerLayout { attn: AttnKind::Latent { rank, rope_dims, index_dims: hd }, ..l }
            }
            _ => l,
        })
        .collect())
}

/// mlx-lm's `Indexer` of one layer (`self_attn.indexer`).
pub struct Indexer {
    wq_b: Linear,
    wk: Linear,
    k_norm: (Array, Array),
    weights_proj: Linear,
    heads: i32,
    head_dim: i32,
    topk: i32,
    rope: Rope,
    /// `index_n_heads^-0.5 * index_head_dim^-0.5` (the weights' scale).
    weight_scale: f64,
}

impl Indexer {
    pub fn load(w: &mut Weights, p: &str, c: &Cfg, d: &MlaDims, interleave: bool) -> Result<Indexer> {
        let (heads, head_dim, topk) = index_dims(c)?;
        let q_lora = d.q_lora_rank.ok_or_else(|| {
            Error::ModelLoad("config.json: q_lora_rank is null, but the indexer reads the low-rank query".into())
        })?;
        if d.rope > head_dim {
            return Err(Error::ModelLoad(format!(
                "config.json: qk_rope_head_dim {} exceeds index_head_dim {head_dim}",
                d.rope
            )));
        }
        let p = format!("{p}.indexer");
        Ok(Indexer {
            wq_b: Linear::load(w, &format!("{p}.wq_b"), false, heads * head_dim, q_lora)?,
            wk: Linear::load(w, &format!("{p}.wk"), false, head_dim, d.hidden)?,
            k_norm: (
                w.take_shaped(&format!("{p}.k_norm.weight"), &[head_dim])?,
                w.take_shaped(&format!("{p}.k_norm.bias"), &[head_dim])?,
            ),
            weights_proj: Linear::load(w, &format!("{p}.weights_proj"), false, heads, d.hidden)?,
            heads,
            head_dim,
            topk,
            rope: Rope::from_config(d.rope, c.f_or("rope_theta", 10000.0) as f32, interleave, c.get("rope_scaling"))?,
            weight_scale: (heads as f64).powf(-0.5) * (head_dim as f64).powf(-0.5),
        })
    }

    pub fn head_dim(&self) -> i32 {
        self.head_dim
    }

    /// The indexer's key `[B, 1, L, head_dim]` of `x`, before the rotary embedding.
    pub fn key(&self, x: &Array) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let k = mx::layer_norm(&self.wk.forward(x)?, Some(&self.k_norm.0), Some(&self.k_norm.1), 1e-5)?;
        mx::reshape(&k, &[b, 1, l, self.head_dim])
    }

    /// The indexer's queries `[B, heads, L, head_dim]` from the normed low-rank query `qr`, before
    /// the rotary embedding.
    pub fn query(&self, qr: &Array) -> Result<Array> {
        let (b, l) = (qr.dim(0), qr.dim(1));
        mx::swapaxes(&mx::reshape(&self.wq_b.forward(qr)?, &[b, l, self.heads, self.head_dim])?, 1, 2)
    }

    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The per-head weights `[B, L, heads]` of `x` (scaled).
    pub fn weights(&self, x: &Array) -> Result<Array> {
        let wts = self.weights_proj.forward(x)?;
        mx::multiply(&wts, &mx::scalar_as(self.weight_scale, wts.dtype())?)
    }

    /// The `index_topk` positions `[B, 1, L, topk]` each query attends to, None while the keys
    /// `k` `[B, 1, T, head_dim]` are at most `index_topk` (every position then). `wts` from
    /// [`Indexer::weights`], `q` the rotated queries.
    pub fn select(&self, wts: &Array, q: &Array, k: &Array, mask: Option<&Array>) -> Result<Option<Array>> {
        let (t, l) = (k.dim(2), q.dim(2));
        if t <= self.topk {
            return Ok(None);
        }
        let scores = mx::matmul(q, &mx::swapaxes(k, -1, -2)?)?;
        let scores = mx::maximum(&scores, &mx::scalar_as(0.0, scores.dtype())?)?;
        let wts = mx::expand_dims(&mx::swapaxes(wts, -1, -2)?, -1)?;
        let scores = mx::multiply(&scores, &wts)?;
        // summed over the heads as mlx-lm does: one by one for a prefill, one reduction for a step
        let mut scores = if l > 1 {
            let mut acc = mx::slice_axis(&scores, 1, 0, 1)?;
            for h in 1..self.heads {
                acc = mx::add(&acc, &mx::slice_axis(&scores, 1, h, h + 1)?)?;
            }
            acc
        } else {
            mx::sum(&scores, &[1], true)?
        };
        if let Some(m) = mask {
            scores = mx::where_(m, &scores, &mx::scalar_as(f64::NEG_INFINITY, scores.dtype())?)?;
        }
        let part = mx::argpartition(&scores, t - self.topk, -1)?;
        Ok(Some(mx::slice_axis(&part, -1, t - self.topk, t)?))
    }
}

/// Apply the indexer's choice `idx` `[B, 1, L, topk]` to the attention inputs: for one query,
/// the chosen latents and rope keys gathered (and the mask with them); for several, a mask of the
/// chosen positions (and the causal one).
pub fn sparsify(idx: &Array, latent: &mut Array, k_pe: &mut Array, mask: &mut Option<Array>) -> Result<()> {
    if idx.dim(2) == 1 {
        let i = mx::expand_dims(&mx::slice_axis(idx, 2, 0, 1)?, -1)?; // [B, 1, 1, topk, 1]
        let i = mx::squeeze(&i, &[2])?; // [B, 1, topk, 1]
        let gather = |a: &Array| -> Result<Array> {
            let mut sh = i.shape();
            *sh.last_mut().expect("4-d") = a.dim(-1);
            mx::take_along_axis(a, &mx::broadcast_to(&i, &sh)?, 2)
        };
        *latent = gather(latent)?;
        *k_pe = gather(k_pe)?;
        if let Some(m) = mask.as_ref() {
            *mask = Some(mx::take_along_axis(m, idx, -1)?);
        }
    } else {
        let mut sh = idx.shape();
        *sh.last_mut().expect("4-d") = latent.dim(2);
        let sparse = mx::put_along_axis(&mx::zeros(&sh, Dtype::Bool)?, idx, &mx::scalar_as(1.0, Dtype::Bool)?, -1)?;
        *mask = Some(match mask.as_ref() {
            Some(m) => mx::logical_and(&sparse, m)?,
            None => sparse,
        });
    }
    Ok(())
}

/// The DeepSeek-V3.2 decoder of `config` (`indexer_rope_interleave` mlx-lm's default false).
pub fn load(config: &Value, w: Weights) -> Result<deepseek_v3::Model> {
    load_interleave(config, w, false)
}

/// [`load`] with the indexer's rope interleaved when the config does not say (glm_moe_dsa).
pub fn load_interleave(config: &Value, w: Weights, interleave_default: bool) -> Result<deepseek_v3::Model> {
    let c = Cfg(config);
    if MlaDims::from_config(&c)?.q_lora_rank.is_none() {
        return Err(Error::ModelLoad(
            "config.json: q_lora_rank is null, but the indexer reads the low-rank query".into(),
        ));
    }
    let router = super::glm4_moe::grouped_router(&c, "deepseek_v32")?;
    let interleave = c.b_or("indexer_rope_interleave", interleave_default);
    let mut m = deepseek_v3::Model::load_with(config, w, router, Some(interleave))?;
    m.set_layout(layout(config)?);
    Ok(m)
}

/// Full caches whatever `max_kv_size` (mlx-lm's deepseek_v32 `make_cache`).
pub fn make_cache(layers: usize, _opts: &CacheOptions) -> Vec<LayerCache> {
    (0..layers).map(|_| LayerCache::full()).collect()
}
