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
    /// Reads the KV cache of layer `from` (no cache of its own). Not used by any architecture yet.
    SharedKv { from: usize },
    /// A fixed-size recurrent state instead of a KV cache. Not used by any architecture yet.
    LinearRecurrent,
}

/// The feed-forward part of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnKind {
    Dense { intermediate: i32 },
    /// `experts` routed experts of width `intermediate`, `top_k` of them per token, plus
    /// `shared` always-on experts; the router's top-k probabilities renormalised when
    /// `norm_topk_prob`.
    Moe { experts: i32, top_k: i32, intermediate: i32, shared: i32, norm_topk_prob: bool },
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
            AttnKind::SharedKv { .. } | AttnKind::LinearRecurrent => 0,
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
/// for the others a growing one (a rotating one of `max_kv_size` when set).
pub fn make_cache(layers: &[LayerLayout], opts: &CacheOptions) -> Vec<LayerCache> {
    layers
        .iter()
        .map(|l| match (l.attn, opts.max_kv_size) {
            (AttnKind::Sliding { window }, _) => LayerCache::rotating(window, 0),
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
