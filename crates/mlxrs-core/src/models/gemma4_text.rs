//! Gemma 4 (text), mlx-lm 0.32.2's `models/gemma4_text.py` (and `models/gemma4.py`, whose
//! multimodal config nests it in `text_config`):
//! - sliding-window and global layers as `layer_types` says (else every `sliding_window_pattern`-th
//!   layer global), each type with its own head dim (`head_dim`, `global_head_dim`) and rotary
//!   embedding (`rope_parameters`: the global layers' "proportional" one rotates only
//!   `partial_rotary_factor` of the features);
//! - KV shared across layers: the last `num_kv_shared_layers` layers compute no keys or values and
//!   attend over those of the last earlier layer of their type (their cache is a placeholder,
//!   [`AttnKind::SharedKv`]); their MLP is twice as wide (`use_double_wide_mlp`);
//! - q/k norms, a scale-free v norm, attention scale 1; `attention_k_eq_v`: the global layers' values
//!   are their keys before the norms (with `num_global_key_value_heads` heads);
//! - per-layer input embeddings (`hidden_size_per_layer_input`): a second embedding table and a
//!   projection of the embeddings give every layer a gated extra input;
//! - `enable_moe_block`: a routed GeGLU mixture of experts beside the dense MLP, each with its norms;
//! - a learned per-layer output scalar, sandwich norms, sqrt(hidden)-scaled embeddings, tanh
//!   soft-capped logits.
use super::arch::{Arch, AttnKind, FfnKind, LayerLayout};
use super::layers::{self, Activation, Embedding, Experts, Linear, Mlp, RmsNorm, Rope};
use super::{limits, CausalLm, Cfg, DimDefaults, Dims, ModelShape};
use crate::cache::{Caches, Fetched, LayerCache, LayerCaches, Masks};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, AttnMask};
use crate::weights::Weights;
use serde_json::{json, Value};

pub const ARCH: Arch = Arch {
    name: "gemma4_text",
    model_types: &["gemma4_text", "gemma4"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w)?)),
    layout,
    gguf: Some("gemma4"),
};

const DEFAULTS: DimDefaults = DimDefaults {
    hidden: Some(1536),
    layers: Some(35),
    heads: Some(8),
    kv_heads: Some(1),
    head_dim: Some(256),
    vocab: Some(262144),
};

fn is_wrapper(config: &Value) -> bool {
    config.get("model_type").and_then(Value::as_str) == Some("gemma4")
}

