//! Image input: decoding and preprocessing ([`image`], pure Rust) and the vision towers that turn
//! pixels into input embeddings for the language model (one file per model family: [`gemma3`],
//! [`gemma4`], [`qwen3_5`]; Qwen3.5's also takes video, as frames). Audio input (Gemma 4): WAV
//! decoding, resampling and log-mel features ([`audio`], pure Rust) and the audio encoder
//! ([`gemma4_audio`], held by Gemma 4's tower).
pub mod audio;
pub mod gemma3;
pub mod gemma4;
pub mod gemma4_audio;
pub mod image;
pub mod qwen3_5;

pub use self::image::{ImageLimits, Pixels, DEFAULT_LIMITS};

use crate::error::{Error, Result};
use crate::handle::{Array, Dtype};
use crate::models::CausalLm;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use serde_json::Value;
use std::path::Path;

/// A JSON file of a model directory (a processor's config), or None when it is not there.
pub(crate) fn json_file(dir: &Path, name: &str) -> Result<Option<Value>> {
    crate::tokenizer::read_json(&dir.join(name))
}

/// A processor's three marker tokens — begin, end and the soft token its features replace — each
/// `(tokenizer_config.json key, default)`, asked of the tokenizer ([`Tokenizer::special_token`]):
/// each must be in the vocabulary, and the soft token's id must be config.json's `id_key` (`id`).
/// `what` names them in errors ("Gemma 3's image markers").
pub(crate) fn markers(
    tokenizer: &Tokenizer,
    names: [(&str, &str); 3],
    id_key: &str,
    id: i32,
    what: &str,
) -> Result<[String; 3]> {
    let [begin, end, soft] = names.map(|(k, dflt)| tokenizer.special_token(k).unwrap_or_else(|| dflt.to_string()));
    for t in [&begin, &end, &soft] {
        let found = tokenizer
            .token_to_id(t)
            .ok_or_else(|| Error::ModelLoad(format!("the tokenizer has no token {t:?} ({what})")))?;
        if t == &soft && found != id {
            return Err(Error::ModelLoad(format!(
                "the tokenizer's {soft} is id {found} but config.json's {id_key} is {id}"
            )));
        }
    }
    Ok([begin, end, soft])
}

/// One size of a `vision_config` (`v`), checked as the text config's are
/// ([`crate::models::Cfg::size`]) and named `config.json: vision_config.KEY` in errors.
pub(crate) fn vision_size(v: &Value, k: &str, default: Option<i64>, max: i64) -> Result<i32> {
    crate::models::Cfg(v)
        .size(k, default, max)
        .map_err(|e| Error::ModelLoad(e.to_string().replace("config.json: ", "config.json: vision_config.")))
}

/// `text` with its `i`-th `marker` replaced by `with(i)`, for `n` media items (`kind` and `items` name
/// them when the prompt's marker count is not `n`: "image" / "image(s)", "audio" / "clip(s)"). The
/// processors' marker expansions.
pub(crate) fn expand_markers(
    text: &str,
    marker: &str,
    (kind, items): (&str, &str),
    n: usize,
    mut with: impl FnMut(usize) -> Result<String>,
) -> Result<String> {
    let found = text.matches(marker).count();
    if found != n {
        return Err(Error::Invalid(format!("the prompt has {found} {kind} marker(s) ({marker}) for {n} {items}")));
    }
    let mut out = String::with_capacity(text.len());
    let mut parts = text.split(marker);
    out.push_str(parts.next().unwrap_or(""));
    for (i, part) in parts.enumerate() {
        out.push_str(&with(i)?);
        out.push_str(part);
    }
    Ok(out)
}

/// The rows of `[embeds; features]` (concatenated along the sequence) each prompt position takes:
/// the next image feature at an `image_id` token, `other(i, token)` elsewhere (its own row `i`, or
/// a row past the features). How both towers scatter image features into the token embeddings.
pub(crate) fn merge_rows(prompt: &[i32], image_id: i32, other: impl Fn(usize, i32) -> i32) -> Vec<i32> {
    let l = prompt.len();
    let mut next = 0usize;
    prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if t == image_id {
                next += 1;
                (l + next - 1) as i32
            } else {
                other(i, t)
            }
        })
        .collect()
}

