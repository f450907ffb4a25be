//! Architectures, one file per Hugging Face `model_type`, and the one registry that maps a config
//! to an implementation.
pub mod arch;
pub mod decode_attn;
pub mod deepseek_v3;
pub mod deepseek_v32;
pub mod experts;
pub mod gated_delta;
pub mod gemma3_text;
pub mod gemma4_text;
pub mod glm4_moe;
pub mod glm_moe_dsa;
pub mod gpt_oss;
pub mod greedy;
pub mod layers;
pub mod llama;
pub mod ministral3;
pub mod mistral3;
pub mod mistral4;
pub mod mixtral;
pub mod qmv;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod sdpa;

pub use arch::{Arch, AttnKind, FfnKind, LayerLayout};

use crate::cache::{CacheOptions, Caches, LayerCache};
use crate::error::{Error, Result};
use crate::handle::Array;
use crate::weights::Weights;
use serde_json::Value;

/// Shape facts about a loaded model, for the cache planner and statistics.
#[derive(Clone, Debug, Default)]
pub struct ModelShape {
    pub model_type: String,
    pub num_layers: i32,
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    /// Per layer: Some(window) for sliding-window layers.
    pub sliding: Vec<Option<i32>>,
    pub max_position_embeddings: Option<i32>,
    /// Bytes per element of activations and of an unquantized KV cache.
    pub dtype_bytes: usize,
    /// Per layer: its attention, KV geometry and FFN (the architecture's [`Arch::layout`]).
    pub layers: Vec<LayerLayout>,
}

impl ModelShape {
    /// The shape of a model of `layers`: the KV geometry and sliding windows from the layout
    /// (`num_kv_heads`/`head_dim` those of the first layer with a KV cache).
    pub fn new(
        model_type: &str,
        layers: Vec<LayerLayout>,
        hidden_size: i32,
        vocab_size: i32,
        max_position_embeddings: Option<i32>,
        dtype_bytes: usize,
    ) -> ModelShape {
        let kv = layers.iter().find(|l| l.kv_elems() > 0).or(layers.first());
        ModelShape {
            model_type: model_type.to_string(),
            num_layers: layers.len() as i32,
            hidden_size,
            vocab_size,
            num_kv_heads: kv.map_or(0, |l| l.kv_heads),
            head_dim: kv.map_or(0, |l| l.head_dim),
            sliding: layers
                .iter()
                .map(|l| if let AttnKind::Sliding { window } = l.attn { Some(window) } else { None })
                .collect(),
            max_position_embeddings,
            dtype_bytes,
            layers,
        }
    }

    /// Cache bytes for `tokens` tokens of one sequence: full layers in steps of 256 slots,
    /// sliding layers at most their window, plus the fixed state of its recurrent layers
    /// ([`ModelShape::state_bytes`]) (the engine's admission; `plan.rs` plans the same way).
    pub fn kv_bytes(&self, tokens: usize, kv_bits: Option<i32>, group: i32) -> usize {
        let per = |elems: f64| match kv_bits {
            Some(b) => elems * (b as f64 / 8.0 + 2.0 * self.dtype_bytes as f64 / group.max(1) as f64),
            None => elems * self.dtype_bytes as f64,
        };
        let slots = tokens.div_ceil(256) * 256;
        let total: f64 = self.layers.iter().map(|l| l.kv_slots(slots) as f64 * per(l.kv_elems() as f64)).sum();
        total.ceil() as usize + self.state_bytes()
    }

    /// The fixed-size state one sequence holds whatever its length: every linear-attention layer's
    /// convolution inputs and recurrent state ([`LayerLayout::state_bytes`]; 0 without such layers).
    pub fn state_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.state_bytes(self.dtype_bytes)).sum()
    }
}