/// The text model's config: the config itself, or a `gemma4` config's `text_config` with the
/// wrapper's `vocab_size` (mlx-lm's `gemma4.ModelArgs.__post_init__`).
fn text_config(config: &Value) -> Result<Value> {
    if !is_wrapper(config) {
        return Ok(config.clone());
    }
    let mut t = match config.get("text_config") {
        None | Some(Value::Null) => json!({}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(v) => return Err(Error::ModelLoad(format!("config.json: text_config = {v} is not an object"))),
    };
    t["vocab_size"] = config.get("vocab_size").cloned().unwrap_or(json!(262144));
    for (k, d) in [("num_attention_heads", 8), ("num_key_value_heads", 1)] {
        if t.get(k).is_none() {
            t[k] = json!(d);
        }
    }
    Ok(t)
}

/// Everything the layout and the loader read from the config, checked.
struct Params {
    d: Dims,
    intermediate: i32,
    /// Per layer: sliding (else global).
    sliding: Vec<bool>,
    /// Per layer: the layer whose keys and values it reads (KV-shared layers).
    shared_from: Vec<Option<usize>>,
    first_shared: usize,
    window: i32,
    global_head_dim: i32,
    /// KV heads of the global layers (`num_global_key_value_heads` with `attention_k_eq_v`).
    global_kv_heads: i32,
    k_eq_v: bool,
    double_wide: bool,
    /// (experts, top_k, width) of the MoE block.
    moe: Option<(i32, i32, i32)>,
    per_layer: i32,
    vocab_per_layer: i32,
    eps: f32,
    softcap: Option<f32>,
    tie: bool,
}

impl Params {
    fn new(config: &Value) -> Result<Params> {
        let text = text_config(config)?;
        let c = Cfg(&text);
        let mut d = Dims::from_config(&c, DEFAULTS)?;
        let n = d.layers as usize;
        let intermediate = c.size("intermediate_size", Some(6144), limits::INTERMEDIATE)?;
        d.intermediate = Some(intermediate);
        let window = c.size("sliding_window", Some(512), limits::POSITIONS)?;
        let sliding: Vec<bool> = match c.get("layer_types") {
            Some(Value::Array(a)) => {
                if a.len() != n {
                    return Err(Error::ModelLoad(format!(
                        "config.json: layer_types has {} entries but num_hidden_layers is {n}",
                        a.len()
                    )));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(Error::ModelLoad(format!(
                            "config.json: layer_types[{i}] = {t} is not \"sliding_attention\" or \"full_attention\""
                        ))),
                    })
                    .collect::<Result<_>>()?
            }
            Some(v) => return Err(Error::ModelLoad(format!("config.json: layer_types = {v} is not a list"))),
            None => {
                let p = c.size("sliding_window_pattern", Some(5), limits::LAYERS)? as usize;
                (0..n).map(|i| i % p != p - 1).collect()
            }
        };
        // mlx-lm's default: 20
        let shared_v = c.get("num_kv_shared_layers").cloned().unwrap_or(json!(20));
        let shared = shared_v.as_i64().filter(|s| (0..n as i64).contains(s)).ok_or_else(|| {
            Error::ModelLoad(format!(
                "config.json: num_kv_shared_layers = {shared_v} is out of range (0..{n}: at least one layer must keep its keys)"
            ))
        })? as usize;
        let first_shared = n - shared;
        // a shared layer reads the last layer of its type before the first shared one
        let shared_from = (0..n)
            .map(|i| {
                if i < first_shared {
                    return Ok(None);
                }
                (0..first_shared).rev().find(|&j| sliding[j] == sliding[i]).map(Some).ok_or_else(|| {
                    Error::ModelLoad(format!(
                        "config.json: layer {i} shares the keys and values of an earlier {} layer (num_kv_shared_layers = \
                         {shared}), but layer_types has none before layer {first_shared}",
                        if sliding[i] { "sliding_attention" } else { "full_attention" }
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // mlx-lm: a global_head_dim that is absent is 512, one that is null or 0 the head_dim
        let global_head_dim = match text.get("global_head_dim") {
            None => 512,
            Some(v) if v.is_null() || v.as_i64() == Some(0) => d.head_dim,
            Some(_) => c.size("global_head_dim", None, limits::HEAD_DIM)?,
        };
        if global_head_dim % 2 != 0 {
            return Err(Error::ModelLoad(format!("config.json: global_head_dim {global_head_dim} is odd")));
        }
        let k_eq_v = c.b_or("attention_k_eq_v", false);
        let global_kv_heads = match c.get("num_global_key_value_heads") {
            Some(_) if k_eq_v => c.size("num_global_key_value_heads", None, limits::HEADS)?,
            _ => d.kv_heads,
        };
        if d.heads % global_kv_heads != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: num_attention_heads {} is not a multiple of num_global_key_value_heads {global_kv_heads}",
                d.heads
            )));
        }
        let moe = if c.b_or("enable_moe_block", false) {
            let e = c.size("num_experts", None, limits::EXPERTS)?;
            let k = c.size("top_k_experts", None, limits::EXPERTS)?;
            if k > e {
                return Err(Error::ModelLoad(format!("config.json: top_k_experts {k} exceeds num_experts {e}")));
            }
            Some((e, k, c.size("moe_intermediate_size", None, limits::INTERMEDIATE)?))
        } else {
            None
        };
        let per_layer = match text.get("hidden_size_per_layer_input") {
            None => 256,
            Some(v) if v.is_null() || v.as_i64() == Some(0) => 0,
            Some(_) => c.size("hidden_size_per_layer_input", None, limits::HIDDEN)?,
        };
        let vocab_per_layer =
            if per_layer > 0 { c.size("vocab_size_per_layer_input", Some(262144), limits::VOCAB)? } else { 0 };
        if (n as i64) * (per_layer as i64) > limits::HIDDEN * 8 {
            return Err(Error::ModelLoad(format!(
                "config.json: num_hidden_layers × hidden_size_per_layer_input = {} is too large",
                n as i64 * per_layer as i64
            )));
        }
        let softcap = match text.get("final_logit_softcapping") {
            None => Some(30.0),
            Some(Value::Null) => None,
            Some(v) => Some(v.as_f64().filter(|f| *f > 0.0).ok_or_else(|| {
                Error::ModelLoad(format!("config.json: final_logit_softcapping = {v} is not a positive number"))
            })? as f32),
        };
        Ok(Params {
            d,
            intermediate,
            sliding,
            shared_from,
            first_shared,
            window,
            global_head_dim,
            global_kv_heads,
            k_eq_v,
            double_wide: c.b_or("use_double_wide_mlp", true),
            moe,
            per_layer,
            vocab_per_layer,
            eps: c.f_or("rms_norm_eps", 1e-6) as f32,
            softcap,
            tie: c.b_or("tie_word_embeddings", true),
        })
    }

    /// Layer `i`'s (KV heads, head dim).
    fn kv_geometry(&self, i: usize) -> (i32, i32) {
        if self.sliding[i] {
            (self.d.kv_heads, self.d.head_dim)
        } else {
            (if self.k_eq_v { self.global_kv_heads } else { self.d.kv_heads }, self.global_head_dim)
        }
    }

    /// Layer `i`'s dense MLP width (doubled on the KV-shared layers with `use_double_wide_mlp`).
    fn mlp_width(&self, i: usize) -> i32 {
        let shared = self.first_shared > 0 && i >= self.first_shared;
        self.intermediate * if self.double_wide && shared { 2 } else { 1 }
    }

    fn layout(&self) -> Vec<LayerLayout> {
        (0..self.sliding.len())
            .map(|i| {
                let (kv_heads, head_dim) = self.kv_geometry(i);
                let attn = match (self.shared_from[i], self.sliding[i]) {
                    (Some(from), _) => AttnKind::SharedKv { from },
                    (None, true) => AttnKind::Sliding { window: self.window },
                    (None, false) => AttnKind::Full,
                };
                // the MoE block runs beside the dense MLP (one always-on "shared expert" of the MLP's
                // width); the layout records the routed part
                let ffn = match self.moe {
                    Some((experts, top_k, intermediate)) => {
                        FfnKind::Moe { experts, top_k, intermediate, shared: 1, norm_topk_prob: true }
                    }
                    None => FfnKind::Dense { intermediate: self.mlp_width(i) },
                };
                LayerLayout { attn, kv_heads, head_dim, ffn }
            })
            .collect()
    }
}

/// Sliding or global layers, KV-shared layers reading an earlier layer's cache.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    Ok(Params::new(config)?.layout())
}

/// mlx-lm's sanitize (`gemma4.py` for the multimodal layout, then `gemma4_text.py`): the vision and
/// audio towers dropped, `model.language_model.*` renamed `language_model.model.*`; rotary tables
/// and activation-range statistics dropped; the KV-shared layers' k/v projections and k norm
/// dropped; the Hugging Face experts' `gate_up_proj` split into `switch_glu.{gate,up}_proj`.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let keys: Vec<String> = w.keys().cloned().collect();
    if is_wrapper(config) {
        const DROP: [&str; 6] =
            ["vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision", "vision_embedder"];
        for k in keys {
            let stripped = k.strip_prefix("model.");
            let rest = stripped.unwrap_or(&k);
            if DROP.iter().any(|p| rest.starts_with(p)) {
                w.remove(&k);
                continue;
            }
            let name = match stripped {
                None => continue,
                Some(r) if r.starts_with("language_model") => r.replace("language_model.", "language_model.model."),
                Some(r) => r.to_string(),
            };
            w.rename(&k, name);
        }
    }
    let p = Params::new(config)?;
    let keys: Vec<String> = w.keys().cloned().collect();
    for k in keys {
        const STATS: [&str; 5] = ["self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min"];
        if STATS.iter().any(|s| k.contains(s)) {
            w.remove(&k);
            continue;
        }
        if [".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm"].iter().any(|s| k.contains(s)) {
            let layer =
                k.split("layers.").nth(1).and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
            if layer.is_some_and(|l| l >= p.first_shared) {
                w.remove(&k);
                continue;
            }
        }
        if let Some(base) = k.strip_suffix(".experts.gate_up_proj") {
            let v = w.remove(&k).expect("listed");
            if v.ndim() != 3 || v.dim(1) % 2 != 0 {
                return Err(Error::ModelLoad(format!(
                    "weight {k} has shape {:?}: not [experts, 2 × width, hidden]",
                    v.shape()
                )));
            }
            let parts = mx::split(&v, 2, -2)?;
            w.insert(format!("{base}.experts.switch_glu.gate_proj.weight"), mx::contiguous(&parts[0])?);
            w.insert(format!("{base}.experts.switch_glu.up_proj.weight"), mx::contiguous(&parts[1])?);
        } else if let Some(base) = k.strip_suffix(".experts.down_proj") {
            let v = w.remove(&k).expect("listed");
            w.insert(format!("{base}.experts.switch_glu.down_proj.weight"), v);
        }
    }
    Ok(())
}

