//! Qwen3.5 (text): the Qwen3-Next decoder (`qwen3_next.rs`) with Qwen3.5's separate Gated DeltaNet
//! input projections, mlx-lm's config defaults and rotary `rope_parameters`; a multimodal
//! checkpoint's config nests it in `text_config` and its weights under `model.language_model`
//! (its vision tower, when the checkpoint has one, is taken out first by `vision::qwen3_5`; what
//! remains of it is dropped). mlx-lm's `models/qwen3_5.py`; with images, mlx-vlm's M-RoPE
//! positions (`qwen3_next::MRope`).
use super::arch::Arch;
use super::qwen3_next::{fix_conv_and_norms, Flavor, Model, Params};
use crate::error::Result;
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "qwen3_5",
    model_types: &["qwen3_5"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w, Flavor::Qwen35)?)),
    layout: |c| Ok(Params::from_config(c, Flavor::Qwen35)?.layout()),
    gguf: None,
};

/// mlx-lm's wrapper sanitize, in the text model's names: the vision tower dropped,
/// `model.language_model.*` and `language_model.*` brought to `model.*` / `lm_head.*`.
/// (The per-layer quantization entries of an mlx-lm conversion, `language_model.model.*`, follow.)
pub fn rename_text_weights(w: &mut Weights) -> Result<()> {
    w.retain(|k| !(k.starts_with("vision_tower") || k.starts_with("model.visual")));
    let keys: Vec<String> = w.keys().cloned().collect();
    for k in keys {
        let Some(to) = text_name(&k) else { continue };
        w.rename(&k, to);
    }
    w.rename_quant_modules(text_name);
    Ok(())
}

/// The text model's name of a wrapper's tensor or module (None: already one).
fn text_name(k: &str) -> Option<String> {
    if let Some(rest) = k.strip_prefix("model.language_model") {
        Some(format!("model{rest}"))
    } else {
        k.strip_prefix("language_model.").map(str::to_string)
    }
}

/// Then the text model's sanitize: `mtp.*` dropped, a tied lm_head dropped, conv1d weights
/// moved to MLX's layout, and, for a checkpoint still in the Hugging Face layout (a conv1d weight
/// not yet moved), the `1 + w` norms folded.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    rename_text_weights(w)?;
    text_sanitize(config, w)
}

pub fn text_sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let unsanitized =
        w.keys().any(|k| k.contains("conv1d.weight") && w.shape_of(k).is_some_and(|s| s.last() != Some(&1)));
    w.retain(|k| !k.contains("mtp."));
    if super::Cfg(Params::text(config)).b_or("tie_word_embeddings", false) {
        w.remove("lm_head.weight");
    }
    fix_conv_and_norms(w, unsanitized)
}
