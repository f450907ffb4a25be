//! Mistral 3 (mlx-lm's `models/mistral3.py`): the multimodal wrapper Mistral's checkpoints ship in
//! (Mistral Small 4 among them) — its text model, the vision tower and projector dropped. The text
//! model in `text_config` is `mistral4` ([`super::mistral4`]) or `ministral3`
//! ([`super::ministral3`]) when its `model_type` says so and Llama/Mistral ([`super::llama`])
//! otherwise, as mlx-lm dispatches. `tie_word_embeddings` defaults to false (mlx-lm's
//! `__post_init__`). Weights: `model.language_model.*` → `model.*`, `language_model.*` stripped.
use super::arch::{Arch, LayerLayout};
use super::{llama, ministral3, mistral4, CausalLm};
use crate::error::{Error, Result};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch { name: "mistral3", model_types: &["mistral3"], sanitize, load, layout, gguf: None };

/// The text config (tie defaulted to false) and the architecture that loads it.
fn text(config: &Value) -> Result<(Value, &'static Arch)> {
    let mut t = match config.get("text_config") {
        Some(v @ Value::Object(_)) => v.clone(),
        None | Some(Value::Null) => return Err(Error::ModelLoad("config.json: mistral3 has no text_config".into())),
        Some(v) => return Err(Error::ModelLoad(format!("config.json: text_config = {v} is not an object"))),
    };
    if t.get("tie_word_embeddings").is_none() {
        t["tie_word_embeddings"] = Value::Bool(false);
    }
    // an FP8 checkpoint says so at the top: the text model's sanitize dequantizes it
    if let (None, Some(q)) = (t.get("quantization_config"), config.get("quantization_config")) {
        t["quantization_config"] = q.clone();
    }
    let arch = match t.get("model_type").and_then(Value::as_str) {
        Some("mistral4") => &mistral4::ARCH,
        Some("ministral3") => &ministral3::ARCH,
        _ => &llama::ARCH,
    };
    Ok((t, arch))
}

/// mlx-lm's sanitize: every `vision_tower` / `multi_modal_projector` tensor dropped, the text
/// model's brought to its own names, then its architecture's sanitize.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let (t, arch) = text(config)?;
    w.retain(|k| !(k.contains("vision_tower") || k.contains("multi_modal_projector")));
    super::qwen3_5::rename_text_weights(w)?;
    (arch.sanitize)(&t, w)
}

/// The text model's layout (what `fit` and the planner read).
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    let (t, arch) = text(config)?;
    (arch.layout)(&t)
}

/// The text model.
pub fn load(config: &Value, w: Weights) -> Result<Box<dyn CausalLm>> {
    let (t, arch) = text(config)?;
    (arch.load)(&t, w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_text_config_picks_the_text_architecture() {
        let c = json!({"model_type": "mistral3", "text_config": {"model_type": "mistral4"}});
        let (t, a) = text(&c).unwrap();
        assert_eq!((a.name, t["tie_word_embeddings"].as_bool()), ("mistral4", Some(false)));
        let c =
            json!({"model_type": "mistral3", "text_config": {"model_type": "mistral", "tie_word_embeddings": true}});
        let (t, a) = text(&c).unwrap();
        assert_eq!((a.name, t["tie_word_embeddings"].as_bool()), ("llama", Some(true)));
        let c = json!({"model_type": "mistral3", "text_config": {"model_type": "ministral3"}});
        let (t, a) = text(&c).unwrap();
        assert_eq!((a.name, t["tie_word_embeddings"].as_bool()), ("ministral3", Some(false)));
        let err = |c: &Value| text(c).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(&json!({"model_type": "mistral3"})).contains("no text_config"));
    }
}