/// The keys and values a layer attended over, for the KV-shared layers that read them.
#[derive(Clone)]
enum SharedKv {
    /// Per row: its rotary offset and what its cache returned.
    Rows(Vec<i32>, Vec<Fetched>),
    /// A stacked decode step's keys and values (offsets from the stack).
    Batch(Array, Array),
}

struct Attn {
    q_proj: Linear,
    /// None on a KV-shared layer.
    k_proj: Option<Linear>,
    /// None on a KV-shared layer and with `attention_k_eq_v` on a global one.
    v_proj: Option<Linear>,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: Option<RmsNorm>,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    eps: f32,
    rope: Rope,
}

impl Attn {
    fn heads(&self, t: &Array, b: i32, l: i32, n: i32) -> Result<Array> {
        mx::reshape(t, &[b, l, n, self.head_dim])
    }

    /// Output `[B, L, hidden]` and the keys/values attended over. `shared`: a KV-shared layer's
    /// source; its own cache (a placeholder) only has its offset kept in step.
    fn forward(
        &self,
        x: &Array,
        masks: &Masks,
        caches: LayerCaches,
        shared: Option<&SharedKv>,
    ) -> Result<(Array, SharedKv)> {
        let (b, l) = (x.dim(0), x.dim(1));
        let perm = [0, 2, 1, 3];
        let q = self.q_norm.forward(&self.heads(&self.q_proj.forward(x)?, b, l, self.n_heads)?)?;
        let q = mx::transpose_axes(&q, &perm)?;
        let kv = match (&self.k_proj, shared) {
            (_, Some(_)) => None,
            (Some(kp), None) => {
                let k_raw = self.heads(&kp.forward(x)?, b, l, self.n_kv_heads)?;
                let v_raw = match &self.v_proj {
                    Some(vp) => self.heads(&vp.forward(x)?, b, l, self.n_kv_heads)?,
                    None => k_raw.clone(),
                };
                let k = self.k_norm.as_ref().expect("a layer with k_proj has k_norm").forward(&k_raw)?;
                let v = mx::rms_norm(&v_raw, None, self.eps)?;
                Some((mx::transpose_axes(&k, &perm)?, mx::transpose_axes(&v, &perm)?))
            }
            (None, None) => {
                return Err(Error::Invalid("gemma4: a KV-shared layer ran without its source layer".into()))
            }
        };
        let (out, kv_out) = match (caches, masks) {
            (LayerCaches::Batch(stack, layer), Masks::Batch(mask, _)) => {
                let offsets = stack.offsets().to_vec();
                let q = self.rope.forward_rows(&q, &offsets)?;
                let (kk, vv) = match (kv, shared) {
                    (Some((k, v)), _) => stack.update_and_fetch(layer, &self.rope.forward_rows(&k, &offsets)?, &v)?,
                    (None, Some(SharedKv::Batch(k, v))) => (k.clone(), v.clone()),
                    _ => return Err(Error::Invalid("gemma4: a stacked layer's source ran per row".into())),
                };
                let out = super::sdpa::attention(&q, &kk, &vv, 1.0, AttnMask::Array(mask), None)?;
                (out, SharedKv::Batch(kk, vv))
            }
            (LayerCaches::Rows(mut rows), Masks::Rows(row_masks)) => {
                let n = rows.len();
                let offsets: Vec<i32> = match shared {
                    Some(SharedKv::Rows(o, _)) => o.clone(),
                    Some(SharedKv::Batch(..)) => {
                        return Err(Error::Invalid("gemma4: a per-row layer's source was stacked".into()))
                    }
                    None => rows.iter().map(|c| c.offset()).collect(),
                };
                if offsets.len() != n || row_masks.len() != n {
                    return Err(Error::Invalid("gemma4: rows, masks and the source layer disagree".into()));
                }
                let split = |a: Array| -> Result<Vec<Array>> {
                    if n == 1 {
                        Ok(vec![a])
                    } else {
                        mx::split(&a, n as i32, 0)
                    }
                };
                // rotary embedding: one op for a decode step of several rows, else per row
                let (qs, ks, vs) = if l == 1 && n > 1 {
                    let q = self.rope.forward_rows(&q, &offsets)?;
                    match kv {
                        Some((k, v)) => {
                            (split(q)?, Some(split(self.rope.forward_rows(&k, &offsets)?)?), Some(split(v)?))
                        }
                        None => (split(q)?, None, None),
                    }
                } else {
                    let qs = split(q)?
                        .iter()
                        .zip(&offsets)
                        .map(|(q, &o)| self.rope.forward(q, o))
                        .collect::<Result<Vec<_>>>()?;
                    match kv {
                        Some((k, v)) => {
                            let ks = split(k)?
                                .iter()
                                .zip(&offsets)
                                .map(|(k, &o)| self.rope.forward(k, o))
                                .collect::<Result<Vec<_>>>()?;
                            (qs, Some(ks), Some(split(v)?))
                        }
                        None => (qs, None, None),
                    }
                };
                let mut fetched = Vec::with_capacity(n);
                match (ks, vs, shared) {
                    (Some(ks), Some(vs), _) => {
                        for ((c, k), v) in rows.iter_mut().zip(ks).zip(vs) {
                            fetched.push(c.update_and_fetch(k, v)?);
                        }
                    }
                    (_, _, Some(SharedKv::Rows(_, f))) => {
                        fetched.extend(f.iter().cloned());
                        // the placeholder cache counts the tokens its source holds
                        for (c, &o) in rows.iter_mut().zip(&offsets) {
                            match c {
                                LayerCache::Full(c) => c.offset = o + l,
                                LayerCache::Quantized(c) => c.offset = o + l,
                                LayerCache::Rotating(_) | LayerCache::Recurrent(_) => {}
                            }
                        }
                    }
                    _ => return Err(Error::Invalid("gemma4: a KV-shared layer ran without its source layer".into())),
                }
                let outs = qs
                    .iter()
                    .zip(&fetched)
                    .zip(row_masks.iter())
                    .map(|((q, f), m)| layers::attend_fetched(q, f, 1.0, m, None))
                    .collect::<Result<Vec<_>>>()?;
                let out = if n == 1 {
                    outs.into_iter().next().expect("one row")
                } else {
                    mx::concatenate(&outs.iter().collect::<Vec<_>>(), 0)?
                };
                (out, SharedKv::Rows(offsets, fetched))
            }
            _ => return Err(Error::Invalid("gemma4 attention: masks and caches of different kinds".into())),
        };
        let out = mx::reshape(&mx::transpose_axes(&out, &perm)?, &[b, l, -1])?;
        Ok((self.o_proj.forward(&out)?, kv_out))
    }
}

