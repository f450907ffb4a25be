//! The architecture table: what each architecture is, declared once. Each architecture file
//! exports one [`Arch`]; [`super::ARCHS`] lists them. Derived from it and written nowhere else:
//! the supported `model_type`s, the dispatch of [`super::build`], every model's cache
//! construction ([`make_cache`]), the planner's per-layer KV bytes (`plan.rs`), the GGUF
//! architectures the importer accepts and the registry's copy of them (through the extension).
use super::{CausalLm, Cfg, DimDefaults, Dims};
use crate::cache::{CacheOptions, LayerCache};
use crate::error::Result;
use crate::weights::Weights;
use serde::Serialize;
use serde_json::Value;

/// How one layer attends, and so what it caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnKind {
    /// Every position: a growing KV cache.
    Full,
    /// The last `window` positions: a rotating cache of at most `window` slots.
    Sliding { window: i32 },
    /// Reads the keys and values of layer `from` (Gemma 4's KV-shared layers): no cache of its own.
    /// Its [`LayerCache`] is an empty placeholder that only tracks the token count.
    SharedKv { from: usize },
    /// A fixed-size recurrent state instead of a KV cache (Gated DeltaNet linear attention:
    /// qwen3_next, qwen3_5): a [`crate::cache::RecurrentCache`] of `conv` elements in the
    /// activation dtype (the convolution's last `kernel - 1` inputs, `(kernel - 1) × conv_dim`) and
    /// `state` float32 elements (the delta-rule state, `Hv × Dv × Dk`) per sequence, whatever its length.
    LinearRecurrent { conv: i32, state: i32 },
    /// Multi-head latent attention (deepseek_v3): every position, a growing cache of one compressed
    /// latent of `rank` elements and one rotary key of `rope_dims` per token, whatever the heads,
    /// plus the sparse-attention indexer's key of `index_dims` (deepseek_v32; 0 without one).
    Latent { rank: i32, rope_dims: i32, index_dims: i32 },
}

/// The feed-forward part of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnKind {
    Dense {
        intermediate: i32,
    },
    /// `experts` routed experts of width `intermediate`, `top_k` of them per token, plus
    /// `shared` always-on experts; the router's top-k probabilities renormalised when
    /// `norm_topk_prob`.
    Moe {
        experts: i32,
        top_k: i32,
        intermediate: i32,
        shared: i32,
        norm_topk_prob: bool,
    },
}

/// One decoder layer's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerLayout {
    pub attn: AttnKind,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub ffn: FfnKind,
}

impl LayerLayout {
    /// Cached K and V elements per token (0 for a layer without a KV cache of its own).
    pub fn kv_elems(&self) -> usize {
        match self.attn {
            AttnKind::Full | AttnKind::Sliding { .. } => (self.kv_heads.max(0) * self.head_dim.max(0) * 2) as usize,
            AttnKind::Latent { rank, rope_dims, index_dims } => {
                (rank.max(0) + rope_dims.max(0) + index_dims.max(0)) as usize
            }
            AttnKind::SharedKv { .. } | AttnKind::LinearRecurrent { .. } => 0,
        }
    }
    /// Bytes of the fixed-size state one sequence holds in this layer beside any KV (a linear-attention
    /// layer's convolution inputs in `act_bytes`-byte elements and its float32 recurrent state; 0 for
    /// the others). Not quantized by `kv_bits` (mlx-lm quantizes only the KV caches).
    pub fn state_bytes(&self, act_bytes: usize) -> usize {
        match self.attn {
            AttnKind::LinearRecurrent { conv, state } => conv.max(0) as usize * act_bytes + state.max(0) as usize * 4,
            _ => 0,
        }
    }
    /// The KV slots a layer holds at `slots` tokens (a sliding layer at most its window).
    pub fn kv_slots(&self, slots: usize) -> usize {
        match self.attn {
            AttnKind::Sliding { window } => slots.min(window.max(0) as usize),
            _ => slots,
        }
    }
}

/// Loads a model from its config and its weights (after [`Arch::sanitize`]).
pub type Loader = fn(&Value, Weights) -> Result<Box<dyn CausalLm>>;

/// One architecture.
pub struct Arch {
    /// The canonical `model_type`.
    pub name: &'static str,
    /// Every `model_type` that maps onto it (the canonical one included).
    pub model_types: &'static [&'static str],
    /// mlx-lm's sanitize: drop or rename tensors before the loader takes them.
    pub sanitize: fn(&Value, &mut Weights) -> Result<()>,
    pub load: Loader,
    /// The per-layer layout a config describes (the loader builds the same layers from it).
    pub layout: fn(&Value) -> Result<Vec<LayerLayout>>,
    /// The GGUF `general.architecture` imported as this architecture (`gguf/import.rs`).
    pub gguf: Option<&'static str>,
}