/// A causal language model: tokens in, logits out, over a cache it does not own.
pub trait CausalLm: Send {
    /// Logits `[B, L, vocab]` for `tokens` `[B, L]`, appending to `cache`. Builds the whole graph
    /// lazily (nothing is evaluated).
    fn forward(&self, tokens: &Array, cache: &mut [LayerCache]) -> Result<Array> {
        self.forward_caches(tokens, &mut Caches::one(cache), Staging::NONE)
    }
    /// [`CausalLm::forward`], evaluating the hidden state and the cache between decoder layers as
    /// `staging` says (see [`Stager`]). The prefill uses it on GPU backends.
    fn forward_staged(&self, tokens: &Array, cache: &mut [LayerCache], staging: Staging) -> Result<Array> {
        self.forward_caches(tokens, &mut Caches::one(cache), staging)
    }
    /// The forward pass over one cache per batch row: `tokens` `[B, L]`, B the rows of `caches`.
    /// The engine's batched decode step runs several sequences (each its own cache) through it.
    fn forward_caches(&self, tokens: &Array, caches: &mut Caches, staging: Staging) -> Result<Array>;
    /// The final normed hidden state `[B, L, hidden]` (what the LM head reads) for `tokens`
    /// `[B, L]`, appending to `caches`: the embeddings of `/v1/embeddings` are pooled from it.
    fn hidden_caches(&self, tokens: &Array, caches: &mut Caches, staging: Staging) -> Result<Array>;
    /// The token embeddings `[B, L, hidden]` of `tokens` as the architecture's multimodal merge
    /// takes them (mlx-vlm's): before any input scaling (Gemma 3), or scaled (Gemma 4, whose
    /// `get_input_embeddings` scales before it merges): what a multimodal merge replaces positions of.
    fn embed_tokens(&self, _tokens: &Array) -> Result<Array> {
        Err(Error::Unsupported(format!("{} takes no input embeddings", self.shape().model_type)))
    }
    /// Per-layer input embeddings `[B, L, W]` of `tokens` for architectures that give every layer
    /// an input of its own (Gemma 4's `embed_tokens_per_layer`); None for the others. A multimodal
    /// prompt passes them to [`CausalLm::forward_embeds`] as trailing columns of its embeddings.
    fn embed_per_layer(&self, _tokens: &Array) -> Result<Option<Array>> {
        Ok(None)
    }
    /// Logits `[B, L, vocab]` from input embeddings `[B, L, hidden]` (as [`CausalLm::embed_tokens`]
    /// gives them, positions replaced) in place of tokens, appending to `caches`; the architecture
    /// scales them as it scales its own token embeddings (mlx-vlm's `inputs_embeds`): Gemma 3 in
    /// here, Gemma 4 already in `embed_tokens`, whose per-layer inputs follow in trailing columns.
    fn forward_embeds(&self, _embeds: &Array, _caches: &mut Caches, _staging: Staging) -> Result<Array> {
        Err(Error::Unsupported(format!("{} takes no input embeddings", self.shape().model_type)))
    }
    /// A fresh cache for this model (from its layout).
    fn make_cache(&self, opts: &CacheOptions) -> Vec<LayerCache> {
        arch::make_cache(&self.shape().layers, opts)
    }
    fn shape(&self) -> &ModelShape;
    /// Whether the engine may decode a batch over the stacked KV ([`crate::cache::BatchKv`]) of
    /// this model's full caches (deepseek_v32's indexer may not: see there).
    fn stackable(&self) -> bool {
        true
    }
}

/// When a forward pass evaluates between decoder layers ([`CausalLm::forward_staged`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Staging {
    /// Evaluate after every `every` decoder layers; 0: never (one graph, as [`CausalLm::forward`]).
    pub every: usize,
    /// Queue the next stage before waiting for the previous one, so that the GPU never waits for the
    /// host to build a layer's graph; two (or, while MLX releases the oldest, three) stages'
    /// intermediates are then alive at once.
    pub lookahead: bool,
}

impl Staging {
    /// One graph for the whole pass.
    pub const NONE: Staging = Staging { every: 0, lookahead: false };
}