/// The router's logits for `h` (read unnormed: `rms_norm` with the router's own weight) and the
/// `k` experts of `e` it picks.
fn route(proj: &Linear, norm_weight: &Array, eps: f32, e: i32, k: i32, h: &Array) -> Result<(Array, Array)> {
    let x = mx::rms_norm(h, Some(norm_weight), eps)?;
    let scores = proj.forward(&x)?;
    let inds = mx::slice_axis(&mx::argpartition(&scores, e - k, -1)?, -1, e - k, e)?;
    Ok((scores, inds))
}

/// mlx-lm's `Router` and `Experts`: the routed GeGLU experts of a MoE layer.
struct Moe {
    /// Shared with the predictor a streamed layer registers (`Experts::forward_ahead`).
    proj: std::sync::Arc<Linear>,
    /// `scale * hidden^-0.5`, the router's norm weight.
    norm_weight: Array,
    per_expert_scale: Array,
    experts: Experts,
    top_k: i32,
    eps: f32,
    pre_norm: RmsNorm,
    post_norm: RmsNorm,
}

impl Moe {
    /// `h` routed (the router reads it unnormed), through the experts (after their pre-norm).
    fn forward(&self, h: &Array) -> Result<Array> {
        let (scores, inds) = route(&self.proj, &self.norm_weight, self.eps, self.experts.count, self.top_k, h)?;
        let w = mx::softmax(&mx::take_along_axis(&scores, &inds, -1)?, &[-1], false)?;
        let w = mx::multiply(&w, &mx::take(&self.per_expert_scale, &inds, 0)?)?;
        let y =
            self.experts.forward_ahead(&self.pre_norm.forward(h)?, &inds, layers::ExpertAct::Geglu, None, Some(h))?;
        let y = mx::sum(&mx::multiply(&mx::expand_dims(&w, -1)?, &y)?, &[-2], false)?;
        self.post_norm.forward(&y)
    }
}

