//! Gemma 3 (text): sliding-window and global layers, qk-norm, scaled embeddings, `1 + w` norms,
//! sandwich norms around attention and MLP, GELU (tanh) MLP.
use super::arch::{self, Arch, AttnKind, LayerLayout};
use super::layers::{Activation, Attention, Embedding, Linear, Mlp, QkNorm, Qkv, RmsNorm, Rope};
use super::{CausalLm, Cfg, DimDefaults, Dims, ModelShape};
use crate::cache::Caches;
use crate::error::Result;
use crate::handle::{self as mx, Array, Dtype};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "gemma3_text",
    model_types: &["gemma3_text", "gemma3"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w)?)),
    layout,
    gguf: Some("gemma3"),
};

/// A missing lm_head means the head is tied to the embedding. A multimodal checkpoint's text
/// weights (`language_model.model.*` as mlx-vlm and transformers 4 save them,
/// `model.language_model.*` as transformers 5 does) are renamed to the text model's; whatever of the
/// vision tower is still there (a tower mlxrs did not load) is dropped.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    w.retain(|k| !k.contains("self_attn.rotary_emb.inv_freq"));
    let keys: Vec<String> = w.keys().cloned().collect();
    for k in keys {
        let renamed = if let Some(rest) = k.strip_prefix("language_model.") {
            Some(rest.to_string())
        } else {
            k.strip_prefix("model.language_model.").map(|rest| format!("model.{rest}"))
        };
        if let Some(n) = renamed {
            w.rename(&k, n);
        }
    }
    // mlx-vlm ties the multimodal model's head to the embedding whatever the checkpoint holds
    if w.contains("model.embed_tokens.weight") && config.get("vision_config").is_some() {
        w.remove("lm_head.weight");
    }
    w.retain(|k| {
        !(k.starts_with("vision_tower.")
            || k.starts_with("multi_modal_projector.")
            || k.starts_with("model.vision_tower.")
            || k.starts_with("model.multi_modal_projector."))
    });
    Ok(())
}

const DEFAULTS: DimDefaults = DimDefaults {
    hidden: Some(1152),
    layers: Some(26),
    heads: Some(4),
    kv_heads: Some(1),
    head_dim: Some(256),
    vocab: Some(262144),
};

/// Every `sliding_window_pattern`-th layer global, the others a sliding window (of 512 unless
/// the config says); dense FFNs. A multimodal config nests the text model.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let text = config.get("text_config").unwrap_or(config);
    let c = Cfg(text);
    let d = Dims::from_config(&c, DEFAULTS)?;
    let window = c.size("sliding_window", Some(512), super::limits::POSITIONS)?;
    // every `pattern`-th layer is global: at least one must be (its mask serves them all)
    let pattern = c.size("sliding_window_pattern", Some(6), d.layers as i64)?;
    arch::uniform(
        text,
        DEFAULTS,
        |i| if (i + 1) % pattern != 0 { AttnKind::Sliding { window } } else { AttnKind::Full },
        arch::dense,
    )
}

struct Block {
    attn: Attention,
    mlp: Mlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
}

pub struct Model {
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    embed_scale: Array,
    window: i32,
    pattern: i32,
    shape: ModelShape,
}

