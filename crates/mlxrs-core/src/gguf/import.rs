//! Import a GGUF model into a normal mlxrs model directory: HF tensor names and config, the
//! converter's transformations undone, a tokenizer.json built from `tokenizer.ggml.*`.
use super::reader::{GgufHeader, MetaValue};
use serde_json::{json, Value};

fn meta_to_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::U8(x) => json!(x),
        MetaValue::I8(x) => json!(x),
        MetaValue::U16(x) => json!(x),
        MetaValue::I16(x) => json!(x),
        MetaValue::U32(x) => json!(x),
        MetaValue::I32(x) => json!(x),
        MetaValue::F32(x) => json!(x),
        MetaValue::Bool(x) => json!(x),
        MetaValue::Str(x) => json!(x),
        MetaValue::Array(a) => Value::Array(a.iter().map(meta_to_json).collect()),
        MetaValue::U64(x) => json!(x),
        MetaValue::I64(x) => json!(x),
        MetaValue::F64(x) => json!(x),
    }
}

/// All metadata as a JSON object (arrays included).
pub fn metadata_json(h: &GgufHeader) -> Value {
    Value::Object(h.metadata.iter().map(|(k, v)| (k.clone(), meta_to_json(v))).collect())
}

use super::dequant::{block_layout, blocks, dequantize};
use super::reader::{GgmlType, GgufFile};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};
use std::collections::BTreeMap;
use std::path::Path;

/// What the imported weights are stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    Bf16,
    F16,
    F32,
    /// MLX affine 8-bit, group 64.
    Q8,
    /// MLX affine 4-bit, group 64 (re-quantizing a k-quant costs accuracy).
    Q4,
}

impl OutDtype {
    pub fn parse(s: &str) -> Result<OutDtype> {
        Ok(match s {
            "bf16" | "bfloat16" => OutDtype::Bf16,
            "f16" | "fp16" | "float16" => OutDtype::F16,
            "f32" | "fp32" | "float32" => OutDtype::F32,
            "q8" | "8bit" => OutDtype::Q8,
            "q4" | "4bit" => OutDtype::Q4,
            other => return Err(Error::Invalid(format!("--dtype {other:?} is not one of bf16, f16, f32, q8, q4"))),
        })
    }
    /// What `serve`, `Session` and `fit` import a GGUF as on `backend`: float32 on the CPU (MLX's CPU
    /// matmul runs float32 through BLAS, its bf16 and quantized products several times slower: the
    /// real Gemma 3 270M decodes ~4x faster from an f32 import, bench/RESULTS.md), bf16 on GPUs.
    pub fn default_for(backend: crate::plan::Backend) -> OutDtype {
        match backend {
            crate::plan::Backend::Cpu => OutDtype::F32,
            _ => OutDtype::Bf16,
        }
    }
    /// Bytes of one unquantized element.
    pub fn float_bytes(self) -> u64 {
        match self {
            OutDtype::F32 => 4,
            _ => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            OutDtype::Bf16 => "bf16",
            OutDtype::F16 => "f16",
            OutDtype::F32 => "f32",
            OutDtype::Q8 => "q8",
            OutDtype::Q4 => "q4",
        }
    }
    fn float(self) -> Dtype {
        match self {
            OutDtype::F16 => Dtype::Float16,
            OutDtype::F32 => Dtype::Float32,
            _ => Dtype::Bfloat16,
        }
    }
    fn bits(self) -> Option<i32> {
        match self {
            OutDtype::Q8 => Some(8),
            OutDtype::Q4 => Some(4),
            _ => None,
        }
    }
}

/// Architectures the importer maps, with their HF model_type (the architecture table's
/// [`crate::models::Arch::gguf`]), sorted by GGUF name.
pub fn importable() -> Vec<(&'static str, &'static str)> {
    let mut v = crate::models::arch::gguf_architectures();
    v.sort();
    v
}

struct Meta<'a> {
    h: &'a GgufHeader,
    arch: String,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn f(&self, k: &str) -> Option<f64> {
        self.h.get(&self.key(k)).and_then(MetaValue::as_f64)
    }
    /// A size: present (or `default`), an integer in 1..=max ([`crate::models::limits`]).
    fn size(&self, k: &str, default: Option<i64>, max: i64) -> Result<i64> {
        let key = self.key(k);
        let v = match self.h.get(&key) {
            None => default.ok_or_else(|| Error::ModelLoad(format!("GGUF metadata {key} is missing")))?,
            Some(v) => v.as_u64().and_then(|v| i64::try_from(v).ok()).unwrap_or(-1),
        };
        if !(1..=max).contains(&v) {
            let shown = self.h.get(&key).map_or(v.to_string(), |m| format!("{m:?}"));
            return Err(Error::ModelLoad(format!("GGUF metadata {key} = {shown} is out of range (1..={max})")));
        }
        Ok(v)
    }
    /// A per-layer size: an array of `layers` entries, or one number for every layer.
    fn per_layer(&self, k: &str, layers: usize, default: Option<i64>, max: i64) -> Result<Vec<i64>> {
        let key = self.key(k);
        let Some(a) = self.h.get(&key).and_then(MetaValue::as_array) else {
            return Ok(vec![self.size(k, default, max)?; layers]);
        };
        if a.len() != layers {
            return Err(Error::ModelLoad(format!(
                "GGUF metadata {key} has {} entries but {} is {layers}",
                a.len(),
                self.key("block_count")
            )));
        }
        a.iter()
            .enumerate()
            .map(|(i, v)| match v.as_u64().and_then(|v| i64::try_from(v).ok()) {
                Some(v) if (1..=max).contains(&v) => Ok(v),
                _ => Err(Error::ModelLoad(format!("GGUF metadata {key}[{i}] = {v:?} is out of range (1..={max})"))),
            })
            .collect()
    }
}