/// A layer's per-layer input gate.
struct PerLayer {
    gate: Linear,
    proj: Linear,
    norm: RmsNorm,
}

struct Block {
    attn: Attn,
    /// The layer whose keys and values this one reads.
    shared_from: Option<usize>,
    /// Whether a KV-shared layer reads this one's keys and values (kept through the forward pass).
    shared_to: bool,
    sliding: bool,
    mlp: Mlp,
    /// With the MoE block: the dense MLP's own post-norm (`post_feedforward_layernorm_1`).
    mlp_post_norm: Option<RmsNorm>,
    moe: Option<Moe>,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
    per_layer: Option<PerLayer>,
    scalar: Array,
}

/// The per-layer input embeddings and their projection from the token embeddings.
struct PerLayerInputs {
    embed: Embedding,
    projection: Linear,
    norm: RmsNorm,
    dim: i32,
}

pub struct Model {
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    per_layer: Option<PerLayerInputs>,
    window: i32,
    softcap: Option<f32>,
    shape: ModelShape,
}

/// `config.json: {field} = {value}` disagreeing with the rows of weight `{name}`.
fn check_rows(w: &Weights, name: &str, want: i32, field: &str, value: i32, per: &str) -> Result<()> {
    match w.rows_of(name) {
        Some(rows) if rows != want => Err(Error::ModelLoad(format!(
            "config.json: {field} = {value} implies {want} rows of {name}.weight ({per}), but it has {rows}: the checkpoint \
             does not match config.json"
        ))),
        _ => Ok(()),
    }
}