/// The architecture of a `model_type`.
pub fn find(model_type: &str) -> Option<&'static Arch> {
    super::ARCHS.iter().find(|a| a.model_types.contains(&model_type))
}

/// Every supported `model_type`, aliases included.
pub fn supported() -> Vec<&'static str> {
    super::ARCHS.iter().flat_map(|a| a.model_types.iter().copied()).collect()
}

/// (GGUF architecture, model_type) for every architecture the GGUF importer maps.
pub fn gguf_architectures() -> Vec<(&'static str, &'static str)> {
    super::ARCHS.iter().filter_map(|a| a.gguf.map(|g| (g, a.name))).collect()
}

/// The layout of `config` (the text config of a multimodal one), when its architecture is known.
pub fn layout_of(config: &Value) -> Option<Result<Vec<LayerLayout>>> {
    let mt = config.get("model_type").and_then(Value::as_str)?;
    find(mt).map(|a| (a.layout)(config))
}

/// The caches of a model of this layout: a rotating cache of `window` slots for a sliding layer,
/// an empty full cache that is never written for a shared-KV layer (the model keeps its offset in
/// step, so that trimming and the prefix cache see one length), a recurrent state for a
/// linear-attention layer, for the others a growing one (a rotating one of `max_kv_size` when set).
pub fn make_cache(layers: &[LayerLayout], opts: &CacheOptions) -> Vec<LayerCache> {
    layers
        .iter()
        .map(|l| match (l.attn, opts.max_kv_size) {
            (AttnKind::LinearRecurrent { .. }, _) => LayerCache::recurrent(),
            (AttnKind::Sliding { window }, _) => LayerCache::rotating(window, 0),
            (AttnKind::SharedKv { .. }, _) => LayerCache::full(),
            (_, Some(m)) => LayerCache::rotating(m, 4),
            _ => LayerCache::full(),
        })
        .collect()
}

/// The layout of a uniform decoder: every layer `attn(i)`, the config's KV heads and head dim,
/// and `ffn(i)`.
pub fn uniform(
    config: &Value,
    defaults: DimDefaults,
    attn: impl Fn(i32) -> AttnKind,
    ffn: impl Fn(i32, &Dims) -> Result<FfnKind>,
) -> Result<Vec<LayerLayout>> {
    let d = Dims::from_config(&Cfg(config), defaults)?;
    (0..d.layers)
        .map(|i| Ok(LayerLayout { attn: attn(i), kv_heads: d.kv_heads, head_dim: d.head_dim, ffn: ffn(i, &d)? }))
        .collect()
}

/// A dense FFN of the config's `intermediate_size` (0 when the config leaves it to the weights).
pub fn dense(_i: i32, d: &Dims) -> Result<FfnKind> {
    Ok(FfnKind::Dense { intermediate: d.intermediate.unwrap_or(0) })
}