/// Runs a [`Staging`] inside a forward pass: call [`Stager::after_layer`] after every decoder layer.
///
/// Why: evaluating a prefill chunk as one graph of all layers keeps several layers' intermediates
/// alive at once on a GPU, where MLX releases a buffer only once the GPU has run the kernels using
/// it (measured on an H200, MLX's CUDA backend: peaks up to 2.8× the per-layer plan,
/// bench/RESULTS-fit.md). The values do not change: the same kernels run on the same inputs.
/// [`crate::generate::prefill_staging`] says when the prefill stages.
pub struct Stager {
    staging: Staging,
    pending: Option<Array>,
}

impl Stager {
    pub fn new(staging: Staging) -> Stager {
        Stager { staging, pending: None }
    }

    /// After decoder layer `i` of `n`: at a stage boundary, evaluate the hidden state `h` and the
    /// caches of the layers since the previous stage. Not after the last layer: the prefill only
    /// needs the caches, which the caller evaluates.
    pub fn after_layer(&mut self, i: usize, n: usize, h: &Array, caches: &Caches) -> Result<()> {
        let every = self.staging.every;
        if every == 0 || !(i + 1).is_multiple_of(every) || i + 1 >= n {
            return Ok(());
        }
        let lo = (i + 1).saturating_sub(every);
        let mut arrays: Vec<&Array> = vec![h];
        arrays.extend(caches.state(lo, i));
        // stages of one pass: the pass has not been evaluated yet (models::sdpa)
        if !self.staging.lookahead {
            return crate::handle::eval_stage(&arrays);
        }
        crate::handle::async_eval_stage(&arrays)?;
        match self.pending.replace(h.clone()) {
            Some(prev) => crate::handle::eval_stage(&[&prev]),
            None => Ok(()),
        }
    }
}

/// What the decoders of every architecture share (llama.rs, gemma3_text.rs, gemma4_text.rs,
/// deepseek_v3.rs, qwen3_next.rs): [`LayerMasks`] (one mask per attention kind) and [`run_layers`]
/// (the walk over the layers with the cache of each and the prefill's staging). What each layer
/// computes stays in its architecture's file, because that is where they differ in substance: the
/// residual form (Gemma's four norms and float16 clipping, Llama 4's query scale, Gemma 4's
/// KV-sharing, per-layer inputs and layer scalar, Qwen3-Next's linear-attention mixers and M-RoPE),
/// and so do the final norm and head (Gemma 4's logit softcap; the others `Embedding::logits`).
///
/// The attention masks of one forward pass: one per attention kind present, each built from the
/// first layer of that kind (its cache holds the positions every layer of that kind sees).
pub struct LayerMasks {
    full: Option<crate::cache::Masks>,
    sliding: Option<crate::cache::Masks>,
}

impl LayerMasks {
    /// `kinds`: per layer, Some(true) for sliding-window attention (over `window` positions), Some(false) for
    /// full attention, None for a layer without a mask (linear attention).
    pub fn new(
        caches: &Caches,
        n: i32,
        kinds: impl IntoIterator<Item = Option<bool>>,
        window: Option<i32>,
    ) -> Result<LayerMasks> {
        let kinds: Vec<Option<bool>> = kinds.into_iter().collect();
        let first = |sliding: bool| kinds.iter().position(|&k| k == Some(sliding));
        Ok(LayerMasks {
            full: first(false).map(|i| caches.masks(i, n, None)).transpose()?,
            sliding: first(true).map(|i| caches.masks(i, n, window)).transpose()?,
        })
    }

    /// The mask of a full (`sliding` false) or sliding-window attention layer.
    pub fn get(&self, sliding: bool) -> Result<&crate::cache::Masks> {
        if sliding { &self.sliding } else { &self.full }.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "no {} attention layer to build its mask from",
                if sliding { "sliding" } else { "full" }
            ))
        })
    }
}