impl Model {
    pub fn load(config: &Value, mut w: Weights) -> Result<Model> {
        let p = Params::new(config)?;
        let text = text_config(config)?;
        let c = Cfg(&text);
        let (root, head) =
            if is_wrapper(config) { ("language_model.model", "language_model.lm_head") } else { ("model", "lm_head") };
        let (hidden, n_heads, eps) = (p.d.hidden, p.d.heads, p.eps);
        let traditional = c.b_or("rope_traditional", false);
        let default_rope = json!({
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
        });
        let rope_params = c.get("rope_parameters").unwrap_or(&default_rope);
        let mut layers = Vec::with_capacity(p.sliding.len());
        for (i, &sliding) in p.sliding.iter().enumerate() {
            let pre = format!("{root}.layers.{i}");
            let (n_kv, head_dim) = p.kv_geometry(i);
            let (hd_field, hd_value) =
                if sliding { ("head_dim", p.d.head_dim) } else { ("global_head_dim", p.global_head_dim) };
            let what = if sliding { "a sliding layer" } else { "a global layer" };
            check_rows(
                &w,
                &format!("{pre}.self_attn.q_proj"),
                n_heads * head_dim,
                hd_field,
                hd_value,
                &format!("{what}: num_attention_heads × {hd_field}"),
            )?;
            let has_kv = p.shared_from[i].is_none();
            if has_kv {
                let kv_field = if !sliding && p.k_eq_v { "num_global_key_value_heads" } else { "num_key_value_heads" };
                check_rows(
                    &w,
                    &format!("{pre}.self_attn.k_proj"),
                    n_kv * head_dim,
                    hd_field,
                    hd_value,
                    &format!("{what}: {kv_field} × {hd_field}"),
                )?;
            }
            let key = if sliding { "sliding_attention" } else { "full_attention" };
            let rp = rope_params.get(key).filter(|v| v.is_object());
            let theta = rp.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10000.0) as f32;
            let lin = |w: &mut Weights, name: &str, out: i32, inp: i32| {
                Linear::load(w, &format!("{pre}.{name}"), false, out, inp)
            };
            let attn = Attn {
                q_proj: lin(&mut w, "self_attn.q_proj", n_heads * head_dim, hidden)?,
                k_proj: if has_kv { Some(lin(&mut w, "self_attn.k_proj", n_kv * head_dim, hidden)?) } else { None },
                v_proj: if has_kv && (sliding || !p.k_eq_v) {
                    Some(lin(&mut w, "self_attn.v_proj", n_kv * head_dim, hidden)?)
                } else {
                    None
                },
                o_proj: lin(&mut w, "self_attn.o_proj", hidden, n_heads * head_dim)?,
                q_norm: RmsNorm::load(&mut w, &format!("{pre}.self_attn.q_norm"), eps, head_dim)?,
                k_norm: if has_kv {
                    Some(RmsNorm::load(&mut w, &format!("{pre}.self_attn.k_norm"), eps, head_dim)?)
                } else {
                    None
                },
                n_heads,
                n_kv_heads: n_kv,
                head_dim,
                eps,
                rope: Rope::from_config(head_dim, theta, traditional, rp)?,
            };
            let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{pre}.{name}"), eps, hidden);
            let moe = match p.moe {
                Some((experts, top_k, inter)) => {
                    let scale = w.take_shaped(&format!("{pre}.router.scale"), &[hidden])?;
                    let proj = std::sync::Arc::new(lin(&mut w, "router.proj", experts, hidden)?);
                    let norm_weight = mx::multiply(&scale, &mx::scalar_as((hidden as f64).powf(-0.5), scale.dtype())?)?;
                    let ex = Experts::load(&mut w, &format!("{pre}.experts.switch_glu"), experts, hidden, inter)?;
                    if let layers::ExpertStore::Streamed(s) = &ex.store {
                        // the layer before applies this router to its own MoE input (its residual)
                        let (r, nw) = (proj.clone(), norm_weight.clone());
                        s.set_predictor(std::sync::Arc::new(move |h: &Array| {
                            Ok(route(&r, &nw, eps, experts, top_k, h)?.1)
                        }));
                    }
                    Some(Moe {
                        proj,
                        norm_weight,
                        per_expert_scale: w.take_shaped(&format!("{pre}.router.per_expert_scale"), &[experts])?,
                        experts: ex,
                        top_k,
                        eps,
                        pre_norm: norm(&mut w, "pre_feedforward_layernorm_2")?,
                        post_norm: norm(&mut w, "post_feedforward_layernorm_2")?,
                    })
                }
                None => None,
            };
            let per_layer = if p.per_layer > 0 {
                Some(PerLayer {
                    gate: lin(&mut w, "per_layer_input_gate", p.per_layer, hidden)?,
                    proj: lin(&mut w, "per_layer_projection", hidden, p.per_layer)?,
                    norm: norm(&mut w, "post_per_layer_input_norm")?,
                })
            } else {
                None
            };
            layers.push(Block {
                attn,
                shared_from: p.shared_from[i],
                shared_to: p.shared_from.contains(&Some(i)),
                sliding,
                mlp: Mlp::load(&mut w, &format!("{pre}.mlp"), false, Activation::Geglu, hidden, p.mlp_width(i))?,
                mlp_post_norm: if moe.is_some() { Some(norm(&mut w, "post_feedforward_layernorm_1")?) } else { None },
                moe,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
                pre_ff_norm: norm(&mut w, "pre_feedforward_layernorm")?,
                post_ff_norm: norm(&mut w, "post_feedforward_layernorm")?,
                per_layer,
                scalar: w.take_shaped(&format!("{pre}.layer_scalar"), &[1])?,
            });
        }
        let embed = Embedding::load(&mut w, &format!("{root}.embed_tokens"), p.d.vocab, hidden)?;
        let per_layer = if p.per_layer > 0 {
            let width = p.d.layers * p.per_layer;
            Some(PerLayerInputs {
                embed: Embedding::load(&mut w, &format!("{root}.embed_tokens_per_layer"), p.vocab_per_layer, width)?,
                projection: Linear::load(&mut w, &format!("{root}.per_layer_model_projection"), false, width, hidden)?,
                norm: RmsNorm::load(&mut w, &format!("{root}.per_layer_projection_norm"), eps, p.per_layer)?,
                dim: p.per_layer,
            })
        } else {
            None
        };
        let norm = RmsNorm::load(&mut w, &format!("{root}.norm"), eps, hidden)?;
        let lm_head = if p.tie { None } else { Some(Linear::load(&mut w, head, false, embed.rows(), hidden)?) };
        let dtype_bytes = embed.dtype().size();
        let shape = ModelShape::new(
            "gemma4_text",
            p.layout(),
            hidden,
            p.d.vocab,
            c.opt_i("max_position_embeddings"),
            dtype_bytes,
        );
        Ok(Model { embed, layers, norm, lm_head, per_layer, window: p.window, softcap: p.softcap, shape })
    }

    /// `x * v` with `v` in x's dtype (a Python float times an array in mlx-lm).
    fn scaled(x: &Array, v: f64) -> Result<Array> {
        mx::multiply(x, &mx::scalar_as(v, x.dtype())?)
    }

    /// The per-layer token embeddings `[B, L, layers × per_layer]`, scaled (mlx-lm's
    /// `_get_per_layer_inputs` before its reshape).
    fn per_layer_tokens(pl: &PerLayerInputs, tokens: &Array) -> Result<Array> {
        Self::scaled(&pl.embed.forward(tokens)?, (pl.dim as f64).sqrt())
    }

    /// `[B, L, layers, per_layer]`: mlx-lm's `_project_per_layer_inputs` of the input embeddings `h`
    /// with the per-layer token embeddings `e` (`[B, L, layers × per_layer]`); without them (input
    /// embeddings alone) the projection alone, as mlx-vlm's `project_per_layer_inputs(h, None)`.
    fn per_layer_inputs(&self, pl: &PerLayerInputs, e: Option<&Array>, h: &Array) -> Result<Array> {
        let (b, l, n) = (h.dim(0), h.dim(1), self.layers.len() as i32);
        let proj = Self::scaled(&pl.projection.forward(h)?, (h.dim(-1) as f64).powf(-0.5))?;
        let proj = pl.norm.forward(&mx::reshape(&proj, &[b, l, n, pl.dim])?)?;
        match e {
            Some(e) => Self::scaled(&mx::add(&proj, &mx::reshape(e, &[b, l, n, pl.dim])?)?, 2f64.powf(-0.5)),
            None => Ok(proj),
        }
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        let logits = self.embed.logits(self.lm_head.as_ref(), h)?;
        match self.softcap {
            Some(cap) => layers::logit_softcap(&logits, cap),
            None => Ok(logits),
        }
    }
}