/// mlx-lm's expert stacking (sanitize): for each `(from, to)`, the per-expert
/// `{prefix}.experts.{e}.{from}.{weight,scales,biases}` of experts `0..n` stacked into
/// `{prefix}.{into}.{to}.*` `[n, ...]`. A layer without `{prefix}.experts.0.{from}.weight` is left
/// alone; an expert missing is refused naming its tensor, one past `n` naming it too.
pub fn stack_experts(w: &mut Weights, prefix: &str, n: i32, into: &str, projs: &[(&str, &str)]) -> Result<()> {
    use crate::error::Error;
    if !projs.iter().any(|(from, _)| w.contains(&format!("{prefix}.experts.0.{from}.weight"))) {
        return Ok(());
    }
    for (from, to) in projs {
        for part in ["weight", "scales", "biases"] {
            if !w.contains(&format!("{prefix}.experts.0.{from}.{part}")) {
                continue;
            }
            let parts =
                (0..n).map(|e| w.take(&format!("{prefix}.experts.{e}.{from}.{part}"))).collect::<Result<Vec<_>>>()?;
            if parts.windows(2).any(|a| a[0].shape() != a[1].shape()) {
                return Err(Error::ModelLoad(format!("weights {prefix}.experts.*.{from}.{part} differ in shape")));
            }
            let refs: Vec<&crate::handle::Array> = parts.iter().collect();
            w.insert(format!("{prefix}.{into}.{to}.{part}"), crate::handle::stack(&refs, 0)?);
        }
    }
    // an expert past n: the config does not match the checkpoint
    let past = format!("{prefix}.experts.");
    if let Some(k) =
        w.keys().filter(|k| k.starts_with(&past) && k[past.len()..].starts_with(|c: char| c.is_ascii_digit())).min()
    {
        return Err(Error::ModelLoad(format!("weight {k} is past config.json's expert count {n}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_table_gives_the_supported_types_and_gguf_names() {
        assert_eq!(
            supported(),
            [
                "llama",
                "mistral",
                "qwen2",
                "qwen3",
                "qwen3_moe",
                "gemma3_text",
                "gemma3",
                "gemma4_text",
                "gemma4",
                "qwen3_next",
                "qwen3_5",
                "qwen3_5_moe",
                "mixtral",
                "glm4_moe",
                "gpt_oss",
                "deepseek_v3",
                "deepseek_v32",
                "glm_moe_dsa",
                "mistral4",
                "mistral3",
                "ministral3"
            ]
        );
        let mut g = gguf_architectures();
        g.sort();
        assert_eq!(
            g,
            [
                ("gemma3", "gemma3_text"),
                ("gemma4", "gemma4_text"),
                ("llama", "llama"),
                ("qwen2", "qwen2"),
                ("qwen3", "qwen3"),
                ("qwen3moe", "qwen3_moe")
            ]
        );
        assert_eq!(find("mistral").map(|a| a.name), Some("llama"));
        assert!(find("qwen9").is_none());
    }

    fn base(mt: &str) -> Value {
        json!({"model_type": mt, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "intermediate_size": 512})
    }

    #[test]
    fn layouts_per_architecture() {
        let mut g = base("gemma3_text");
        g["sliding_window"] = json!(16);
        g["sliding_window_pattern"] = json!(2);
        let l = layout_of(&g).unwrap().unwrap();
        let attn: Vec<_> = l.iter().map(|l| l.attn).collect();
        let s = AttnKind::Sliding { window: 16 };
        assert_eq!(attn, [s, AttnKind::Full, s, AttnKind::Full]);

        let mut m = base("qwen3_moe");
        m["num_experts"] = json!(8);
        m["num_experts_per_tok"] = json!(2);
        m["moe_intermediate_size"] = json!(128);
        m["mlp_only_layers"] = json!([1]);
        m["decoder_sparse_step"] = json!(1);
        m["norm_topk_prob"] = json!(true);
        let l = layout_of(&m).unwrap().unwrap();
        let moe = FfnKind::Moe { experts: 8, top_k: 2, intermediate: 128, shared: 0, norm_topk_prob: true };
        let ffn: Vec<_> = l.iter().map(|l| l.ffn).collect();
        assert_eq!(ffn, [moe, FfnKind::Dense { intermediate: 512 }, moe, moe]);
        assert!(l.iter().all(|l| l.attn == AttnKind::Full && l.kv_elems() == 2 * 64 * 2));
        m["num_experts_per_tok"] = json!(9);
        assert!(layout_of(&m)
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("num_experts_per_tok 9 exceeds num_experts 8"));

        // mixtral: a MoE in every layer, intermediate_size the experts' width, mlx-lm's defaults
        // (8 experts, 2 per token) for what the config leaves out; full attention even with a window
        let mut x = base("mixtral");
        x["sliding_window"] = json!(4);
        let l = layout_of(&x).unwrap().unwrap();
        let moe = FfnKind::Moe { experts: 8, top_k: 2, intermediate: 512, shared: 0, norm_topk_prob: true };
        assert!(l.iter().all(|l| l.ffn == moe && l.attn == AttnKind::Full));
        x["num_local_experts"] = json!(2);
        x["num_experts_per_tok"] = json!(3);
        assert!(layout_of(&x)
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("num_experts_per_tok 3 exceeds num_local_experts 2"));

        // glm4_moe: the first first_k_dense_replace layers dense, then routed + shared experts
        let mut g = base("glm4_moe");
        for (k, v) in [
            ("n_routed_experts", json!(16)),
            ("num_experts_per_tok", json!(4)),
            ("moe_intermediate_size", json!(64)),
            ("n_shared_experts", json!(1)),
            ("first_k_dense_replace", json!(1)),
            ("norm_topk_prob", json!(true)),
        ] {
            g[k] = v;
        }
        let moe = FfnKind::Moe { experts: 16, top_k: 4, intermediate: 64, shared: 1, norm_topk_prob: true };
        let ffn: Vec<_> = layout_of(&g).unwrap().unwrap().iter().map(|l| l.ffn).collect();
        assert_eq!(ffn, [FfnKind::Dense { intermediate: 512 }, moe, moe, moe]);
        g["n_shared_experts"] = Value::Null;
        assert!(layout_of(&g)
            .unwrap()
            .unwrap()
            .iter()
            .skip(1)
            .all(|l| matches!(l.ffn, FfnKind::Moe { shared: 0, .. })));

        // gpt_oss: sliding and full layers alternating (sliding first) without layer_types, the
        // window mlx-lm's default 128 when the config has none; a MoE everywhere
        let mut o = base("gpt_oss");
        o["num_local_experts"] = json!(32);
        let l = layout_of(&o).unwrap().unwrap();
        let s = AttnKind::Sliding { window: 128 };
        assert_eq!(l.iter().map(|l| l.attn).collect::<Vec<_>>(), [s, AttnKind::Full, s, AttnKind::Full]);
        let moe = FfnKind::Moe { experts: 32, top_k: 4, intermediate: 512, shared: 0, norm_topk_prob: true };
        assert!(l.iter().all(|l| l.ffn == moe));
        o["layer_types"] = json!(["full_attention", "sliding_attention", "sliding_attention", "full_attention"]);
        o["sliding_window"] = json!(8);
        let attn: Vec<_> = layout_of(&o).unwrap().unwrap().iter().map(|l| l.attn).collect();
        assert_eq!(attn[..3], [AttnKind::Full, AttnKind::Sliding { window: 8 }, AttnKind::Sliding { window: 8 }]);
        o["layer_types"] = json!(["full_attention", "chunked_attention", "full_attention", "full_attention"]);
        assert!(layout_of(&o).unwrap().unwrap_err().to_string().contains("\"chunked_attention\" is not"));
    }

    /// deepseek_v3: every layer caches one latent + one rope key per token (mlx-lm's MLA cache),
    /// whatever the heads; dense layers before first_k_dense_replace and off moe_layer_freq.
    #[test]
    fn latent_attention_caches_the_latent_and_rope_key() {
        let mut c = json!({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 4,
                           "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
                           "intermediate_size": 18432, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                           "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
                           "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                           "first_k_dense_replace": 1, "moe_layer_freq": 2});
        let l = layout_of(&c).unwrap().unwrap();
        assert!(l
            .iter()
            .all(|l| l.attn == AttnKind::Latent { rank: 512, rope_dims: 64, index_dims: 0 } && l.kv_elems() == 576));
        let moe = FfnKind::Moe { experts: 256, top_k: 8, intermediate: 2048, shared: 1, norm_topk_prob: true };
        let dense = FfnKind::Dense { intermediate: 18432 };
        assert_eq!(l.iter().map(|l| l.ffn).collect::<Vec<_>>(), [dense, dense, moe, dense]);
        // 576 elements per token and layer, not 128 heads × (192 + 128)
        let shape = super::super::ModelShape::new("deepseek_v3", l, 7168, 129280, None, 2);
        assert_eq!(shape.kv_bytes(256, None, 64), 4 * 256 * 576 * 2);
        // deepseek_v32: the indexer's key (index_head_dim) cached beside the latent
        c["model_type"] = json!("deepseek_v32");
        c["index_head_dim"] = json!(128);
        assert!(layout_of(&c).unwrap().unwrap().iter().all(|l| l.kv_elems() == 576 + 128));
        c["qk_rope_head_dim"] = json!(33);
        assert!(layout_of(&c).unwrap().unwrap_err().to_string().contains("qk_rope_head_dim 33 is odd"));
    }

    #[test]
    fn caches_follow_the_layout() {
        let full =
            LayerLayout { attn: AttnKind::Full, kv_heads: 2, head_dim: 64, ffn: FfnKind::Dense { intermediate: 1 } };
        let slide = LayerLayout { attn: AttnKind::Sliding { window: 16 }, ..full };
        let shape = super::super::ModelShape::new("x", vec![slide, full], 256, 512, None, 4);
        assert_eq!(shape.sliding, [Some(16), None]);
        // 300 tokens: 512 slots in the full layer, 16 in the sliding one, 256 elements × 4 bytes each
        assert_eq!(shape.kv_bytes(300, None, 64), (512 + 16) * 256 * 4);
    }
}