/// The decoder's walk over `n_layers` layers from the input hidden state `h`: `layer(i, h, caches)`
/// returns layer `i`'s output, and the [`Stager`] evaluates the prefill's stages between layers.
/// Returns the last layer's output (the final norm is the architecture's).
pub fn run_layers(
    n_layers: usize,
    mut h: Array,
    caches: &mut Caches,
    staging: Staging,
    mut layer: impl FnMut(usize, &Array, &mut Caches) -> Result<Array>,
) -> Result<Array> {
    let mut stager = Stager::new(staging);
    for i in 0..n_layers {
        h = layer(i, &h, caches)?;
        stager.after_layer(i, n_layers, &h, caches)?;
    }
    Ok(h)
}

/// The pre-norm residual layer of DeepSeek-V3 and Qwen3-Next: `h + mixer(in_norm(h))`, then that
/// plus `ffn(post_norm(·))` (`mixer` is the layer's attention, or linear attention). Llama's layers
/// add their residuals in the products' kernels instead (`layers::Attention::forward_normed_add`).
pub fn pre_norm_residual(
    h: &Array,
    in_norm: &layers::RmsNorm,
    mixer: impl FnOnce(&Array) -> Result<Array>,
    post_norm: &layers::RmsNorm,
    ffn: impl FnOnce(&Array) -> Result<Array>,
) -> Result<Array> {
    let hh = crate::handle::add(h, &mixer(&in_norm.forward(h)?)?)?;
    crate::handle::add(&hh, &ffn(&post_norm.forward(&hh)?)?)
}

/// The architecture table: one line per architecture, each declared in its own file.
pub static ARCHS: &[Arch] = &[
    llama::ARCH,
    qwen2::ARCH,
    qwen3::ARCH,
    qwen3_moe::ARCH,
    gemma3_text::ARCH,
    gemma4_text::ARCH,
    qwen3_next::ARCH,
    qwen3_5::ARCH,
    qwen3_5_moe::ARCH,
    mixtral::ARCH,
    glm4_moe::ARCH,
    gpt_oss::ARCH,
    deepseek_v3::ARCH,
    deepseek_v32::ARCH,
    glm_moe_dsa::ARCH,
    mistral4::ARCH,
    mistral3::ARCH,
    ministral3::ARCH,
];

/// `config` as an architecture's `ModelArgs` reads it: the fields of `drop` removed, and each of
/// `defaults` set where the config leaves it out (absent or null).
pub(crate) fn with_defaults(config: &Value, drop: &[&str], defaults: &[(&str, Value)]) -> Value {
    let mut c = config.clone();
    if let Some(o) = c.as_object_mut() {
        for k in drop {
            o.remove(*k);
        }
        for (k, v) in defaults {
            if o.get(*k).is_none_or(Value::is_null) {
                o.insert(k.to_string(), v.clone());
            }
        }
    }
    c
}

/// Every supported `model_type`, aliases included (from [`ARCHS`]).
pub fn supported() -> Vec<&'static str> {
    arch::supported()
}

/// Build the model a config describes from its weights (after that architecture's sanitize).
pub fn build(config: &Value, mut weights: Weights) -> Result<Box<dyn CausalLm>> {
    let mt = config
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::ModelLoad("config.json has no model_type".into()))?;
    let arch = arch::find(mt).ok_or_else(|| {
        Error::Unsupported(format!("model_type {mt:?} is not supported; supported: {}", supported().join(", ")))
    })?;
    (arch.sanitize)(config, &mut weights)?;
    // an FP8 checkpoint of an architecture whose sanitize does not dequantize it (mlx-lm's neither)
    if crate::weights::fp8_block(config)?.is_some() {
        if let Some(k) = weights.first_fp8() {
            return Err(Error::Unsupported(format!(
                "weight {k}: an FP8 checkpoint of model_type {mt:?}, which neither mlxrs nor mlx-lm dequantizes (convert it with mlx_lm.convert)"
            )));
        }
    }
    (arch.load)(config, weights)
}

