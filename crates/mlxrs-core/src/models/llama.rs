//! Llama (and Mistral, remapped here): pre-norm decoder, SwiGLU MLP, optional sliding layers.
use super::arch::{self, Arch, AttnKind, LayerLayout};
use super::layers::{Attention, Embedding, Ffn, Linear, MoeSpec, Qkv, RmsNorm, Rope};
use super::{CausalLm, Cfg, DimDefaults, Dims, ModelShape};
use crate::cache::Caches;
use crate::error::Result;
use crate::handle::Array;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "llama",
    model_types: &["llama", "mistral"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w)?)),
    layout,
    gguf: Some("llama"),
};

/// Drop what mlx-lm drops: rotary inv_freq buffers and a tied lm_head.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    w.retain(|k| !k.contains("self_attn.rotary_emb.inv_freq"));
    if Cfg(config).b_or("tie_word_embeddings", default_tie(config)) {
        w.remove("lm_head.weight");
    }
    Ok(())
}

/// Full attention, or a sliding window for the layers `layer_types` marks `sliding_attention`
/// (when the config has a `sliding_window`); dense FFNs.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let c = Cfg(config);
    let layer_types: Vec<String> = c
        .get("layer_types")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    let is_sliding = |i: i32| layer_types.get(i as usize).is_some_and(|t| t == "sliding_attention");
    let window = match c.get("sliding_window") {
        Some(_) if layer_types.iter().any(|t| t == "sliding_attention") => {
            Some(c.size("sliding_window", None, super::limits::POSITIONS)?)
        }
        _ => None,
    };
    arch::uniform(
        config,
        DimDefaults::default(),
        |i| match window {
            Some(window) if is_sliding(i) => AttnKind::Sliding { window },
            _ => AttnKind::Full,
        },
        arch::dense,
    )
}

fn default_tie(config: &Value) -> bool {
    // mlx-lm's defaults: llama/qwen2 tie unless told otherwise; qwen3 requires the field
    !matches!(config.get("model_type").and_then(Value::as_str), Some("qwen3" | "qwen3_moe"))
}

pub struct Block {
    pub attn: Attention,
    pub mlp: Ffn,
    pub in_norm: RmsNorm,
    pub post_norm: RmsNorm,
    pub sliding: bool,
    /// Per-head attention sinks `[heads]` (gpt_oss).
    pub sinks: Option<Array>,
}

/// Llama-family decoder, parameterised by the differences of qwen2 (q/k/v bias) and qwen3 (qk-norm).
pub struct Model {
    pub embed: Embedding,
    pub layers: Vec<Block>,
    pub norm: RmsNorm,
    pub lm_head: Option<Linear>,
    pub shape: ModelShape,
    pub sliding_window: Option<i32>,
    /// Llama 4's position-dependent query scale `(beta, original_max_position_embeddings)`
    /// (ministral3: [`super::deepseek_v3::llama4_scale`]); None for the others.
    pub llama4_scale: Option<(f64, f64)>,
}

/// Per-family switches.
pub struct Variant {
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: bool,
    /// Whether the config's `rope_scaling` applies (mlx-lm's qwen3_moe builds a plain RoPE).
    pub rope_scaling: bool,
}

/// What else differs in the MoE decoders built on this one (mixtral, glm4_moe, gpt_oss).
#[derive(Clone, Copy, Debug)]
pub struct Extra {
    /// The FFN's module name in a layer: `mlp` (mixtral's `block_sparse_moe`).
    pub ffn_name: &'static str,
    /// How the MoE layers route and where their parts are.
    pub moe: MoeSpec,
    /// The dims the rotary embedding rotates (partial rotary); None: the head dim.
    pub rope_dims: Option<i32>,
    /// Whether the LM head is tied to the embedding when the architecture decides it; None: the
    /// config's `tie_word_embeddings` (the family's default when absent).
    pub tie: Option<bool>,
    /// Per-head attention sinks at `self_attn.sinks` (gpt_oss).
    pub sinks: bool,
}

