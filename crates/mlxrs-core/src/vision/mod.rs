//! Image input: decoding and preprocessing ([`image`], pure Rust) and the vision towers that turn
//! pixels into input embeddings for the language model (one file per model family: [`gemma3`]).
//! Audio and video are not implemented.
pub mod gemma3;
pub mod image;

pub use self::image::{ImageLimits, Pixels, DEFAULT_LIMITS};
pub use gemma3::{Processor, Tower};

use crate::error::Result;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use serde_json::Value;
use std::path::Path;

/// The image processor of the model in `dir`, when its config has a vision tower mlxrs implements.
pub fn processor(config: &Value, dir: &Path, tokenizer: &Tokenizer) -> Result<Option<Processor>> {
    if gemma3::is_gemma3_vision(config) {
        return gemma3::processor(config, dir, tokenizer).map(Some);
    }
    Ok(None)
}

/// Take the vision tower's weights out of `weights` and build it (None: `processor` is None).
pub fn load(config: &Value, weights: &mut Weights, processor: Option<Processor>) -> Result<Option<Tower>> {
    match processor {
        Some(p) => Tower::load(config, weights, p).map(Some),
        None => Ok(None),
    }
}