/// Upper bounds on the sizes a config (or GGUF metadata) may give: far above every released model,
/// they keep a corrupt or hostile file from sizing allocations (`num_hidden_layers = 1e9` would
/// otherwise abort the process before any weight is looked at).
pub mod limits {
    pub const LAYERS: i64 = 1024;
    pub const HIDDEN: i64 = 1 << 17;
    pub const HEADS: i64 = 1024;
    pub const HEAD_DIM: i64 = 1024;
    pub const VOCAB: i64 = 1 << 22;
    pub const INTERMEDIATE: i64 = 1 << 20;
    /// Experts of a MoE layer (and experts per token).
    pub const EXPERTS: i64 = 1 << 12;
    /// Sliding windows and context lengths.
    pub const POSITIONS: i64 = 1 << 30;
}

/// The sizes a decoder is built from, each checked positive, bounded ([`limits`]) and consistent
/// with the others before anything is allocated from them; the weights' shapes are then checked
/// against them as each tensor is taken (`Weights::take_matrix`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub hidden: i32,
    pub layers: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub vocab: i32,
    /// None: not in the config (the MLP's shape then comes from its first gate_proj).
    pub intermediate: Option<i32>,
}

/// Defaults for fields a config may leave out (Gemma 3's; none for the llama family).
#[derive(Clone, Copy, Default)]
pub struct DimDefaults {
    pub hidden: Option<i64>,
    pub layers: Option<i64>,
    pub heads: Option<i64>,
    pub kv_heads: Option<i64>,
    pub head_dim: Option<i64>,
    pub vocab: Option<i64>,
}

impl Dims {
    pub fn from_config(c: &Cfg, d: DimDefaults) -> Result<Dims> {
        use limits::*;
        let hidden = c.size("hidden_size", d.hidden, HIDDEN)?;
        let layers = c.size("num_hidden_layers", d.layers, LAYERS)?;
        let heads = c.size("num_attention_heads", d.heads, HEADS)?;
        let kv_heads = c.size("num_key_value_heads", Some(d.kv_heads.unwrap_or(heads as i64)), HEADS)?;
        let head_dim = match (c.get("head_dim"), d.head_dim) {
            (None, None) if hidden % heads != 0 => {
                return Err(Error::ModelLoad(format!(
                    "config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and there is no head_dim)"
                )))
            }
            (None, None) => hidden / heads,
            (_, def) => c.size("head_dim", def, HEAD_DIM)?,
        };
        if head_dim % 2 != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: head_dim {head_dim} is odd (the rotary embedding rotates pairs)"
            )));
        }
        if heads % kv_heads != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )));
        }
        let vocab = c.size("vocab_size", d.vocab, VOCAB)?;
        let intermediate = match c.get("intermediate_size") {
            Some(_) => Some(c.size("intermediate_size", None, INTERMEDIATE)?),
            None => None,
        };
        Ok(Dims { hidden, layers, heads, kv_heads, head_dim, vocab, intermediate })
    }

    /// The MLP width: the config's, else the first layer's gate_proj rows.
    pub fn intermediate(&self, w: &Weights) -> Result<i32> {
        self.intermediate
            .or_else(|| w.rows_of("model.layers.0.mlp.gate_proj"))
            .ok_or_else(|| Error::ModelLoad("config.json: intermediate_size is missing".into()))
    }
}

/// Config accessors with clear errors.
pub struct Cfg<'a>(pub &'a Value);