/// The vocabulary size: the token list's length, else the embedding's rows.
fn vocab_size(h: &GgufHeader) -> Result<i64> {
    use crate::models::limits;
    let vocab = h
        .get("tokenizer.ggml.tokens")
        .and_then(MetaValue::as_array)
        .map(|a| a.len() as i64)
        .or_else(|| h.tensor("token_embd.weight").map(|t| t.shape()[0] as i64))
        .ok_or_else(|| Error::ModelLoad("cannot tell the vocabulary size (no tokenizer.ggml.tokens)".into()))?;
    if !(1..=limits::VOCAB).contains(&vocab) {
        return Err(Error::ModelLoad(format!(
            "GGUF vocabulary of {vocab} tokens is out of range (1..={})",
            limits::VOCAB
        )));
    }
    Ok(vocab)
}

/// The file's BOS, EOS and padding ids as config.json's `*_token_id`.
fn special_ids(h: &GgufHeader, o: &mut serde_json::Map<String, Value>) {
    for (k, id) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(v) = h.get(id).and_then(MetaValue::as_u64) {
            o.insert(k.into(), json!(v));
        }
    }
}

/// Gemma 4 (`gemma4`, llama.cpp's `Gemma4Model` converter) as a `gemma4_text` config. The converter
/// writes per-layer arrays where the layers differ: `attention.sliding_window_pattern` (true for a
/// sliding layer) is `layer_types`, `feed_forward_length` (doubled on the KV-shared layers:
/// `use_double_wide_mlp`) and `attention.head_count_kv` (the global layers' count differing:
/// `num_global_key_value_heads`, with keys as values). `attention.key_length` is the global layers'
/// head dim, `key_length_swa` the sliding ones'; `rope.freq_base(_swa)` their rope bases; the
/// global layers' partial rotation is in `rope_freqs.weight` (1 for a rotated pair, 1e30 for an
/// unrotated one: [`gemma4_partial_rotary`]), the sliding ones' in `rope.dimension_count_swa`.
fn gemma4_config(m: &Meta, h: &GgufHeader, rope_freqs: Option<&[f32]>) -> Result<Value> {
    use crate::models::limits;
    let hidden = m.size("embedding_length", None, limits::HIDDEN)?;
    let layers = m.size("block_count", None, limits::LAYERS)?;
    let n = layers as usize;
    let heads = m.size("attention.head_count", None, limits::HEADS)?;
    let head_dim = m.size("attention.key_length_swa", None, limits::HEAD_DIM)?;
    let global_head_dim = m.size("attention.key_length", None, limits::HEAD_DIM)?;
    let key = |k: &str| m.key(k);
    let pattern_key = key("attention.sliding_window_pattern");
    let sliding: Vec<bool> = match h.get(&pattern_key).and_then(MetaValue::as_array) {
        None => return Err(Error::ModelLoad(format!("GGUF metadata {pattern_key} is missing or not a list"))),
        Some(a) if a.len() != n => {
            return Err(Error::ModelLoad(format!(
                "GGUF metadata {pattern_key} has {} entries but {} is {n}",
                a.len(),
                key("block_count")
            )))
        }
        Some(a) => a
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_bool()
                    .ok_or_else(|| Error::ModelLoad(format!("GGUF metadata {pattern_key}[{i}] = {v:?} is not a bool")))
            })
            .collect::<Result<_>>()?,
    };
    let shared = match h.get(&key("attention.shared_kv_layers")) {
        None => 0,
        Some(v) => v.as_u64().filter(|&s| s < layers as u64).ok_or_else(|| {
            Error::ModelLoad(format!(
                "GGUF metadata {} = {v:?} is out of range (0..{n})",
                key("attention.shared_kv_layers")
            ))
        })? as usize,
    };
    let first_shared = n - shared;
    // the feed-forward widths: one width, or doubled on the KV-shared layers
    let ff = m.per_layer("feed_forward_length", n, None, limits::INTERMEDIATE)?;
    let intermediate = ff[0];
    let double_wide = shared > 0 && ff[first_shared] == 2 * intermediate;
    if let Some(l) =
        (0..n).find(|&l| ff[l] != if l >= first_shared && double_wide { 2 * intermediate } else { intermediate })
    {
        return Err(Error::ModelLoad(format!(
            "GGUF metadata {}[{l}] = {}: Gemma 4's layers are {intermediate} wide, the KV-shared ones {intermediate} or \
             twice that",
            key("feed_forward_length"),
            ff[l]
        )));
    }
    // KV heads: the sliding layers' count, and the global ones' when they differ (keys as values)
    let kv = m.per_layer("attention.head_count_kv", n, None, limits::HEADS)?;
    let first_sliding = sliding.iter().position(|&s| s).unwrap_or(0);
    let first_global = sliding.iter().position(|&s| !s);
    let kv_heads = kv[first_sliding];
    let global_kv = first_global.map_or(kv_heads, |g| kv[g]);
    if let Some(l) = (0..n).find(|&l| kv[l] != if sliding[l] { kv_heads } else { global_kv }) {
        return Err(Error::ModelLoad(format!(
            "GGUF metadata {}[{l}] = {} differs from the other {} layers' {}",
            key("attention.head_count_kv"),
            kv[l],
            if sliding[l] { "sliding" } else { "global" },
            if sliding[l] { kv_heads } else { global_kv }
        )));
    }
    // keys as values: a global layer that computes keys has no value projection
    let k_eq_v = first_global
        .filter(|&g| g < first_shared)
        .is_some_and(|g| h.tensor(&format!("blk.{g}.attn_v.weight")).is_none());
    if global_kv != kv_heads && !k_eq_v {
        return Err(Error::ModelLoad(format!(
            "GGUF metadata {} gives the global layers {global_kv} KV heads and the sliding ones {kv_heads}, \
             which Gemma 4 has only with keys as values (no blk.*.attn_v.weight on the global layers)",
            key("attention.head_count_kv")
        )));
    }
    let swa_rot = m.size("rope.dimension_count_swa", Some(head_dim), limits::HEAD_DIM)?;
    let global_partial =
        match rope_freqs {
            Some(f) => gemma4_partial_rotary(f, global_head_dim as usize)?,
            None if first_global.is_none() => 1.0,
            None => return Err(Error::ModelLoad(
                "the Gemma 4 GGUF has no rope_freqs.weight, which says how much of the global layers' heads rotates"
                    .into(),
            )),
        };
    let per_layer = match h.get(&key("embedding_length_per_layer_input")) {
        None => 0,
        Some(_) if m.f("embedding_length_per_layer_input") == Some(0.0) => 0,
        Some(_) => m.size("embedding_length_per_layer_input", None, limits::HIDDEN)?,
    };
    let vocab = vocab_size(h)?;
    let mut cfg = json!({
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "layer_types": sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect::<Vec<_>>(),
        "sliding_window": m.size("attention.sliding_window", Some(512), limits::POSITIONS)?,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double_wide,
        "attention_k_eq_v": k_eq_v,
        "hidden_size_per_layer_input": per_layer,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": global_partial,
                "rope_theta": m.f("rope.freq_base").unwrap_or(1_000_000.0),
                "rope_type": "proportional",
            },
            "sliding_attention": {
                "partial_rotary_factor": swa_rot as f64 / head_dim as f64,
                "rope_theta": m.f("rope.freq_base_swa").unwrap_or(10_000.0),
                "rope_type": "default",
            },
        },
        "final_logit_softcapping": m.f("final_logit_softcapping"),
        "rms_norm_eps": m.f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        "vocab_size": vocab,
        "max_position_embeddings": m.size("context_length", Some(131072), limits::POSITIONS)?,
        "tie_word_embeddings": h.tensor("output.weight").is_none(),
        "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "bfloat16",
    });
    let o = cfg.as_object_mut().expect("object");
    if k_eq_v {
        o.insert("num_global_key_value_heads".into(), json!(global_kv));
    }
    if per_layer > 0 {
        // the per-layer embedding's rows (the converter writes no size for it)
        let name = "per_layer_token_embd.weight";
        let t = h.tensor(name).ok_or_else(|| {
            Error::ModelLoad(format!(
                "GGUF tensor {name} is missing: {} = {per_layer} asks for per-layer input embeddings",
                key("embedding_length_per_layer_input")
            ))
        })?;
        o.insert("vocab_size_per_layer_input".into(), json!(t.shape()[0]));
    }
    if h.get(&key("expert_count")).is_some() {
        let experts = m.size("expert_count", None, limits::EXPERTS)?;
        o.insert("enable_moe_block".into(), json!(true));
        o.insert("num_experts".into(), json!(experts));
        o.insert("top_k_experts".into(), json!(m.size("expert_used_count", None, limits::EXPERTS)?));
        o.insert(
            "moe_intermediate_size".into(),
            json!(m.size("expert_feed_forward_length", None, limits::INTERMEDIATE)?),
        );
    }
    special_ids(h, o);
    Ok(cfg)
}