impl CausalLm for Model {
    fn forward_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.hidden_caches(tokens, caches, staging)?;
        self.logits(&h)
    }

    fn hidden_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.embed_tokens(tokens)?;
        let e = self.per_layer.as_ref().map(|pl| Self::per_layer_tokens(pl, tokens)).transpose()?;
        self.hidden_from(h, e.as_ref(), caches, staging)
    }

    /// The token embeddings scaled by sqrt(hidden): Gemma 4's input embeddings as mlx-vlm's
    /// `get_input_embeddings` builds them before merging image features in unscaled.
    fn embed_tokens(&self, tokens: &Array) -> Result<Array> {
        let h0 = self.embed.forward(tokens)?;
        Self::scaled(&h0, (h0.dim(-1) as f64).sqrt())
    }

    fn embed_per_layer(&self, tokens: &Array) -> Result<Option<Array>> {
        self.per_layer.as_ref().map(|pl| Self::per_layer_tokens(pl, tokens)).transpose()
    }

    /// Input embeddings as [`CausalLm::embed_tokens`] gives them (already scaled), the per-layer
    /// token embeddings ([`CausalLm::embed_per_layer`]) in trailing columns when the model has them
    /// (without them: the projection of the embeddings alone, as mlx-vlm without `per_layer_inputs`).
    fn forward_embeds(&self, embeds: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let hidden = self.shape.hidden_size;
        let width = embeds.dim(-1);
        let extra = self.per_layer.as_ref().map_or(0, |pl| pl.dim * self.layers.len() as i32);
        let (h, e) = if width == hidden {
            (embeds.clone(), None)
        } else if extra > 0 && width == hidden + extra {
            (mx::slice_axis(embeds, -1, 0, hidden)?, Some(mx::slice_axis(embeds, -1, hidden, width)?))
        } else {
            return Err(Error::Invalid(format!(
                "gemma4: input embeddings of width {width} (hidden_size {hidden}, per-layer inputs {extra})"
            )));
        };
        let h = self.hidden_from(h, e.as_ref(), caches, staging)?;
        self.logits(&h)
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }
}