impl Cfg<'_> {
    /// A size field: an integer in 1..=max (`default` when absent), else an error naming it.
    pub fn size(&self, k: &str, default: Option<i64>, max: i64) -> Result<i32> {
        let v = match self.get(k) {
            None => {
                default.ok_or_else(|| Error::ModelLoad(format!("config.json: {k} is missing or not an integer")))?
            }
            Some(v) => {
                v.as_i64().ok_or_else(|| Error::ModelLoad(format!("config.json: {k} = {v} is not an integer")))?
            }
        };
        if !(1..=max).contains(&v) {
            return Err(Error::ModelLoad(format!("config.json: {k} = {v} is out of range (1..={max})")));
        }
        Ok(v as i32)
    }
    pub fn opt_i(&self, k: &str) -> Option<i32> {
        self.0.get(k).and_then(Value::as_i64).map(|v| v as i32)
    }
    pub fn f_or(&self, k: &str, d: f64) -> f64 {
        self.0.get(k).and_then(Value::as_f64).unwrap_or(d)
    }
    pub fn b_or(&self, k: &str, d: bool) -> bool {
        self.0.get(k).and_then(Value::as_bool).unwrap_or(d)
    }
    pub fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn sizes_are_bounded_and_consistent() {
        let ok = json!({"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512});
        let d = Dims::from_config(&Cfg(&ok), DimDefaults::default()).unwrap();
        assert_eq!((d.heads, d.kv_heads, d.head_dim, d.intermediate), (4, 2, 64, None));
        let with = |k: &str, v: Value| {
            let mut c = ok.clone();
            c[k] = v;
            Dims::from_config(&Cfg(&c), DimDefaults::default()).unwrap_err().to_string()
        };
        assert!(
            with("num_hidden_layers", json!(1_000_000_000)).contains("num_hidden_layers = 1000000000 is out of range")
        );
        assert!(with("num_hidden_layers", json!(0)).contains("out of range"));
        // 2^32 + 2 would wrap to 2 as an i32
        assert!(with("num_hidden_layers", json!(4_294_967_298u64)).contains("out of range"));
        assert!(with("head_dim", json!(1_000_000)).contains("head_dim = 1000000"));
        assert!(with("num_attention_heads", json!(0)).contains("num_attention_heads = 0"));
        assert!(with("num_attention_heads", json!(3)).contains("not a multiple"));
        assert!(with("hidden_size", json!(1e9)).contains("not an integer"));
        assert!(with("head_dim", json!(33)).contains("odd"));
        let mut no_hd = ok.clone();
        no_hd.as_object_mut().unwrap().remove("head_dim");
        no_hd["hidden_size"] = json!(250);
        assert!(Dims::from_config(&Cfg(&no_hd), DimDefaults::default())
            .unwrap_err()
            .to_string()
            .contains("not a multiple"));
    }

    fn value() -> impl Strategy<Value = Value> {
        prop_oneof![
            (-3i64..70).prop_map(Value::from),
            prop::sample::select(vec![1i64 << 31, (1 << 31) - 1, 1 << 32, i64::MAX, 1_000_000_000, 262_144])
                .prop_map(Value::from),
            any::<f64>().prop_map(|f| json!(f)),
            Just(Value::Null),
            Just(json!("64")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// Arbitrary size fields: never a panic; accepted sizes are in range and consistent.
        #[test]
        fn accepted_configs_are_consistent(vals in prop::collection::vec(value(), 7), gemma in any::<bool>()) {
            let keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "vocab_size", "intermediate_size"];
            let cfg = Value::Object(keys.iter().map(|k| k.to_string()).zip(vals).collect());
            let defaults = if gemma {
                DimDefaults { hidden: Some(1152), layers: Some(26), heads: Some(4), kv_heads: Some(1), head_dim: Some(256), vocab: Some(262144) }
            } else {
                DimDefaults::default()
            };
            if let Ok(d) = Dims::from_config(&Cfg(&cfg), defaults) {
                use limits::*;
                for (v, max) in [(d.hidden, HIDDEN), (d.layers, LAYERS), (d.heads, HEADS), (d.kv_heads, HEADS),
                                 (d.head_dim, HEAD_DIM), (d.vocab, VOCAB), (d.intermediate.unwrap_or(1), INTERMEDIATE)] {
                    prop_assert!(v >= 1 && v as i64 <= max);
                }
                prop_assert_eq!(d.heads % d.kv_heads, 0);
                prop_assert_eq!(d.head_dim % 2, 0);
            }
        }
    }
}
