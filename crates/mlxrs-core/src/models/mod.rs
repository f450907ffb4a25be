//! Architectures, one file per Hugging Face `model_type`, and the one registry that maps a config
//! to an implementation.
pub mod gemma3_text;
pub mod layers;
pub mod llama;
pub mod qwen2;
pub mod qwen3;

use crate::cache::{CacheOptions, LayerCache};
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
}

/// A causal language model: tokens in, logits out, over a cache it does not own.
pub trait CausalLm: Send {
    /// Logits `[B, L, vocab]` for `tokens` `[B, L]`, appending to `cache`.
    fn forward(&self, tokens: &Array, cache: &mut [LayerCache]) -> Result<Array>;
    /// A fresh cache for this model.
    fn make_cache(&self, opts: &CacheOptions) -> Vec<LayerCache>;
    fn shape(&self) -> &ModelShape;
}

/// Architectures with an implementation, and the aliases that map onto them.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3"];

fn canonical(model_type: &str) -> Option<&'static str> {
    Some(match model_type {
        "llama" | "mistral" => "llama",
        "qwen2" => "qwen2",
        "qwen3" => "qwen3",
        "gemma3_text" | "gemma3" => "gemma3_text",
        _ => return None,
    })
}

/// Build the model a config describes from its weights (after that architecture's sanitize).
pub fn build(config: &Value, mut weights: Weights) -> Result<Box<dyn CausalLm>> {
    let mt = config
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::ModelLoad("config.json has no model_type".into()))?;
    let arch = canonical(mt).ok_or_else(|| {
        Error::Unsupported(format!("model_type {mt:?} is not supported; supported: {}", SUPPORTED.join(", ")))
    })?;
    Ok(match arch {
        "llama" => {
            llama::sanitize(config, &mut weights);
            Box::new(llama::Model::load(config, weights)?)
        }
        "qwen2" => {
            llama::sanitize(config, &mut weights);
            Box::new(qwen2::load(config, weights)?)
        }
        "qwen3" => {
            llama::sanitize(config, &mut weights);
            Box::new(qwen3::load(config, weights)?)
        }
        _ => {
            gemma3_text::sanitize(config, &mut weights);
            Box::new(gemma3_text::Model::load(config, weights)?)
        }
    })
}

/// Config accessors with clear errors.
pub(crate) struct Cfg<'a>(pub &'a Value);

impl Cfg<'_> {
    pub fn i(&self, k: &str) -> Result<i32> {
        self.0
            .get(k)
            .and_then(Value::as_i64)
            .map(|v| v as i32)
            .ok_or_else(|| Error::ModelLoad(format!("config.json: {k} is missing or not an integer")))
    }
    pub fn i_or(&self, k: &str, d: i32) -> i32 {
        self.0.get(k).and_then(Value::as_i64).map(|v| v as i32).unwrap_or(d)
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