impl Model {
    /// The decoder over scaled input embeddings `h`, with the per-layer token embeddings `e`.
    fn hidden_from(&self, h: Array, e: Option<&Array>, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let pli = match &self.per_layer {
            Some(pl) => Some(self.per_layer_inputs(pl, e, &h)?),
            None => None,
        };
        let masks =
            super::LayerMasks::new(caches, h.dim(1), self.layers.iter().map(|l| Some(l.sliding)), Some(self.window))?;
        // the keys and values of the layers some KV-shared layer reads
        let mut kvs: Vec<Option<SharedKv>> = vec![None; self.layers.len()];
        let h = super::run_layers(self.layers.len(), h, caches, staging, |i, h, caches| {
            let layer = &self.layers[i];
            let shared = match layer.shared_from {
                Some(from) => Some(
                    kvs[from].as_ref().ok_or_else(|| Error::Invalid(format!("gemma4: layer {from} kept no keys")))?,
                ),
                None => None,
            };
            let (a, kv) = layer.attn.forward(
                &layer.input_norm.forward(h)?,
                masks.get(layer.sliding)?,
                caches.layer_mut(i),
                shared,
            )?;
            // only the layers some KV-shared layer reads keep theirs
            if layer.shared_to {
                kvs[i] = Some(kv);
            }
            let hh = mx::add(h, &layer.post_attn_norm.forward(&a)?)?;
            let dense = layer.mlp.forward(&layer.pre_ff_norm.forward(&hh)?)?;
            let ff = match (&layer.moe, &layer.mlp_post_norm) {
                (Some(moe), Some(post1)) => mx::add(&post1.forward(&dense)?, &moe.forward(&hh)?)?,
                _ => dense,
            };
            let mut h = mx::add(&hh, &layer.post_ff_norm.forward(&ff)?)?;
            if let (Some(pl), Some(pli)) = (&layer.per_layer, &pli) {
                let input = mx::squeeze(&mx::slice_axis(pli, 2, i as i32, i as i32 + 1)?, &[2])?;
                let g = mx::multiply(&layers::gelu_approx_compiled(&pl.gate.forward(&h)?)?, &input)?;
                h = mx::add(&h, &pl.norm.forward(&pl.proj.forward(&g)?)?)?;
            }
            mx::multiply(&h, &layer.scalar)
        })?;
        self.norm.forward(&h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Value {
        json!({"model_type": "gemma4_text", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "global_head_dim": 128, "vocab_size": 512,
               "intermediate_size": 256, "sliding_window": 16, "num_kv_shared_layers": 2,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                               "sliding_attention", "full_attention"]})
    }

    #[test]
    fn shared_layers_read_the_last_earlier_layer_of_their_type_and_hold_no_kv() {
        let l = super::super::arch::layout_of(&cfg()).unwrap().unwrap();
        let s = AttnKind::Sliding { window: 16 };
        let attn: Vec<_> = l.iter().map(|l| l.attn).collect();
        assert_eq!(
            attn,
            [s, AttnKind::Full, s, AttnKind::Full, AttnKind::SharedKv { from: 2 }, AttnKind::SharedKv { from: 3 }]
        );
        let geo: Vec<_> = l.iter().map(|l| (l.kv_heads, l.head_dim, l.kv_elems())).collect();
        assert_eq!(geo, [(2, 64, 256), (2, 128, 512), (2, 64, 256), (2, 128, 512), (2, 64, 0), (2, 128, 0)]);
        let widths: Vec<_> = l.iter().map(|l| l.ffn).collect();
        assert_eq!(widths[3], FfnKind::Dense { intermediate: 256 });
        assert_eq!(widths[4], FfnKind::Dense { intermediate: 512 }); // double-wide on shared layers
                                                                     // the caches: a rotating one, a growing one, and empty placeholders for the shared layers
        let caches = super::super::arch::make_cache(&l, &Default::default());
        assert!(matches!(caches[0], LayerCache::Rotating(_)) && matches!(caches[5], LayerCache::Full(_)));
        // the planner counts no KV for them: 300 tokens → 512 slots × 512 + 16 slots × 256, twice, × 4 bytes
        let shape = ModelShape::new("gemma4_text", l, 256, 512, None, 4);
        assert_eq!(shape.kv_bytes(300, None, 64), 2 * (512 * 512 + 16 * 256) * 4);
        // the multimodal wrapper: its text_config, with the wrapper's vocab_size
        let mm = json!({"model_type": "gemma4", "vocab_size": 1000, "text_config": cfg()});
        assert_eq!(Params::new(&mm).unwrap().d.vocab, 1000);
        assert_eq!(layout(&mm).unwrap(), layout(&cfg()).unwrap());
    }

    #[test]
    fn bad_configs_are_refused_naming_the_field() {
        let err = |k: &str, v: Value| {
            let mut c = cfg();
            c[k] = v;
            layout(&c).unwrap_err().to_string()
        };
        let mut types = cfg()["layer_types"].clone();
        types[2] = json!("chunked_attention");
        assert!(err("layer_types", types).contains("layer_types[2] = \"chunked_attention\""));
        assert!(err("layer_types", json!(["full_attention"])).contains("layer_types has 1 entries"));
        assert!(err("num_kv_shared_layers", json!(6)).contains("num_kv_shared_layers = 6"));
        let only_full = json!([
            "full_attention",
            "full_attention",
            "full_attention",
            "full_attention",
            "sliding_attention",
            "full_attention"
        ]);
        assert!(err("layer_types", only_full)
            .contains("layer 4 shares the keys and values of an earlier sliding_attention"));
        assert!(err("global_head_dim", json!(33)).contains("global_head_dim 33 is odd"));
        let mut moe = cfg();
        moe["enable_moe_block"] = json!(true);
        moe["num_experts"] = json!(4);
        moe["top_k_experts"] = json!(5);
        moe["moe_intermediate_size"] = json!(64);
        assert!(layout(&moe).unwrap_err().to_string().contains("top_k_experts 5 exceeds num_experts 4"));
    }
}