/// The prompt side of a vision tower: preprocessing, the image marker and its expansion.
#[derive(Clone, Debug)]
pub enum Processor {
    Gemma3(gemma3::Processor),
    Gemma4(gemma4::Processor),
    Qwen35(qwen3_5::Processor),
}

impl Processor {
    /// Pixel values of an encoded image (`what` names it in errors).
    pub fn pixels(&self, bytes: &[u8], limits: &ImageLimits, what: &str) -> Result<Pixels> {
        match self {
            Processor::Gemma3(p) => p.pixels(bytes, limits, what),
            Processor::Gemma4(p) => p.pixels(bytes, limits, what),
            Processor::Qwen35(p) => p.pixels(bytes, limits, what),
        }
    }

    /// The text that stands for one image in a rendered prompt, before [`Processor::expand`]
    /// (Gemma 3: its boi token; Gemma 4: its image token; Qwen3.5: vision start, image pad, vision end).
    pub fn marker(&self) -> &str {
        match self {
            Processor::Gemma3(p) => &p.boi,
            Processor::Gemma4(p) => &p.image_token,
            Processor::Qwen35(p) => &p.marker,
        }
    }

    /// (boi, eoi, image token, image token id).
    pub fn tokens(&self) -> (&str, &str, &str, i32) {
        match self {
            Processor::Gemma3(p) => (&p.boi, &p.eoi, &p.image_token, p.image_token_id),
            Processor::Gemma4(p) => (&p.boi, &p.eoi, &p.image_token, p.image_token_id),
            Processor::Qwen35(p) => (&p.vision_start, &p.vision_end, &p.image_token, p.image_token_id),
        }
    }

    /// The audio side, when the model has an audio tower (Gemma 4).
    pub fn audio(&self) -> Option<&gemma4_audio::AudioProcessor> {
        match self {
            Processor::Gemma4(p) => p.audio.as_deref(),
            _ => None,
        }
    }

    pub fn image_token_id(&self) -> i32 {
        self.tokens().3
    }

    /// Image tokens per image when every image has the same count (Gemma 3); None when it depends
    /// on the image's size (Gemma 4: [`Processor::expand`] needs the sizes).
    pub fn fixed_tokens_per_image(&self) -> Option<usize> {
        match self {
            Processor::Gemma3(p) => Some(p.tokens_per_image),
            Processor::Gemma4(_) | Processor::Qwen35(_) => None,
        }
    }

    /// Image tokens at most per image.
    pub fn max_tokens_per_image(&self) -> usize {
        match self {
            Processor::Gemma3(p) => p.tokens_per_image,
            Processor::Gemma4(p) => p.max_soft_tokens as usize,
            Processor::Qwen35(p) => {
                (p.max_pixels / (p.patch as u64 * p.patch as u64 * (p.merge * p.merge) as u64)) as usize
            }
        }
    }

    /// The input size of the tower when fixed ((height, width)).
    pub fn image_size(&self) -> Option<(u32, u32)> {
        match self {
            Processor::Gemma3(p) => p.preprocess.size,
            Processor::Gemma4(_) | Processor::Qwen35(_) => None,
        }
    }

    /// Image tokens of one preprocessed image.
    pub fn tokens_of(&self, px: &Pixels) -> usize {
        match self {
            Processor::Gemma3(p) => p.tokens_per_image,
            Processor::Gemma4(p) => p.tokens_for(px.height, px.width),
            Processor::Qwen35(p) => p.tokens_of(px),
        }
    }