/// The global layers' `partial_rotary_factor` from llama.cpp's Gemma 4 `rope_freqs.weight`: one
/// factor per rotary pair of the global head, 1 for the rotated pairs first, then 1e30 (a frequency
/// of ~0: unrotated) for the rest.
pub fn gemma4_partial_rotary(factors: &[f32], global_head_dim: usize) -> Result<f64> {
    let rotated = factors.iter().take_while(|&&f| f == 1.0).count();
    if factors.len() != global_head_dim / 2 || rotated == 0 || factors[rotated..].iter().any(|&f| f < 1e29) {
        return Err(Error::ModelLoad(format!(
            "rope_freqs.weight ({} values) is not Gemma 4's: global_head_dim / 2 = {} factors, 1 for the rotated \
             pairs then 1e30 for the unrotated ones",
            factors.len(),
            global_head_dim / 2
        )));
    }
    Ok(2.0 * rotated as f64 / global_head_dim as f64)
}

/// HF config.json for the file's architecture; fields the GGUF does not store come from the
/// architecture's known defaults. `rope_freqs`: the file's `rope_freqs.weight`, read (Gemma 4 keeps
/// its global layers' partial rotation there).
pub fn hf_config(h: &GgufHeader, rope_freqs: Option<&[f32]>) -> Result<Value> {
    let arch = h
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| Error::ModelLoad("GGUF metadata general.architecture is missing".into()))?
        .to_string();
    let importable = importable();
    let model_type = importable.iter().find(|(a, _)| *a == arch).map(|(_, m)| *m).ok_or_else(|| {
        Error::Unsupported(format!(
            "GGUF architecture {arch:?} cannot be imported; supported: {}",
            importable.iter().map(|(a, _)| *a).collect::<Vec<_>>().join(", ")
        ))
    })?;
    let m = Meta { h, arch: arch.clone() };
    if model_type == "gemma4_text" {
        return gemma4_config(&m, h, rope_freqs);
    }
    use crate::models::limits;
    let hidden = m.size("embedding_length", None, limits::HIDDEN)?;
    let heads = m.size("attention.head_count", None, limits::HEADS)?;
    let kv = m.size("attention.head_count_kv", Some(heads), limits::HEADS)?;
    if heads % kv != 0 {
        return Err(Error::ModelLoad(format!(
            "GGUF metadata {} = {heads} is not a multiple of {} = {kv}",
            m.key("attention.head_count"),
            m.key("attention.head_count_kv")
        )));
    }
    let head_dim = m.size("attention.key_length", (hidden % heads == 0).then_some(hidden / heads), limits::HEAD_DIM)?;
    let layers = m.size("block_count", None, limits::LAYERS)?;
    let intermediate = m.size("feed_forward_length", None, limits::INTERMEDIATE)?;
    let context = m.size("context_length", Some(4096), limits::POSITIONS)?;
    let vocab = vocab_size(h)?;
    let tied = h.tensor("output.weight").is_none();
    let mut cfg = json!({
        "model_type": model_type,
        "architectures": [match model_type {
            "gemma3_text" => "Gemma3ForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            "qwen3_moe" => "Qwen3MoeForCausalLM",
            _ => "LlamaForCausalLM",
        }],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": m.f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    });
    let o = cfg.as_object_mut().expect("object");
    special_ids(h, o);
    match model_type {
        "gemma3_text" => {
            o.insert("rope_theta".into(), json!(m.f("rope.freq_base").unwrap_or(1_000_000.0)));
            o.insert("rope_local_base_freq".into(), json!(10_000.0));
            o.insert("sliding_window".into(), json!(m.size("attention.sliding_window", Some(512), limits::POSITIONS)?));
            o.insert("sliding_window_pattern".into(), json!(6));
            o.insert("query_pre_attn_scalar".into(), json!(head_dim));
            o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            if let (Some(t), Some(f)) =
                (h.get(&m.key("rope.scaling.type")).and_then(MetaValue::as_str), m.f("rope.scaling.factor"))
            {
                if t == "linear" && f != 1.0 {
                    o.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": f}));
                }
            }
        }
        _ => {
            o.insert("rope_theta".into(), json!(m.f("rope.freq_base").unwrap_or(10_000.0)));
            if model_type == "qwen2" {
                o.insert("attention_bias".into(), json!(true));
            }
            if model_type == "qwen3_moe" {
                // llama.cpp's qwen3moe: the stacked experts ffn_{gate,up,down}_exps, the router
                // ffn_gate_inp, the top-k weights renormalised; a block without a router is dense
                let experts = m.size("expert_count", None, limits::EXPERTS)?;
                let used = m.size("expert_used_count", None, limits::EXPERTS)?;
                let dense: Vec<i64> =
                    (0..layers).filter(|l| h.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).is_none()).collect();
                o.insert("num_experts".into(), json!(experts));
                o.insert("num_experts_per_tok".into(), json!(used));
                o.insert(
                    "moe_intermediate_size".into(),
                    json!(m.size("expert_feed_forward_length", None, limits::INTERMEDIATE)?),
                );
                o.insert("norm_topk_prob".into(), json!(true));
                o.insert("decoder_sparse_step".into(), json!(1));
                o.insert("mlp_only_layers".into(), json!(dense));
            }
            if let (Some(t), Some(f)) =
                (h.get(&m.key("rope.scaling.type")).and_then(MetaValue::as_str), m.f("rope.scaling.factor"))
            {
                if t == "linear" && f != 1.0 {
                    o.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": f}));
                }
            }
        }
    }
    Ok(cfg)
}