impl Model {
    pub fn load(config: &Value, mut w: Weights) -> Result<Model> {
        // a multimodal gemma3 config nests the text model
        let text = config.get("text_config").unwrap_or(config);
        let c = Cfg(text);
        let d = Dims::from_config(&c, DEFAULTS)?;
        let layout = layout(config)?;
        let (hidden, n_layers, n_heads, n_kv, head_dim) = (d.hidden, d.layers, d.heads, d.kv_heads, d.head_dim);
        let inter = d.intermediate(&w)?;
        let eps = c.f_or("rms_norm_eps", 1e-6) as f32;
        let theta = c.f_or("rope_theta", 1_000_000.0) as f32;
        let local_theta = c.f_or("rope_local_base_freq", 10_000.0) as f32;
        let qpas = c.f_or("query_pre_attn_scalar", 256.0);
        let window = c.size("sliding_window", Some(512), super::limits::POSITIONS)?;
        // every `pattern`-th layer is global: at least one must be (its mask serves them all)
        let pattern = c.size("sliding_window_pattern", Some(6), n_layers as i64)?;
        let (q_out, kv_out) = (n_heads * head_dim, n_kv * head_dim);
        let mut layers = Vec::with_capacity(n_layers as usize);
        for i in 0..n_layers {
            let p = format!("model.layers.{i}");
            let sliding = matches!(layout[i as usize].attn, AttnKind::Sliding { .. });
            let rope = if sliding {
                Rope::from_config(head_dim, local_theta, false, None)?
            } else {
                Rope::from_config(head_dim, theta, false, c.get("rope_scaling"))?
            };
            let attn = Attention {
                qkv: Qkv::load(&mut w, &format!("{p}.self_attn"), false, q_out, kv_out, hidden)?,
                o_proj: Linear::load(&mut w, &format!("{p}.self_attn.o_proj"), false, hidden, q_out)?,
                qk_norm: Some(QkNorm {
                    q: RmsNorm::load_offset(&mut w, &format!("{p}.self_attn.q_norm"), eps, head_dim)?,
                    k: RmsNorm::load_offset(&mut w, &format!("{p}.self_attn.k_norm"), eps, head_dim)?,
                }),
                n_heads,
                n_kv_heads: n_kv,
                head_dim,
                scale: qpas.powf(-0.5) as f32,
                rope,
            };
            let norm = |w: &mut Weights, name: &str| RmsNorm::load_offset(w, &format!("{p}.{name}"), eps, hidden);
            let mlp = Mlp::load(&mut w, &format!("{p}.mlp"), false, Activation::GeluApprox, hidden, inter)?;
            let (attn, mlp) = if super::layers::fused_proj() { (attn.fuse()?, mlp.fuse()?) } else { (attn, mlp) };
            layers.push(Block {
                attn,
                mlp,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
                pre_ff_norm: norm(&mut w, "pre_feedforward_layernorm")?,
                post_ff_norm: norm(&mut w, "post_feedforward_layernorm")?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", d.vocab, hidden)?;
        let norm = RmsNorm::load_offset(&mut w, "model.norm", eps, hidden)?;
        let lm_head = if w.contains("lm_head.weight") {
            Some(Linear::load(&mut w, "lm_head", false, embed.rows(), hidden)?)
        } else {
            None
        };
        // mlx-lm rounds sqrt(hidden) to bfloat16 before casting to the activation dtype
        let scale = mx::astype(&Array::f32((hidden as f32).sqrt())?, Dtype::Bfloat16)?;
        let embed_scale = mx::astype(&scale, embed.dtype())?;
        let dtype_bytes = embed.dtype().size();
        let layout = layout
            .into_iter()
            .map(|l| LayerLayout { ffn: super::FfnKind::Dense { intermediate: inter }, ..l })
            .collect();
        Ok(Model {
            embed,
            layers,
            norm,
            lm_head,
            embed_scale,
            window,
            pattern,
            shape: ModelShape::new(
                "gemma3_text",
                layout,
                hidden,
                d.vocab,
                c.opt_i("max_position_embeddings"),
                dtype_bytes,
            ),
        })
    }
}

fn clip_residual(x: &Array, y: &Array) -> Result<Array> {
    if x.dtype() != Dtype::Float16 {
        return mx::add(x, y);
    }
    let bound = mx::scalar_as(65504.0, Dtype::Float32)?;
    let nb = mx::scalar_as(-65504.0, Dtype::Float32)?;
    let s = mx::add(&mx::astype(x, Dtype::Float32)?, &mx::astype(y, Dtype::Float32)?)?;
    mx::astype(&mx::clip(&s, Some(&nb), Some(&bound))?, Dtype::Float16)
}

impl CausalLm for Model {
    fn forward_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.hidden_caches(tokens, caches, staging)?;
        self.embed.logits(self.lm_head.as_ref(), &h)
    }

    fn hidden_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        self.hidden_from(&self.embed.forward(tokens)?, caches, staging)
    }

    fn embed_tokens(&self, tokens: &Array) -> Result<Array> {
        self.embed.forward(tokens)
    }

    fn forward_embeds(&self, embeds: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.hidden_from(embeds, caches, staging)?;
        self.embed.logits(self.lm_head.as_ref(), &h)
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }
}

impl Model {
    /// The decoder over input embeddings `h0` `[B, L, hidden]` (the token embeddings, or merged
    /// multimodal ones), scaled by sqrt(hidden) rounded to bfloat16 as mlx-lm and mlx-vlm do.
    fn hidden_from(&self, h0: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = mx::multiply(h0, &mx::astype(&self.embed_scale, h0.dtype())?)?;
        let global = |i: usize| (i as i32) % self.pattern == self.pattern - 1;
        let kinds = (0..self.layers.len()).map(|i| Some(!global(i)));
        let masks = super::LayerMasks::new(caches, h0.dim(1), kinds, Some(self.window))?;
        let h = super::run_layers(self.layers.len(), h, caches, staging, |i, h, caches| {
            let layer = &self.layers[i];
            let r =
                layer.attn.forward_many(&layer.input_norm.forward(h)?, masks.get(!global(i))?, caches.layer_mut(i))?;
            let hh = clip_residual(h, &layer.post_attn_norm.forward(&r)?)?;
            let r = layer.mlp.forward(&layer.pre_ff_norm.forward(&hh)?)?;
            clip_residual(&hh, &layer.post_ff_norm.forward(&r)?)
        })?;
        self.norm.forward(&h)
    }
}