    /// `text` with its `images` image markers expanded to the image-token sequences; `sizes`
    /// (each image's (height, width) as decoded) when the count depends on them.
    pub fn expand(&self, text: &str, images: usize, sizes: Option<&[(u32, u32)]>) -> Result<String> {
        match self {
            Processor::Gemma3(p) => p.expand(text, images),
            Processor::Gemma4(p) => {
                let sizes = sizes.ok_or_else(|| {
                    Error::Invalid("Gemma 4's image markers expand by the images' sizes: pass them".into())
                })?;
                if sizes.len() != images {
                    return Err(Error::Invalid(format!("{} image size(s) for {images} image(s)", sizes.len())));
                }
                p.expand(text, sizes)
            }
            Processor::Qwen35(p) => {
                let sizes = sizes.ok_or_else(|| {
                    Error::Invalid("Qwen3.5's image markers expand by the images' sizes: pass them".into())
                })?;
                if sizes.len() != images {
                    return Err(Error::Invalid(format!("{} image size(s) for {images} image(s)", sizes.len())));
                }
                p.expand(text, sizes)
            }
        }
    }
}

impl Processor {
    /// The text that stands for one video in a rendered prompt (None: the model takes no video).
    pub fn video_marker(&self) -> Option<&str> {
        match self {
            Processor::Qwen35(p) => Some(&p.video_marker),
            _ => None,
        }
    }

    /// The token a video's frames stand in (None: the model takes no video).
    pub fn video_token_id(&self) -> Option<i32> {
        match self {
            Processor::Qwen35(p) => Some(p.video_token_id),
            _ => None,
        }
    }

    /// Pixel values of a video given as its encoded frames (each with the name errors give it).
    pub fn video_pixels(&self, frames: &[(&[u8], &str)], limits: &ImageLimits) -> Result<Pixels> {
        match self {
            Processor::Qwen35(p) => p.video_pixels(frames, limits),
            _ => Err(Error::Unsupported("this model's vision tower takes images only, not video".into())),
        }
    }

    /// `text` with its video markers expanded, one per video in order.
    pub fn expand_videos(&self, text: &str, videos: &[qwen3_5::VideoShape]) -> Result<String> {
        match self {
            Processor::Qwen35(p) => p.expand_videos(text, videos),
            _ => Err(Error::Unsupported("this model's vision tower takes images only, not video".into())),
        }
    }

    /// How a decoded video file is sampled to frames: (fps, min_frames, max_frames) of the video
    /// processor (None: the model takes no video).
    pub fn video_sampling(&self) -> Option<(f64, u32, u32)> {
        match self {
            Processor::Qwen35(p) => Some((p.fps, p.min_frames, p.max_frames)),
            _ => None,
        }
    }
}

/// The image processor of the model in `dir`, when its config has a vision tower mlxrs implements.
pub fn processor(config: &Value, dir: &Path, tokenizer: &Tokenizer) -> Result<Option<Processor>> {
    if gemma3::is_gemma3_vision(config) {
        return gemma3::processor(config, dir, tokenizer).map(|p| Some(Processor::Gemma3(p)));
    }
    if gemma4::is_gemma4_vision(config) {
        return gemma4::processor(config, dir, tokenizer).map(|p| Some(Processor::Gemma4(p)));
    }
    // a text-only conversion keeps the vision config without the tower: no images then
    if qwen3_5::is_qwen3_5_vision(config) && qwen3_5::has_tower(dir)? {
        return qwen3_5::processor(config, dir, tokenizer).map(|p| Some(Processor::Qwen35(p)));
    }
    Ok(None)
}

/// The peak transient bytes of encoding one image at the model's largest image size with its
/// vision tower, activations of `act_bytes` (None: no tower whose transient is modelled; the towers'
/// weights are counted with the model's either way). Qwen3.5's (a dynamic resolution up to
/// `max_pixels`), Gemma 3's (a fixed size) and Gemma 4's are modelled. `host_half`: the attention's
/// scores as the CPU's host attention for 16-bit towers holds them (`handle/half.rs`), not as MLX's.
pub fn encode_transient_bytes(config: &Value, dir: &Path, act_bytes: u64, host_half: bool) -> Result<Option<u64>> {
    if gemma3::is_gemma3_vision(config) {
        return gemma3::encode_transient_bytes(config, act_bytes, host_half).map(Some);
    }
    if qwen3_5::is_qwen3_5_vision(config) && qwen3_5::has_tower(dir)? {
        return qwen3_5::encode_transient_bytes(config, dir, act_bytes, host_half).map(Some);
    }
    if gemma4::is_gemma4_vision(config) {
        return gemma4::encode_transient_bytes(config, dir, act_bytes, host_half).map(Some);
    }
    Ok(None)
}