/// llama.cpp's per-dimension rope factors (`rope_freqs.weight`, written by convert_hf_to_gguf for a
/// `rope_scaling` of type llama3) as that `rope_scaling`: the parameters whose factors, computed as the
/// converter does, reproduce the tensor. The factor is the largest value; the wavelength bounds are
/// searched among the values Llama 3.x releases and their fine-tunes use. None when the factors are
/// all 1 (no scaling).
pub fn llama3_rope_scaling(factors: &[f32], base: f64, head_dim: usize) -> Result<Option<Value>> {
    if factors.iter().all(|&f| (f - 1.0).abs() < 1e-6) {
        return Ok(None);
    }
    let bad = |why: &str| {
        Error::ModelLoad(format!(
            "rope_freqs.weight ({} values) {why}: these rope factors match no llama3 rope scaling, so the \
             import would change the model's positions; please report the model",
            factors.len()
        ))
    };
    if factors.len() != head_dim / 2 {
        return Err(bad(&format!("should hold head_dim / 2 = {} values", head_dim / 2)));
    }
    let factor = factors.iter().fold(0f32, |a, &b| a.max(b)) as f64;
    // the converter: freqs = 1 / base^(arange(0, dim, 2) / dim) in float32, wavelength 2π / freq
    let computed = |low: f64, high: f64, old: f64| -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / (base as f32).powf((2 * i) as f32 / head_dim as f32);
                let wl = 2.0 * std::f64::consts::PI / freq as f64;
                let (low_wl, high_wl) = (old / low, old / high);
                if wl < high_wl {
                    1.0
                } else if wl > low_wl {
                    factor
                } else {
                    let smooth = (old / wl - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect()
    };
    let matches = |c: &[f64]| c.iter().zip(factors).all(|(a, &b)| (a - b as f64).abs() <= 1e-4 * a.abs().max(1.0));
    let scaling = |low: f64, high: f64, old: f64| {
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": old as u64,
        })
    };
    // the usual parameters first, so that a Llama 3.x file gets exactly its config back
    for old in [8192.0, 4096.0, 16384.0, 2048.0, 32768.0, 65536.0, 131072.0] {
        for (low, high) in [(1.0, 4.0), (1.0, 2.0), (2.0, 4.0), (1.0, 8.0), (0.5, 4.0)] {
            if matches(&computed(low, high, old)) {
                return Ok(Some(scaling(low, high, old)));
            }
        }
    }
    // Otherwise solve: the factors fix only the band edges old/low and old/high (scaling all three
    // by one number changes nothing). In the middle band s = 1/f's position between 1/factor and 1 is
    // (old/wl - low) / (high - low) = a/wl + b: a line through the middle band's points.
    let pts: Vec<(f64, f64)> = factors
        .iter()
        .enumerate()
        .filter(|(_, &f)| f > 1.0 + 1e-6 && (f as f64) < factor - 1e-6)
        .map(|(i, &f)| {
            let freq = 1.0 / (base as f32).powf((2 * i) as f32 / head_dim as f32);
            let s = (1.0 / f as f64 - 1.0 / factor) / (1.0 - 1.0 / factor);
            (freq as f64 / (2.0 * std::f64::consts::PI), s)
        })
        .collect();
    if pts.len() >= 2 && factor > 1.0 {
        let n = pts.len() as f64;
        let (mx, my) = (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        if sxx > 0.0 {
            let a = sxy / sxx;
            let b = my - a * mx;
            let old = 8192.0;
            // low = -b·old/a, high = (1 - b)·old/a
            let (low, high) = (-b * old / a, (1.0 - b) * old / a);
            if low > 0.0 && high > low && matches(&computed(low, high, old)) {
                return Ok(Some(scaling(low, high, old)));
            }
        }
    }
    Err(bad("do not fit the llama3 formula"))
}