impl Extra {
    /// The plain llama-family decoder.
    pub const NONE: Extra = Extra { ffn_name: "mlp", moe: MoeSpec::QWEN3, rope_dims: None, tie: None, sinks: false };
}

impl Model {
    pub fn load(config: &Value, w: Weights) -> Result<Model> {
        let c = Cfg(config);
        let bias = c.b_or("attention_bias", false);
        Model::load_variant(
            config,
            w,
            Variant { qkv_bias: bias, o_bias: bias, qk_norm: false, rope_scaling: true },
            c.b_or("mlp_bias", false),
            layout(config)?,
        )
    }

    /// The decoder of `layout` (its attention kinds and FFNs).
    pub fn load_variant(
        config: &Value,
        w: Weights,
        v: Variant,
        mlp_bias: bool,
        layout: Vec<LayerLayout>,
    ) -> Result<Model> {
        Model::load_extra(config, w, v, mlp_bias, layout, &Extra::NONE)
    }

    /// [`Model::load_variant`] with what [`Extra`] says differs.
    pub fn load_extra(
        config: &Value,
        mut w: Weights,
        v: Variant,
        mlp_bias: bool,
        layout: Vec<LayerLayout>,
        x: &Extra,
    ) -> Result<Model> {
        let c = Cfg(config);
        let d = Dims::from_config(&c, DimDefaults::default())?;
        let (hidden, n_layers, n_heads, n_kv, head_dim) = (d.hidden, d.layers, d.heads, d.kv_heads, d.head_dim);
        let dense = layout.iter().any(|l| matches!(l.ffn, super::FfnKind::Dense { .. }));
        let inter = if dense { d.intermediate(&w)? } else { 0 };
        let eps = c.f_or("rms_norm_eps", 1e-6) as f32;
        let theta = c.f_or("rope_theta", 10000.0) as f32;
        let traditional = c.b_or("rope_traditional", false);
        let tie = x.tie.unwrap_or_else(|| c.b_or("tie_word_embeddings", default_tie(config)));
        if layout.len() != n_layers as usize {
            return Err(crate::Error::ModelLoad(format!(
                "config.json: {} layer kinds for num_hidden_layers {n_layers}",
                layout.len()
            )));
        }
        let rope_dims = x.rope_dims.unwrap_or(head_dim);
        if rope_dims % 2 != 0 || !(2..=head_dim).contains(&rope_dims) {
            return Err(crate::Error::ModelLoad(format!(
                "config.json: the rotary embedding's {rope_dims} dims do not fit head_dim {head_dim}"
            )));
        }
        let sliding_window =
            layout.iter().find_map(|l| if let AttnKind::Sliding { window } = l.attn { Some(window) } else { None });
        let (q_out, kv_out) = (n_heads * head_dim, n_kv * head_dim);
        let mut layers = Vec::with_capacity(n_layers as usize);
        for i in 0..n_layers {
            let p = format!("model.layers.{i}");
            let qk_norm = if v.qk_norm {
                Some(super::layers::QkNorm {
                    q: RmsNorm::load(&mut w, &format!("{p}.self_attn.q_norm"), eps, head_dim)?,
                    k: RmsNorm::load(&mut w, &format!("{p}.self_attn.k_norm"), eps, head_dim)?,
                })
            } else {
                None
            };
            let attn = Attention {
                qkv: Qkv::load(&mut w, &format!("{p}.self_attn"), v.qkv_bias, q_out, kv_out, hidden)?,
                o_proj: Linear::load(&mut w, &format!("{p}.self_attn.o_proj"), v.o_bias, hidden, q_out)?,
                qk_norm,
                n_heads,
                n_kv_heads: n_kv,
                head_dim,
                scale: (head_dim as f32).powf(-0.5),
                rope: Rope::from_config(
                    rope_dims,
                    theta,
                    traditional,
                    if v.rope_scaling { c.get("rope_scaling") } else { None },
                )?,
            };
            let fuse = super::layers::fused_proj();
            let attn = if fuse { attn.fuse()? } else { attn };
            let sinks = if x.sinks { Some(w.take_shaped(&format!("{p}.self_attn.sinks"), &[n_heads])?) } else { None };
            let mlp = Ffn::load_with(
                &mut w,
                &format!("{p}.{}", x.ffn_name),
                mlp_bias,
                layout[i as usize].ffn,
                hidden,
                inter,
                &x.moe,
            )?;
            layers.push(Block {
                attn,
                mlp: if fuse { mlp.fuse()? } else { mlp },
                in_norm: RmsNorm::load(&mut w, &format!("{p}.input_layernorm"), eps, hidden)?,
                post_norm: RmsNorm::load(&mut w, &format!("{p}.post_attention_layernorm"), eps, hidden)?,
                sliding: matches!(layout[i as usize].attn, AttnKind::Sliding { .. }),
                sinks,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", d.vocab, hidden)?;
        let norm = RmsNorm::load(&mut w, "model.norm", eps, hidden)?;
        let lm_head = if tie { None } else { Some(Linear::load(&mut w, "lm_head", false, embed.rows(), hidden)?) };
        let dtype_bytes = embed.dtype().size();
        // a dense FFN whose width the config left to the weights: the layout says it now
        let layout = layout
            .into_iter()
            .map(|l| match l.ffn {
                super::FfnKind::Dense { intermediate: 0 } => {
                    LayerLayout { ffn: super::FfnKind::Dense { intermediate: inter }, ..l }
                }
                _ => l,
            })
            .collect();
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("llama");
        Ok(Model {
            embed,
            layers,
            norm,
            lm_head,
            sliding_window,
            llama4_scale: None,
            shape: ModelShape::new(
                model_type,
                layout,
                hidden,
                d.vocab,
                c.opt_i("max_position_embeddings"),
                dtype_bytes,
            ),
        })
    }
}

impl CausalLm for Model {
    fn forward_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.hidden_caches(tokens, caches, staging)?;
        self.embed.logits(self.lm_head.as_ref(), &h)
    }

    fn hidden_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.embed.forward(tokens)?;
        let n = tokens.dim(1);
        let masks =
            super::LayerMasks::new(caches, n, self.layers.iter().map(|l| Some(l.sliding)), self.sliding_window)?;
        // Llama 4's query scale at each row's positions (the first layer's offsets, as mlx-lm's
        // `cache[0].offset`), multiplying the rotated queries
        let q_scale = match self.llama4_scale {
            Some(p) => {
                let offsets = caches.layer_mut(0).offsets();
                Some(super::deepseek_v3::llama4_scale(&offsets, n, p, h.dtype())?)
            }
            None => None,
        };
        let h = super::run_layers(self.layers.len(), h, caches, staging, |i, h, caches| {
            let layer = &self.layers[i];
            let mask = masks.get(layer.sliding)?;
            // pre-norm sub-layers, each adding its residual itself: on CUDA's quantized matvec the
            // norm in the next product's prologue and the residual in the output or down projection's
            // epilogue (layers::Attention::forward_normed_add, layers::Ffn::forward_normed_add)
            let h = match &q_scale {
                Some(s) => {
                    let (q, k, v) = layer.attn.project(&layer.in_norm.forward(h)?)?;
                    let out = layer.attn.attend_many_rotated(
                        q,
                        k,
                        v,
                        mask,
                        caches.layer_mut(i),
                        layer.sinks.as_ref(),
                        super::layers::Rotation::Rope(Some(s)),
                    )?;
                    layer.attn.output_add(&out, h.dim(0), n, h)?
                }
                None => {
                    layer.attn.forward_normed_add(h, &layer.in_norm, mask, caches.layer_mut(i), layer.sinks.as_ref())?
                }
            };
            layer.mlp.forward_normed_add(&h, &layer.post_norm)
        })?;
        self.norm.forward(&h)
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }
}