/// The peak bytes of encoding one audio clip of the longest length the model's feature extractor
/// keeps with its audio encoder; None for a model without a modelled audio tower.
pub fn audio_transient_bytes(config: &Value, dir: &Path) -> Result<Option<u64>> {
    if gemma4_audio::has_audio(config) {
        let (file, proc_cfg, _, _) = gemma4::processor_files(dir)?;
        return gemma4_audio::encode_transient_bytes(config, &proc_cfg, file).map(Some);
    }
    Ok(None)
}

/// A vision tower and its projector, on the engine thread.
pub enum Tower {
    Gemma3(gemma3::Tower),
    Gemma4(gemma4::Tower),
    Qwen35(qwen3_5::Tower),
}

impl Tower {
    /// The projected image features `[N or 1, tokens, text_hidden]` of `pixels` in `dtype`.
    pub fn features(&self, pixels: &[&Pixels], dtype: Dtype) -> Result<Array> {
        match self {
            Tower::Gemma3(t) => t.features(pixels, dtype),
            Tower::Gemma4(t) => t.features(pixels, dtype),
            Tower::Qwen35(t) => t.features(pixels, dtype),
        }
    }

    /// The prompt's input embeddings with the images' features at its image tokens, in the form
    /// the model's [`CausalLm::forward_embeds`] takes.
    pub fn merged_embeddings(&self, model: &dyn CausalLm, prompt: &[i32], pixels: &[&Pixels]) -> Result<Array> {
        match self {
            Tower::Gemma3(t) => t.merged_embeddings(model, prompt, pixels),
            Tower::Gemma4(t) => t.merged_embeddings(model, prompt, pixels),
            Tower::Qwen35(t) => t.merged_embeddings(model, prompt, pixels),
        }
    }
}

impl Tower {
    /// [`Tower::merged_embeddings`] with audio clips' features at the prompt's audio tokens too
    /// (a model without an audio tower refuses clips).
    pub fn merged_media(
        &self,
        model: &dyn CausalLm,
        prompt: &[i32],
        pixels: &[&Pixels],
        mels: &[&audio::Mel],
    ) -> Result<Array> {
        match self {
            Tower::Gemma4(t) => t.merged_media(model, prompt, pixels, mels),
            _ if mels.is_empty() => self.merged_embeddings(model, prompt, pixels),
            _ => Err(Error::Invalid("this model has no audio tower".into())),
        }
    }

    /// The audio tower's projected features `[tokens, text_hidden]` of clips, in `dtype`.
    pub fn audio_features(&self, mels: &[&audio::Mel], dtype: Dtype) -> Result<Array> {
        match self {
            Tower::Gemma4(t) => match &t.audio {
                Some(a) => a.features(mels, dtype),
                None => Err(Error::Invalid("this model has no audio tower".into())),
            },
            _ => Err(Error::Invalid("this model has no audio tower".into())),
        }
    }
}

/// Take the vision tower's weights out of `weights` and build it (None: `processor` is None).
pub fn load(config: &Value, weights: &mut Weights, processor: Option<Processor>) -> Result<Option<Tower>> {
    match processor {
        Some(Processor::Gemma3(p)) => gemma3::Tower::load(config, weights, p).map(|t| Some(Tower::Gemma3(t))),
        Some(Processor::Gemma4(p)) => gemma4::Tower::load(config, weights, p).map(|t| Some(Tower::Gemma4(t))),
        Some(Processor::Qwen35(p)) => qwen3_5::Tower::load(config, weights, p).map(|t| Some(Tower::Qwen35(t))),
        None => Ok(None),
    }
}