/// llama.cpp tensor name → HF name (None: not a model weight, e.g. rope_freqs) for `model_type`.
/// Gemma 4's fused experts `ffn_gate_up_exps` map to `experts.gate_up_proj`, which the import splits
/// as mlx-lm's sanitize does.
fn hf_name(name: &str, model_type: &str) -> Option<String> {
    let gemma = matches!(model_type, "gemma3_text" | "gemma4_text");
    let gemma4 = model_type == "gemma4_text";
    let top = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        "rope_freqs.weight" => return None,
        // Gemma 4's per-layer inputs
        "per_layer_token_embd.weight" if gemma4 => Some("model.embed_tokens_per_layer.weight"),
        "per_layer_model_proj.weight" if gemma4 => Some("model.per_layer_model_projection.weight"),
        "per_layer_proj_norm.weight" if gemma4 => Some("model.per_layer_projection_norm.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (idx, tail) = rest.split_once('.')?;
    let (base, kind) = tail.rsplit_once('.')?;
    if gemma4 {
        // Gemma 4's tensors without a `.weight` in the HF layout, and its router's scales
        let whole = match (base, kind) {
            ("layer_output_scale", "weight") => Some("layer_scalar"),
            ("ffn_gate_inp", "scale") => Some("router.scale"),
            ("ffn_down_exps", "scale") => Some("router.per_expert_scale"),
            ("ffn_gate_up_exps", "weight") => Some("experts.gate_up_proj"),
            ("ffn_down_exps", "weight") => Some("experts.switch_glu.down_proj.weight"),
            ("ffn_gate_inp", "weight") => Some("router.proj.weight"),
            _ => None,
        };
        if let Some(w) = whole {
            return Some(format!("model.layers.{idx}.{w}"));
        }
    }
    let hf = match base {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_norm" => "input_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        // Gemma 4: the MoE block's norms, the per-layer input's gate, projection and norm
        "pre_ffw_norm_2" if gemma4 => "pre_feedforward_layernorm_2",
        "post_ffw_norm_1" if gemma4 => "post_feedforward_layernorm_1",
        "post_ffw_norm_2" if gemma4 => "post_feedforward_layernorm_2",
        "inp_gate" if gemma4 => "per_layer_input_gate",
        "proj" if gemma4 => "per_layer_projection",
        "post_norm" if gemma4 => "post_per_layer_input_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // MoE (qwen3moe): the router and the experts, stacked already
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_exps" => "mlp.switch_mlp.gate_proj",
        "ffn_up_exps" => "mlp.switch_mlp.up_proj",
        "ffn_down_exps" => "mlp.switch_mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{idx}.{hf}.{kind}"))
}

/// Undo llama.cpp's q/k row permutation (llama family): rows grouped as (head, 2, half) were
/// reordered to (head, half, 2).
fn unpermute<T: Copy + Default>(data: &[T], rows: usize, cols: usize, heads: usize) -> Vec<T> {
    let half = rows / heads / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads {
        for i in 0..half {
            for two in 0..2 {
                // stored row index (h, i, two) ← original row (h, two, i)
                let src = (h * half + i) * 2 + two;
                let dst = (h * 2 + two) * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Gemma's turn format (system text folded into the first user turn; assistant → "model").
pub const GEMMA_CHAT_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set c = messages[0]['content'] -%}
{%- set first = (c if c is string else c | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) + '\n\n' -%}
{%- set turns = messages[1:] -%}
{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns -%}
{%- if m['role'] not in ['user', 'assistant', 'model'] -%}
{{- raise_exception('Gemma supports the roles system, user and assistant, not ' ~ m['role']) -}}
{%- endif -%}
{%- set c = m['content'] -%}
{%- set text = c if c is string else c | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
{{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\n' ~ ((first if loop.first else '') ~ text) | trim ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"#;

/// The output head (the embedding when tied) that an import as `dtype` also keeps as its Q8_0
/// blocks ([`crate::models::layers::Q8_HEAD_FILE`], which the CPU decodes through): in an f32 import
/// (the CPU default), when the file stores it as Q8_0 with rows in whole blocks.
pub fn q8_head(h: &GgufHeader, dtype: OutDtype) -> Option<&super::reader::TensorInfo> {
    let t = h.tensor("output.weight").or_else(|| h.tensor("token_embd.weight"))?;
    let dims = t.shape();
    (dtype == OutDtype::F32 && t.ty == GgmlType::Q8_0 && dims.len() == 2 && dims[1].is_multiple_of(32)).then_some(t)
}

/// Bytes the Q8_0 head of [`q8_head`] takes in memory (int8 values, a float32 scale per 32).
pub fn q8_head_bytes(h: &GgufHeader, dtype: OutDtype) -> u64 {
    q8_head(h, dtype).map_or(0, |t| t.n_elements() + t.n_elements() / 32 * 4)
}

/// Whether an import as `dtype` also keeps the GGUF tensor `t` (its HF name `name`) as its blocks
/// ([`crate::models::layers::HOST_BLOCKS_FILE`], which the CPU decodes a linear's one-token rows
/// from): an f32 import (the CPU default), a linear projection's matrix, in a format with blocks
/// ([`super::dequant::blocks`]).
pub fn keeps_blocks(t: &super::reader::TensorInfo, name: &str, dtype: OutDtype) -> bool {
    dtype == OutDtype::F32 && name.ends_with("_proj.weight") && t.shape().len() == 2 && block_layout(t.ty).is_some()
}

/// Bytes the blocks of [`keeps_blocks`] take in memory (int8 values, a float32 scale per group and,
/// for the formats with a minimum, a float32 bias per group).
pub fn host_blocks_bytes(h: &GgufHeader, dtype: OutDtype) -> u64 {
    let arch = h.get("general.architecture").and_then(MetaValue::as_str).unwrap_or_default();
    let model_type = importable().iter().find(|(a, _)| *a == arch).map_or("", |(_, m)| *m);
    h.tensors
        .iter()
        .filter(|t| hf_name(&t.name, model_type).is_some_and(|name| keeps_blocks(t, &name, dtype)))
        .filter_map(|t| {
            let (n, (group, bias)) = (t.n_elements(), block_layout(t.ty)?);
            Some(n + n / group as u64 * 4 * (1 + bias as u64))
        })
        .sum()
}

/// Build the architecture from the imported tensors (lazily: nothing is computed) so that a file the
/// model cannot load — a tensor missing, of the wrong shape, one the config does not expect — is
/// refused now, naming the GGUF tensor beside the HF weight the loader names.
fn check_loads(cfg: &Value, tensors: &BTreeMap<String, Array>, gguf_names: &BTreeMap<String, String>) -> Result<()> {
    let map = tensors.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let weights = crate::weights::Weights::from_map(map, cfg)?;
    let Err(e) = crate::models::build(cfg, weights) else { return Ok(()) };
    let msg = e.to_string();
    // the HF weight the message names (the longest match: `x.weight` before `x`), else its module
    let named = gguf_names
        .iter()
        .filter(|(hf, _)| msg.contains(hf.as_str()) || msg.contains(hf.trim_end_matches(".weight")))
        .max_by_key(|(hf, _)| hf.len());
    let hint = match named {
        Some((hf, g)) => format!("GGUF tensor {g} (imported as {hf})"),
        None => {
            // a missing weight: the GGUF name it would have had
            let missing = msg.split_whitespace().find_map(|w| {
                let w = w.trim_matches(|c: char| !(c.is_alphanumeric() || c == '.' || c == '_'));
                gguf_name_of(w, cfg["model_type"].as_str().unwrap_or_default())
            });
            match missing {
                Some(g) => format!("GGUF tensor {g}"),
                None => return Err(e),
            }
        }
    };
    Err(Error::ModelLoad(format!("{hint}: {msg}")))
}

/// The llama.cpp name of HF weight `hf` (or of its module, without `.weight`), as [`hf_name`] maps it.
fn gguf_name_of(hf: &str, model_type: &str) -> Option<String> {
    let with = if hf.ends_with(".weight") || hf.ends_with(".scale") { hf.to_string() } else { format!("{hf}.weight") };
    let mut candidates: Vec<String> =
        ["token_embd", "output_norm", "output", "per_layer_token_embd", "per_layer_model_proj", "per_layer_proj_norm"]
            .iter()
            .map(|n| format!("{n}.weight"))
            .collect();
    if let Some(idx) = with.strip_prefix("model.layers.").and_then(|r| r.split('.').next()) {
        for base in GGUF_BLOCK_TENSORS {
            for kind in ["weight", "scale"] {
                candidates.push(format!("blk.{idx}.{base}.{kind}"));
            }
        }
    }
    candidates.into_iter().find(|g| {
        hf_name(g, model_type).is_some_and(|h| {
            h == with
                || h == hf
                || h.strip_suffix(".experts.gate_up_proj").is_some_and(|b| {
                    with.starts_with(&format!("{b}.experts.switch_glu."))
                        && (with.contains("gate_proj") || with.contains("up_proj"))
                })
        })
    })
}

/// The block tensor names [`hf_name`] knows.
const GGUF_BLOCK_TENSORS: [&str; 25] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "attn_norm",
    "post_attention_norm",
    "ffn_norm",
    "post_ffw_norm",
    "pre_ffw_norm_2",
    "post_ffw_norm_1",
    "post_ffw_norm_2",
    "inp_gate",
    "proj",
    "post_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_inp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "ffn_gate_up_exps",
    "layer_output_scale",
];

/// Progress: (bytes of tensors done, total bytes, current tensor).
pub type ImportProgress<'a> = &'a mut dyn FnMut(u64, u64, &str);

/// The config an import of `f` writes: [`hf_config`] with what the file's `rope_freqs.weight` says
/// (Llama 3.x's rope scaling, Gemma 4's partial rotation); of the tensors only that one is read.
pub fn file_config(f: &GgufFile) -> Result<Value> {
    let h = &f.header;
    let freqs = match h.tensor("rope_freqs.weight") {
        None => None,
        Some(t) => {
            let raw = f.read_raw(t)?;
            Some(
                dequantize(t.ty, &raw, t.n_elements() as usize)
                    .map_err(|e| Error::ModelLoad(format!("{}: {e}", t.name)))?,
            )
        }
    };
    let mut cfg = hf_config(h, freqs.as_deref())?;
    let model_type = cfg["model_type"].as_str().unwrap_or_default();
    if let (Some(v), false) = (&freqs, matches!(model_type, "gemma3_text" | "gemma4_text")) {
        // Llama 3.x: the rope scaling lives in this tensor, not in the metadata
        let base = cfg["rope_theta"].as_f64().unwrap_or(10_000.0);
        let head_dim = cfg["head_dim"].as_u64().unwrap_or(0) as usize;
        if let Some(rs) = llama3_rope_scaling(v, base, head_dim)? {
            cfg["rope_scaling"] = rs;
        }
    }
    Ok(cfg)
}

/// Convert `gguf` into an mlxrs model directory at `out` (created; must not exist or be empty).
pub fn import(gguf: &Path, out: &Path, dtype: OutDtype, progress: ImportProgress<'_>) -> Result<()> {
    let f = GgufFile::open(gguf)?;
    let h = &f.header;
    let mut cfg = file_config(&f)?;
    let model_type = cfg["model_type"].as_str().unwrap_or_default().to_string();
    let gemma = model_type == "gemma3_text";
    let permute_qk = model_type == "llama";
    let heads = cfg["num_attention_heads"].as_u64().unwrap_or(1) as usize;
    let kv_heads = cfg["num_key_value_heads"].as_u64().unwrap_or(1) as usize;
    std::fs::create_dir_all(out).map_err(|e| Error::Io { path: out.to_path_buf(), source: e })?;
    let total: u64 = h.tensors.iter().filter_map(|t| t.nbytes()).sum();
    let mut done = 0u64;
    let mut tensors: BTreeMap<String, Array> = BTreeMap::new();
    let mut head_q8: BTreeMap<String, Array> = BTreeMap::new();
    // the linear projections' own blocks beside their f32 values (keeps_blocks)
    let mut host: BTreeMap<String, Array> = BTreeMap::new();
    // HF name → the GGUF tensor it came from, to name the file's tensor in an error
    let mut gguf_names: BTreeMap<String, String> = BTreeMap::new();
    let head_name = q8_head(h, dtype).map(|t| t.name.clone());
    let group = 64;
    for t in &h.tensors {
        let Some(name) = hf_name(&t.name, &model_type) else {
            done += t.nbytes().unwrap_or(0);
            continue;
        };
        progress(done, total, &t.name);
        let raw = f.read_raw(t)?;
        let n = t.n_elements() as usize;
        let dims = t.shape();
        // llama's q/k rows as llama.cpp's converter permuted them: the heads to undo it over
        let qk_heads = match name.as_str() {
            _ if !permute_qk || dims.len() != 2 => None,
            n if n.ends_with("q_proj.weight") => Some(heads),
            n if n.ends_with("k_proj.weight") => Some(kv_heads),
            _ => None,
        };
        let is_head = head_name.as_deref() == Some(t.name.as_str());
        if is_head || keeps_blocks(t, &name, dtype) {
            let bl = blocks(t.ty, &raw, n)
                .map_err(|e| Error::ModelLoad(format!("{}: {e}", t.name)))?
                .ok_or_else(|| Error::ModelLoad(format!("{}: {} has no blocks", t.name, t.ty.name())))?;
            let (rows, cols) = (dims[0] as usize, dims[1] as usize);
            let g = cols / bl.group;
            let shape = [rows as i32, cols as i32];
            let gshape = [rows as i32, g as i32];
            if is_head {
                use crate::models::layers::{Q8_HEAD_SCALES, Q8_HEAD_VALUES};
                head_q8.insert(Q8_HEAD_VALUES.into(), Array::from_slice(&bl.q, &shape)?);
                head_q8.insert(Q8_HEAD_SCALES.into(), Array::from_slice(&bl.s, &gshape)?);
            } else {
                use crate::models::layers::HostBlocks;
                let base = name.trim_end_matches(".weight");
                // the same rows as the f32 values below
                let rows_of = |v: Vec<f32>, width: usize| match qk_heads {
                    Some(h) => unpermute(&v, rows, width, h),
                    None => v,
                };
                let q = match qk_heads {
                    Some(h) => unpermute(&bl.q, rows, cols, h),
                    None => bl.q,
                };
                host.insert(HostBlocks::values_name(base), Array::from_slice(&q, &shape)?);
                host.insert(HostBlocks::scales_name(base), Array::from_slice(&rows_of(bl.s, g), &gshape)?);
                if let Some(b) = bl.b {
                    host.insert(HostBlocks::biases_name(base), Array::from_slice(&rows_of(b, g), &gshape)?);
                }
            }
        }
        let mut v = dequantize(t.ty, &raw, n).map_err(|e| Error::ModelLoad(format!("{}: {e}", t.name)))?;
        drop(raw);
        let shape: Vec<i32> = t.shape().iter().map(|&d| d as i32).collect();
        let is_norm = name.ends_with("norm.weight");
        if gemma && is_norm {
            // llama.cpp stores Gemma's norm weights as w + 1
            v.iter_mut().for_each(|x| *x -= 1.0);
        }
        if let Some(h) = qk_heads {
            v = unpermute(&v, shape[0] as usize, shape[1] as usize, h);
        }
        let a = Array::from_slice(&v, &shape)?;
        drop(v);
        // Gemma 4's fused experts [experts, 2 × width, hidden]: gate and up halves (mlx-lm's sanitize)
        let parts = match name.strip_suffix(".experts.gate_up_proj") {
            Some(base) => {
                if shape.len() != 3 || shape[1] % 2 != 0 {
                    return Err(Error::ModelLoad(format!(
                        "GGUF tensor {} has shape {shape:?}: not [experts, 2 × width, hidden]",
                        t.name
                    )));
                }
                let halves = mx::split(&a, 2, 1)?;
                vec![
                    (format!("{base}.experts.switch_glu.gate_proj.weight"), mx::contiguous(&halves[0])?),
                    (format!("{base}.experts.switch_glu.up_proj.weight"), mx::contiguous(&halves[1])?),
                ]
            }
            None => vec![(name, a)],
        };
        for (name, a) in parts {
            gguf_names.insert(name.clone(), t.name.clone());
            let shape = a.shape();
            // matrices, and the stacked experts ([experts, out, in]) of a MoE
            let quantizable = (2..=3).contains(&shape.len()) && !is_norm && shape[shape.len() - 1] % group == 0;
            match dtype.bits() {
                Some(bits) if quantizable => {
                    let fa = mx::astype(&a, Dtype::Bfloat16)?;
                    let (w, s, b) = mx::quantize(&fa, group, bits)?;
                    mx::eval(&[&w, &s, &b])?;
                    let base = name.trim_end_matches(".weight");
                    tensors.insert(format!("{base}.scales"), s);
                    tensors.insert(format!("{base}.biases"), b);
                    tensors.insert(name, w);
                }
                _ => {
                    let c = mx::astype(&a, dtype.float())?;
                    c.eval()?;
                    tensors.insert(name, c);
                }
            }
        }
        done += t.nbytes().unwrap_or(0);
    }
    progress(total, total, "writing model.safetensors");
    cfg["torch_dtype"] = json!(match dtype.float() {
        Dtype::Float16 => "float16",
        Dtype::Float32 => "float32",
        _ => "bfloat16",
    });
    if let Some(bits) = dtype.bits() {
        cfg["quantization"] = json!({"group_size": group, "bits": bits, "mode": "affine"});
    }
    check_loads(&cfg, &tensors, &gguf_names)?;
    let meta: BTreeMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    mx::save_safetensors(&out.join("model.safetensors"), &tensors, &meta)?;
    drop(tensors);
    // not model*.safetensors: mlx-lm, which reads only those, loads the directory unchanged
    if !head_q8.is_empty() {
        mx::save_safetensors(&out.join(crate::models::layers::Q8_HEAD_FILE), &head_q8, &meta)?;
    }
    if !host.is_empty() {
        mx::save_safetensors(&out.join(crate::models::layers::HOST_BLOCKS_FILE), &host, &meta)?;
    }
    let (tok, mut tok_cfg) = super::tokenizer::build_tokenizer_json(h)?;
    let write = |name: &str, v: &Value| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).unwrap_or_default())
            .map_err(|e| Error::Io { path: p, source: e })
    };
    // EOS ids: the file's, plus Gemma's end-of-turn marker when the vocabulary has it (Gemma 3's
    // <end_of_turn>, Gemma 4's <turn|>: llama.cpp ends a generation on them too)
    let mut eos: Vec<u64> = cfg.get("eos_token_id").and_then(Value::as_u64).into_iter().collect();
    let end_of_turn = match model_type.as_str() {
        "gemma3_text" => Some("<end_of_turn>"),
        "gemma4_text" => Some("<turn|>"),
        _ => None,
    };
    if let Some(marker) = end_of_turn {
        if let Some(id) = h
            .get("tokenizer.ggml.tokens")
            .and_then(MetaValue::as_array)
            .and_then(|a| a.iter().position(|t| t.as_str() == Some(marker)))
        {
            if !eos.contains(&(id as u64)) {
                eos.push(id as u64);
            }
        }
    }
    // Gemma GGUFs converted from base checkpoints often carry no template; Gemma's turn format is
    // the one its tokenizer's special tokens (<start_of_turn>, <end_of_turn>) exist for.
    let fallback = if gemma && eos.len() > 1 { Some(GEMMA_CHAT_TEMPLATE) } else { None };
    if let Some(tpl) = h.get("tokenizer.chat_template").and_then(MetaValue::as_str).or(fallback) {
        std::fs::write(out.join("chat_template.jinja"), tpl)
            .map_err(|e| Error::Io { path: out.join("chat_template.jinja"), source: e })?;
        if let Some(o) = tok_cfg.as_object_mut() {
            o.remove("chat_template");
        }
    }
    write("tokenizer.json", &tok)?;
    write("tokenizer_config.json", &tok_cfg)?;
    write("generation_config.json", &json!({"eos_token_id": eos, "bos_token_id": cfg.get("bos_token_id")}))?;
    cfg["mlxrs_source"] = json!({"gguf": gguf.file_name().map(|s| s.to_string_lossy().into_owned()),
                                 "dtype": dtype.name(),
                                 "file_type": h.get("general.file_type").and_then(MetaValue::as_u64)});
    write("config.json", &cfg)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// convert_hf_to_gguf's factors for a llama3 rope_scaling (an independent transcription).
    fn factors(base: f32, dim: usize, factor: f32, low: f32, high: f32, old: f32) -> Vec<f32> {
        (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / base.powf((2 * i) as f32 / dim as f32);
                let wl = 2.0 * std::f32::consts::PI / freq;
                if wl < old / high {
                    1.0
                } else if wl > old / low {
                    factor
                } else {
                    let s = (old / wl - low) / (high - low);
                    1.0 / ((1.0 - s) / factor + s)
                }
            })
            .collect()
    }

    #[test]
    fn llama31_and_llama32_factors_give_their_configs_back() {
        for factor in [8.0, 32.0] {
            let f = factors(500_000.0, 128, factor, 1.0, 4.0, 8192.0);
            let got = llama3_rope_scaling(&f, 500_000.0, 128).unwrap().unwrap();
            assert_eq!(
                got,
                json!({"rope_type": "llama3", "factor": factor as f64, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
            );
        }
    }

    /// convert_hf_to_gguf's Gemma 4 rope_freqs: 1 for the rotated pairs, 1e30 for the others.
    #[test]
    fn gemma4_rope_freqs_give_the_partial_rotary_factor() {
        let factors = |rot: usize, n: usize| -> Vec<f32> { (0..n).map(|i| if i < rot { 1.0 } else { 1e30 }).collect() };
        assert_eq!(gemma4_partial_rotary(&factors(64, 256), 512).unwrap(), 0.25);
        assert_eq!(gemma4_partial_rotary(&factors(32, 32), 64).unwrap(), 1.0);
        // the wrong length, nothing rotated, a factor that is neither
        assert!(gemma4_partial_rotary(&factors(64, 256), 256).is_err());
        assert!(gemma4_partial_rotary(&factors(0, 32), 64).is_err());
        let mut odd = factors(8, 32);
        odd[20] = 2.0;
        assert!(gemma4_partial_rotary(&odd, 64).unwrap_err().to_string().contains("rope_freqs.weight"));
    }

    #[test]
    fn gemma4_names_round_trip() {
        for (g, hf) in [
            ("per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"),
            ("blk.3.layer_output_scale.weight", "model.layers.3.layer_scalar"),
            ("blk.0.ffn_gate_inp.scale", "model.layers.0.router.scale"),
            ("blk.0.ffn_down_exps.scale", "model.layers.0.router.per_expert_scale"),
            ("blk.1.inp_gate.weight", "model.layers.1.per_layer_input_gate.weight"),
            ("blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
        ] {
            assert_eq!(hf_name(g, "gemma4_text").as_deref(), Some(hf));
            assert_eq!(gguf_name_of(hf, "gemma4_text").as_deref(), Some(g));
        }
        // the split experts name their fused tensor
        assert_eq!(
            gguf_name_of("model.layers.2.experts.switch_glu.up_proj.weight", "gemma4_text").as_deref(),
            Some("blk.2.ffn_gate_up_exps.weight")
        );
        // Gemma 4's names are not another architecture's
        assert_eq!(hf_name("blk.1.inp_gate.weight", "llama"), None);
        assert_eq!(
            hf_name("blk.1.ffn_norm.weight", "llama").as_deref(),
            Some("model.layers.1.post_attention_layernorm.weight")
        );
    }

    #[test]
    fn unusual_bands_are_solved_and_unit_factors_mean_none() {
        let f = factors(10_000.0, 64, 8.0, 1.0, 4.0, 256.0);
        let got = llama3_rope_scaling(&f, 10_000.0, 64).unwrap().unwrap();
        let old = got["original_max_position_embeddings"].as_f64().unwrap();
        let (low, high) = (got["low_freq_factor"].as_f64().unwrap(), got["high_freq_factor"].as_f64().unwrap());
        assert!((old / low - 256.0).abs() < 1e-3 && (old / high - 64.0).abs() < 1e-3, "{got}");
        assert!(llama3_rope_scaling(&[1.0; 32], 10_000.0, 64).unwrap().is_none());
        assert!(llama3_rope_scaling(&f[..10], 10_000.0, 64).is_err());
        let odd: Vec<f32> = f.iter().enumerate().map(|(i, x)| if i % 3 == 0 { x * 1.3 } else { *x }).collect();
        assert!(llama3_rope_scaling(&odd, 10_000.0, 64).is_err());
    }
}
