//! Qwen3.5's vision side (mlx-vlm 0.7.10's `models/qwen3_5/`, whose tower is `qwen3_vl/vision.py`,
//! and its processor `qwen3_vl/processing_qwen3_vl.py`):
//! - the processor keeps the aspect ratio: each image is resized (Pillow bicubic) to `smart_resize`'s
//!   size (sides multiples of `patch_size × merge_size`, the area between `min_pixels` and
//!   `max_pixels`), rescaled in float32 and normalized; a still image is two identical frames deep
//!   (`temporal_patch_size`), so every image has its own number of image tokens
//!   (`(H / patch) (W / patch) / merge²`);
//! - the tower: the patches `[C, T, p, p]` through the Conv3d patch embedding (a matmul over the
//!   flattened patch: the kernel is the stride), plus the learned position grid bilinearly
//!   interpolated to the image's patch grid; pre-LayerNorm blocks (fused qkv with biases, a 2-D
//!   rotary embedding: half the rotated channels by the row, half by the column; attention within
//!   each frame; a tanh-GELU MLP); the merger: LayerNorm, each 2×2 block of patches concatenated,
//!   a GELU MLP to the text width. Patches are ordered block by block so that a block's four are
//!   consecutive;
//! - the merge: the features in place of the image tokens, and the language model's multimodal
//!   rotary positions (M-RoPE): text tokens advance all three (t, h, w) positions together, an
//!   image's tokens take (start, start + row, start + column) over its merged grid, and the text
//!   after it resumes at one past the largest position. The generated tokens then run `delta =
//!   next position - prompt length` behind their index, as mlx-vlm's `get_rope_index` makes them.
use super::gemma3::LayerNorm;
use super::image::{ImageLimits, Pixels, Preprocess};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, AttnMask, Dtype};
use crate::models::layers::{gelu_approx_compiled, gelu_compiled, Embedding, Linear};
use crate::models::{CausalLm, Cfg};
use crate::weights::Weights;
use serde_json::Value;
use std::path::Path;

/// Whether `config` describes a Qwen3.5 model with a vision config (the tower's weights may still
/// be absent: [`has_tower`]).
pub fn is_qwen3_5_vision(config: &Value) -> bool {
    matches!(config.get("model_type").and_then(Value::as_str), Some("qwen3_5" | "qwen3_5_moe"))
        && config.get("vision_config").is_some_and(Value::is_object)
}

/// The prefixes the tower's tensors go by: Hugging Face's, mlx-vlm's, and mlx-vlm's other one.
const ROOTS: [&str; 3] = ["model.visual", "vision_tower", "model.language_model.visual"];

/// Whether the checkpoint in `dir` holds a vision tower: its merger's output layer is there (a
/// text-only conversion keeps the vision config but drops the tower's weights: that model takes no
/// images; a tower with that layer but missing others is refused naming the missing tensor).
pub fn has_tower(dir: &Path) -> Result<bool> {
    let want =
        |k: &str| ROOTS.iter().any(|r| k.strip_prefix(r).is_some_and(|rest| rest.starts_with(".merger.linear_fc2.")));
    let index = dir.join("model.safetensors.index.json");
    if let Some(v) = super::json_file(dir, "model.safetensors.index.json")? {
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::ModelLoad(format!("{}: no weight_map", index.display())))?;
        return Ok(map.keys().any(|k| want(k)));
    }
    let rd = std::fs::read_dir(dir).map_err(|e| Error::Io { path: dir.to_path_buf(), source: e })?;
    for p in rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "safetensors")) {
        if crate::safetensors::read_header(&p)?.tensors.iter().any(|t| want(&t.name)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The prompt side: how an image is sized, announced and expanded (Qwen's image processor).
#[derive(Clone, Debug)]
pub struct Processor {
    pub patch: u32,
    pub temporal: u32,
    pub merge: u32,
    pub min_pixels: u64,
    pub max_pixels: u64,
    rescale: Option<f64>,
    normalize: Option<([f32; 3], [f32; 3])>,
    pub vision_start: String,
    pub vision_end: String,
    pub image_token: String,
    pub image_token_id: i32,
    /// `vision_start + image_token + vision_end`: what stands for one image in a prompt.
    pub marker: String,
    /// The video processor's (video_preprocessor_config.json): the area bounds of a video (all its
    /// frames together, as `smart_resize` counts them) and the frame rate its timestamps assume.
    pub video_min_pixels: u64,
    pub video_max_pixels: u64,
    pub fps: f64,
    /// The frame counts a decoded video file is sampled to (`min_frames`, `max_frames`; mlx-vlm's
    /// `load_video` reads them off the video processor, defaults 4 and 768).
    pub min_frames: u32,
    pub max_frames: u32,
    pub video_token: String,
    pub video_token_id: i32,
    /// `vision_start + video_token + vision_end`: what stands for one video in a prompt.
    pub video_marker: String,
}

/// mlx-vlm's `_smart_resize_video`: the (height, width) every frame of a `t`-frame video of
/// `h`×`w` is resized to, the area of the frames (`t` rounded up to `tf`) within bounds.
pub fn smart_resize_video(
    t: u32,
    h: u32,
    w: u32,
    tf: u32,
    factor: u32,
    min_px: u64,
    max_px: u64,
) -> Result<(u32, u32)> {
    if h < factor || w < factor {
        return Err(Error::Invalid(format!("a {w}x{h} video frame: both sides must be at least {factor} pixels")));
    }
    let (tt, hf, wf, f) = (t as f64, h as f64, w as f64, factor as f64);
    let ratio = hf.max(wf) / hf.min(wf);
    if ratio > 200.0 {
        return Err(Error::Invalid(format!(
            "a {w}x{h} video frame: absolute aspect ratio must be smaller than 200, got {ratio}"
        )));
    }
    let mut hb = (hf / f).round_ties_even() * f;
    let mut wb = (wf / f).round_ties_even() * f;
    let tb = t.div_ceil(tf) as f64 * tf as f64;
    if tb * hb * wb > max_px as f64 {
        let beta = ((tt * hf * wf) / max_px as f64).sqrt();
        hb = f.max((hf / beta / f).floor() * f);
        wb = f.max((wf / beta / f).floor() * f);
    } else if tb * hb * wb < min_px as f64 {
        let beta = (min_px as f64 / (tt * hf * wf)).sqrt();
        hb = (hf * beta / f).ceil() * f;
        wb = (wf * beta / f).ceil() * f;
    }
    if hb > u32::MAX as f64 || wb > u32::MAX as f64 {
        return Err(Error::Invalid(format!("a {w}x{h} video cannot be resized for the vision tower")));
    }
    Ok((hb as u32, wb as u32))
}

/// Hugging Face's `smart_resize` (mlx-vlm's `_smart_resize_image`): the (height, width) an image of
/// `h`×`w` is resized to, both multiples of `factor`, the area within `[min_px, max_px]`.
/// Python's `round` rounds half to even.
pub fn smart_resize(h: u32, w: u32, factor: u32, min_px: u64, max_px: u64) -> Result<(u32, u32)> {
    let (hf, wf, f) = (h as f64, w as f64, factor as f64);
    if h == 0 || w == 0 {
        return Err(Error::Invalid(format!("a {w}x{h} image is empty")));
    }
    let ratio = hf.max(wf) / hf.min(wf);
    if ratio > 200.0 {
        return Err(Error::Invalid(format!(
            "a {w}x{h} image: absolute aspect ratio must be smaller than 200, got {ratio}"
        )));
    }
    let mut hb = (hf / f).round_ties_even() * f;
    let mut wb = (wf / f).round_ties_even() * f;
    if hb * wb > max_px as f64 {
        let beta = ((hf * wf) / max_px as f64).sqrt();
        hb = f.max((hf / beta / f).floor() * f);
        wb = f.max((wf / beta / f).floor() * f);
    } else if hb * wb < min_px as f64 {
        let beta = (min_px as f64 / (hf * wf)).sqrt();
        hb = (hf * beta / f).ceil() * f;
        wb = (wf * beta / f).ceil() * f;
    }
    if hb < f || wb < f || hb > u32::MAX as f64 || wb > u32::MAX as f64 {
        return Err(Error::Invalid(format!("a {w}x{h} image cannot be resized for the vision tower")));
    }
    Ok((hb as u32, wb as u32))
}

impl Processor {
    /// The (height, width) an image of `h`×`w` is resized to.
    pub fn target_size(&self, h: u32, w: u32) -> Result<(u32, u32)> {
        smart_resize(h, w, self.patch * self.merge, self.min_pixels, self.max_pixels)
    }

    /// Image tokens of an image resized to `h`×`w`.
    pub fn tokens_for(&self, h: u32, w: u32) -> usize {
        ((h / self.patch) as usize * (w / self.patch) as usize) / (self.merge * self.merge) as usize
    }

    /// Image tokens of an image of `h`×`w` before resizing.
    pub fn tokens_of_size(&self, h: u32, w: u32) -> Result<usize> {
        let (th, tw) = self.target_size(h, w)?;
        Ok(self.tokens_for(th, tw))
    }

    /// Pixel values `[3, H, W]` of an encoded image (`what` names it in errors).
    pub fn pixels(&self, bytes: &[u8], limits: &ImageLimits, what: &str) -> Result<Pixels> {
        let size = |h, w| self.target_size(h, w);
        Preprocess::bicubic_f32_pixels(bytes, limits, what, size, self.rescale, self.normalize)
    }

    /// The processor's expansion: the `i`-th image token of `text` becomes `n_i` image tokens,
    /// `n_i` from the `i`-th image's (height, width) in `sizes` (the vision start/end tokens around
    /// it stay as they are, as mlx-vlm's processor leaves them).
    pub fn expand(&self, text: &str, sizes: &[(u32, u32)]) -> Result<String> {
        super::expand_markers(text, &self.image_token, ("image", "image(s)"), sizes.len(), |i| {
            let (h, w) = sizes[i];
            Ok(self.image_token.repeat(self.tokens_of_size(h, w)?))
        })
    }

    /// Merged rows and columns of an image or video frame of `px`'s size, and its temporal groups
    /// (1 for an image).
    fn grid(&self, px: &Pixels) -> (i32, i32, i32) {
        let (p, m) = (self.patch, self.merge);
        (px.video_frames.max(1).div_ceil(self.temporal) as i32, (px.height / p / m) as i32, (px.width / p / m) as i32)
    }

    /// Image or video tokens of preprocessed pixels.
    pub fn tokens_of(&self, px: &Pixels) -> usize {
        let (g, r, c) = self.grid(px);
        (g * r * c) as usize
    }

    /// The (height, width) a video of `frames` frames of `h`×`w` is resized to.
    pub fn video_size(&self, frames: u32, h: u32, w: u32) -> Result<(u32, u32)> {
        smart_resize_video(
            frames,
            h,
            w,
            self.temporal,
            self.patch * self.merge,
            self.video_min_pixels,
            self.video_max_pixels,
        )
    }

    /// Pixel values `[frames, 3, H, W]` of a video given as its encoded frames (each with the name
    /// errors give it): every frame decoded, of one size, resized and normalized as an image is.
    pub fn video_pixels(&self, frames: &[(&[u8], &str)], limits: &ImageLimits) -> Result<Pixels> {
        let imgs = frames.iter().map(|(b, what)| super::image::decode(b, limits, what)).collect::<Result<Vec<_>>>()?;
        let first = imgs.first().ok_or_else(|| Error::Invalid("a video needs at least one frame".into()))?;
        for (img, (_, what)) in imgs.iter().zip(frames) {
            if (img.width, img.height) != (first.width, first.height) {
                return Err(Error::Invalid(format!(
                    "{what}: a {}x{} frame in a video of {}x{} frames (a video's frames have one size)",
                    img.width, img.height, first.width, first.height
                )));
            }
        }
        let what = frames[0].1;
        let size = self
            .video_size(imgs.len() as u32, first.height, first.width)
            .map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        let pre = Preprocess::bicubic_f32(size, self.rescale, self.normalize);
        let mut data = Vec::new();
        for img in &imgs {
            data.extend(pre.run(img).data);
        }
        Ok(Pixels { height: size.0, width: size.1, data, video_frames: imgs.len() as u32 })
    }

    /// The processor's video expansion, one video marker per video in order: a video marker
    /// (vision start, video token, vision end) becomes, per temporal group of frames, `<t.t
    /// seconds>` (the mean time of the group's first and last frame), vision start, the group's
    /// video tokens and vision end; a bare video token becomes all the video's tokens. Each video
    /// is its frame count and size before resizing, and its frames' times in seconds (None: frame
    /// `i` at `i / fps`; a decoded file's: its source frame index over the source frame rate, as
    /// mlx-vlm's processor takes them from the video's metadata).
    pub fn expand_videos(&self, text: &str, videos: &[VideoShape]) -> Result<String> {
        let found = text.matches(&self.video_token).count();
        if found != videos.len() {
            return Err(Error::Invalid(format!(
                "the prompt has {found} video marker(s) ({}) for {} video(s)",
                self.video_token,
                videos.len()
            )));
        }
        let tp = self.temporal as usize;
        let (mut out, mut rest) = (String::with_capacity(text.len()), text);
        for v in videos {
            let (th, tw) = self.video_size(v.frames, v.height, v.width)?;
            let per = self.tokens_for(th, tw);
            let groups = (v.frames as usize).div_ceil(tp);
            let mut times: Vec<f64> = match &v.times {
                None => (0..groups * tp).map(|i| i as f64 / self.fps).collect(),
                Some(t) if t.len() == v.frames as usize && !t.is_empty() => t.clone(),
                Some(t) => {
                    return Err(Error::Invalid(format!("{} frame time(s) for a video of {} frames", t.len(), v.frames)))
                }
            };
            let last = *times.last().unwrap_or(&0.0);
            times.resize(groups * tp, last); // the last frame repeats to fill its group
            let at = rest.find(&self.video_token).unwrap_or(0);
            let wrapped = rest[..at].ends_with(&self.vision_start)
                && rest[at..].starts_with(&self.video_marker[self.vision_start.len()..]);
            if wrapped {
                let start = at - self.vision_start.len();
                out.push_str(&rest[..start]);
                for g in 0..groups {
                    let ts = (times[g * tp] + times[g * tp + tp - 1]) / 2.0;
                    out.push_str(&format!(
                        "<{ts:.1} seconds>{}{}{}",
                        self.vision_start,
                        self.video_token.repeat(per),
                        self.vision_end
                    ));
                }
                rest = &rest[start + self.video_marker.len()..];
            } else {
                out.push_str(&rest[..at]);
                out.push_str(&self.video_token.repeat(per * groups));
                rest = &rest[at + self.video_token.len()..];
            }
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// One video of a prompt as [`Processor::expand_videos`] takes it: its frame count, frame size
/// before resizing, and its frames' times in seconds (None: evenly at the processor's fps).
#[derive(Clone, Debug, Default)]
pub struct VideoShape {
    pub frames: u32,
    pub height: u32,
    pub width: u32,
    pub times: Option<Vec<f64>>,
}

/// The processor of a Qwen3.5 model directory: preprocessor_config.json (processor_config.json's
/// `image_processor` over it, as mlx-vlm reads them), checked against the tower's config; the
/// vision tokens from config.json's ids and the tokenizer.
/// The image processor's settings: preprocessor_config.json with processor_config.json's
/// `image_processor` over it, as mlx-vlm reads them.
fn image_processor_config(dir: &Path) -> Result<Value> {
    let mut ip = super::json_file(dir, "preprocessor_config.json")?.unwrap_or(Value::Null);
    if let Some(Value::Object(o)) =
        super::json_file(dir, "processor_config.json")?.and_then(|p| p.get("image_processor").cloned())
    {
        if !ip.is_object() {
            ip = Value::Object(Default::default());
        }
        for (k, v) in o {
            ip[k] = v;
        }
    }
    Ok(ip)
}

/// A positive integer setting of preprocessor_config.json (`dflt` when absent).
fn config_uint(v: Option<&Value>, k: &str, dflt: u64, max: u64) -> Result<u64> {
    match v {
        None | Some(Value::Null) => Ok(dflt),
        Some(x) => match x.as_u64() {
            Some(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(Error::ModelLoad(format!(
                "preprocessor_config.json: {k} = {x} is not a positive integer (at most {max})"
            ))),
        },
    }
}

/// The image processor's area bounds (min_pixels, max_pixels): `size.shortest_edge` /
/// `longest_edge`, `min_pixels` / `max_pixels` over them.
fn pixel_bounds(ip: &Value) -> Result<(u64, u64)> {
    let size = ip.get("size").cloned().unwrap_or(Value::Null);
    let px_max = 1u64 << 40;
    let mut min_pixels = config_uint(size.get("shortest_edge"), "size.shortest_edge", 56 * 56, px_max)?;
    let mut max_pixels = config_uint(size.get("longest_edge"), "size.longest_edge", 14 * 14 * 4 * 1280, px_max)?;
    min_pixels = config_uint(ip.get("min_pixels"), "min_pixels", min_pixels, px_max)?;
    max_pixels = config_uint(ip.get("max_pixels"), "max_pixels", max_pixels, px_max)?;
    if min_pixels > max_pixels {
        return Err(Error::ModelLoad(format!(
            "preprocessor_config.json: min_pixels {min_pixels} exceeds max_pixels {max_pixels}"
        )));
    }
    Ok((min_pixels, max_pixels))
}

/// The peak bytes the tower allocates while encoding one image at the processor's largest size
/// (`max_pixels`), in `a`-byte activations (the tower's dtype), on the CPU, where one block's
/// intermediates are live at a time. With N patches (`max_pixels / patch²`, two frames deep), hidden
/// h, heads H, intermediate I, patch p:
/// - the pixels, float32, as given, patch-ordered and cast: 3·N·3·t·p²·4
/// - the patch embedding, the four weighted position rows and their sum, the rotary tables
///   (float32 cos and sin): (1 + 4 + 1)·N·h·a + 2·N·(h / H)·4
/// - per block: the residual, normed input, attention output and projection, the MLP's normed input
///   and output: 6·N·h·a; q, k, v and the rotated q and k (computed in float32): 3·N·h·a + 2·N·h·4;
///   the attention scores SDPA's general path materializes, and its float32 softmax: H·N²·(a + 4);
///   the MLP's fc1 output and its GELU: 2·N·I·a
/// - the merged features: N / m² · out · a
///
/// With `host_half` (a 16-bit tower on the CPU: the host attention of `handle/half.rs`) the scores are
/// that op's scratch instead ([`crate::handle::half_attention_scratch_bytes`]).
///
/// `tests/test_vision_qwen35.py` measures MLX's peak memory over `image_features` of the largest
/// image against this (at least the measured peak, within 2× of it).
pub fn encode_transient_bytes(config: &Value, dir: &Path, a: u64, host_half: bool) -> Result<u64> {
    let d = vision_dims(config)?;
    let (_, max_pixels) = pixel_bounds(&image_processor_config(dir)?)?;
    let (p, m) = (d.patch as u64, d.merge as u64);
    let n = (max_pixels / (p * m * p * m)) * m * m;
    let (h, heads, inter, t) = (d.hidden as u64, d.heads as u64, d.inter as u64, d.temporal as u64);
    let once = 3 * n * 3 * t * p * p * 4 + 6 * n * h * a + 2 * n * (h / heads) * 4 + n / (m * m) * d.out as u64 * a;
    let scores = if host_half {
        crate::handle::half_attention_scratch_bytes(heads, heads, n, n, h / heads, h / heads)
    } else {
        heads * n * n * (a + 4)
    };
    let block = 6 * n * h * a + 3 * n * h * a + 2 * n * h * 4 + scores + 2 * n * inter * a;
    Ok(once + block)
}

pub fn processor(config: &Value, dir: &Path, tokenizer: &crate::tokenizer::Tokenizer) -> Result<Processor> {
    let d = vision_dims(config)?;
    let ip = image_processor_config(dir)?;
    let name = "preprocessor_config.json";
    let uint = |v: Option<&Value>, k: &str, dflt: u64, max: u64| config_uint(v, k, dflt, max);
    let patch = uint(ip.get("patch_size"), "patch_size", 16, 1 << 10)? as u32;
    let temporal = uint(ip.get("temporal_patch_size"), "temporal_patch_size", 2, 64)? as u32;
    let merge = uint(ip.get("merge_size"), "merge_size", 2, 64)? as u32;
    for (k, ours, theirs) in
        [("patch_size", patch, d.patch), ("temporal_patch_size", temporal, d.temporal), ("merge_size", merge, d.merge)]
    {
        if ours as i32 != theirs {
            return Err(Error::ModelLoad(format!(
                "{name}: {k} {ours} differs from config.json's vision_config ({theirs})"
            )));
        }
    }
    let (min_pixels, max_pixels) = pixel_bounds(&ip)?;
    let px_max = 1u64 << 40;
    let b = |k: &str, dflt: bool| ip.get(k).and_then(Value::as_bool).unwrap_or(dflt);
    let rescale = if b("do_rescale", true) {
        Some(match ip.get("rescale_factor") {
            None | Some(Value::Null) => 1.0 / 255.0,
            Some(x) => {
                x.as_f64().ok_or_else(|| Error::ModelLoad(format!("{name}: rescale_factor = {x} is not a number")))?
            }
        })
    } else {
        None
    };
    let three = |k: &str| -> Result<[f32; 3]> {
        match ip.get(k) {
            None | Some(Value::Null) => Ok([0.5; 3]),
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32))
            }
            Some(x) => Err(Error::ModelLoad(format!("{name}: {k} = {x} is not three numbers"))),
        }
    };
    let normalize = if b("do_normalize", true) { Some((three("image_mean")?, three("image_std")?)) } else { None };
    if normalize.is_some_and(|(_, std)| std.contains(&0.0)) {
        return Err(Error::ModelLoad(format!("{name}: image_std has a zero")));
    }
    let token = |k: &str, dflt: &str, id_key: &str, id_dflt: i64| -> Result<(String, i32)> {
        let id = match config.get(id_key) {
            None | Some(Value::Null) => id_dflt,
            Some(v) => {
                v.as_i64().ok_or_else(|| Error::ModelLoad(format!("config.json: {id_key} = {v} is not a token id")))?
            }
        };
        let text = dflt.to_string();
        match tokenizer.token_to_id(&text) {
            Some(t) if t as i64 == id => Ok((text, t)),
            Some(t) => Err(Error::ModelLoad(format!(
                "config.json: {id_key} = {id} but the tokenizer's {k} {text} is token {t}"
            ))),
            None => {
                Err(Error::ModelLoad(format!("the tokenizer has no {k} token {text} (config.json: {id_key} = {id})")))
            }
        }
    };
    let (image_token, image_token_id) = token("image", "<|image_pad|>", "image_token_id", 248056)?;
    let (vision_start, _) = token("vision start", "<|vision_start|>", "vision_start_token_id", 248045)?;
    let vision_end = "<|vision_end|>".to_string();
    if tokenizer.token_to_id(&vision_end).is_none() {
        return Err(Error::ModelLoad(format!("the tokenizer has no vision end token {vision_end}")));
    }
    let marker = format!("{vision_start}{image_token}{vision_end}");
    let (video_token, video_token_id) = token("video", "<|video_pad|>", "video_token_id", 248057)?;
    let video_marker = format!("{vision_start}{video_token}{vision_end}");
    // the video processor's settings: video_preprocessor_config.json, else preprocessor_config.json's
    let (vname, vp) = match super::json_file(dir, "video_preprocessor_config.json")? {
        Some(v) => ("video_preprocessor_config.json", v),
        None => (name, ip.clone()),
    };
    let vuint = |v: Option<&Value>, k: &str, dflt: u64| -> Result<u64> {
        match v {
            None | Some(Value::Null) => Ok(dflt),
            Some(x) => match x.as_u64() {
                Some(n) if (1..=px_max).contains(&n) => Ok(n),
                _ => Err(Error::ModelLoad(format!("{vname}: {k} = {x} is not a positive integer"))),
            },
        }
    };
    for (k, ours) in [("patch_size", patch), ("temporal_patch_size", temporal), ("merge_size", merge)] {
        if let Some(x) = vp.get(k).filter(|x| !x.is_null()) {
            if x.as_u64() != Some(ours as u64) {
                return Err(Error::ModelLoad(format!("{vname}: {k} = {x} differs from the image processor's {ours}")));
            }
        }
    }
    let vsize = vp.get("size").cloned().unwrap_or(Value::Null);
    let mut video_min_pixels = vuint(vsize.get("shortest_edge"), "size.shortest_edge", 128 * 32 * 32)?;
    let mut video_max_pixels = vuint(vsize.get("longest_edge"), "size.longest_edge", 32 * 32 * 768)?;
    video_min_pixels = vuint(vp.get("min_pixels"), "min_pixels", video_min_pixels)?;
    video_max_pixels = vuint(vp.get("max_pixels"), "max_pixels", video_max_pixels)?;
    let fps = match vp.get("fps") {
        None | Some(Value::Null) => 2.0,
        Some(x) => x
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| Error::ModelLoad(format!("{vname}: fps = {x} is not a positive number")))?,
    };
    let min_frames = vuint(vp.get("min_frames"), "min_frames", 4)?.min(u32::MAX as u64) as u32;
    let max_frames = vuint(vp.get("max_frames"), "max_frames", 768)?.min(u32::MAX as u64) as u32;
    if min_frames > max_frames {
        return Err(Error::ModelLoad(format!("{vname}: min_frames {min_frames} exceeds max_frames {max_frames}")));
    }
    let same = |k: &str| vp.get(k).filter(|x| !x.is_null()).is_some_and(|x| Some(x) != ip.get(k));
    if ["do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std"].iter().any(|k| same(k)) {
        return Err(Error::Unsupported(format!(
            "{vname}: a rescale or normalization other than the image processor's is not supported"
        )));
    }
    Ok(Processor {
        patch,
        temporal,
        merge,
        min_pixels,
        max_pixels,
        rescale,
        normalize,
        vision_start,
        vision_end,
        image_token,
        image_token_id,
        marker,
        video_min_pixels,
        video_max_pixels,
        fps,
        min_frames,
        max_frames,
        video_token,
        video_token_id,
        video_marker,
    })
}

/// The tower's sizes (mlx-vlm's `qwen3_vl` VisionConfig defaults), checked.
#[derive(Clone, Copy, Debug)]
struct VisionDims {
    depth: i32,
    hidden: i32,
    inter: i32,
    heads: i32,
    channels: i32,
    patch: i32,
    merge: i32,
    temporal: i32,
    out: i32,
    /// Side of the learned position grid (num_position_embeddings = side²).
    side: i32,
}

fn vision_dims(config: &Value) -> Result<VisionDims> {
    let v = config.get("vision_config").unwrap_or(&Value::Null);
    let c = Cfg(v);
    let f = |k: &str, d: i64, max: i64| -> Result<i32> {
        c.size(k, Some(d), max).map_err(|e| match e {
            Error::ModelLoad(m) => Error::ModelLoad(m.replacen("config.json: ", "config.json: vision_config.", 1)),
            e => e,
        })
    };
    use crate::models::limits::*;
    let d = VisionDims {
        depth: f("depth", 32, LAYERS)?,
        hidden: f("hidden_size", 1280, HIDDEN)?,
        inter: f("intermediate_size", 3420, INTERMEDIATE)?,
        heads: f("num_heads", 16, HEADS)?,
        channels: f("in_channels", 3, 3)?,
        patch: f("patch_size", 14, 1 << 10)?,
        merge: f("spatial_merge_size", 2, 64)?,
        temporal: f("temporal_patch_size", 2, 64)?,
        out: f("out_hidden_size", 1536, HIDDEN)?,
        side: {
            let n = f("num_position_embeddings", 2304, 1 << 24)?;
            let side = (n as f64).sqrt() as i32;
            if side * side != n {
                return Err(Error::ModelLoad(format!(
                    "config.json: vision_config.num_position_embeddings {n} is not a square (a grid of positions)"
                )));
            }
            side
        },
    };
    if d.channels != 3 {
        return Err(Error::ModelLoad(format!("config.json: vision_config.in_channels {} is not 3 (RGB)", d.channels)));
    }
    if d.hidden % d.heads != 0 || (d.hidden / d.heads) % 4 != 0 {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.hidden_size {} over num_heads {} is not a head size divisible by 4 (the 2-D rotary embedding)",
            d.hidden, d.heads
        )));
    }
    if let Some(ds) = v.get("deepstack_visual_indexes").and_then(Value::as_array).filter(|a| !a.is_empty()) {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.deepstack_visual_indexes = {ds:?}: Qwen3.5 has no deepstack (mlx-vlm refuses it too)"
        )));
    }
    let text = crate::models::qwen3_next::Params::text(config);
    let text_hidden = Cfg(text).size("hidden_size", Some(4096), HIDDEN)?;
    if d.out != text_hidden {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.out_hidden_size {} differs from the text model's hidden_size {text_hidden}",
            d.out
        )));
    }
    Ok(d)
}

struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

/// The tower and its merger, on the engine thread.
pub struct Tower {
    /// The patch embedding as a matrix `[C·T·p·p, hidden]` (the flattened patch's order) and its bias.
    patch_wt: Array,
    patch_b: Array,
    pos_embed: Embedding,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    d: VisionDims,
    pub processor: Processor,
}

/// mlx-vlm's `ensure_fused_sdpa`: the head size zero-padded up to the next size MLX's fused
/// attention kernel takes (64, 80, 128), the output cut back (the same kernel as mlx-vlm's).
fn fused_sdpa(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let d = q.dim(-1);
    let target = [64, 80, 128].into_iter().find(|&t| d <= t).unwrap_or(d);
    if target == d {
        return crate::models::sdpa::attention(q, k, v, scale, AttnMask::None, None);
    }
    let n = q.ndim() as i32;
    let pad = |a: &Array| -> Result<Array> {
        let z = mx::scalar_as(0.0, a.dtype())?;
        mx::pad(a, &[n - 1], &[0], &[target - d], &z)
    };
    let o = crate::models::sdpa::attention(&pad(q)?, &pad(k)?, &pad(v)?, scale, AttnMask::None, None)?;
    mx::slice_axis(&o, -1, 0, d)
}

fn rotate_half(x: &Array) -> Result<Array> {
    let n = x.dim(-1);
    let x1 = mx::slice_axis(x, -1, 0, n / 2)?;
    let x2 = mx::slice_axis(x, -1, n / 2, n)?;
    mx::concatenate(&[&mx::negative(&x2)?, &x1], -1)
}

impl Tower {
    /// Take the tower's weights (`model.visual.*` or mlx-vlm's `vision_tower.*`) out of `w`.
    pub fn load(config: &Value, w: &mut Weights, processor: Processor) -> Result<Tower> {
        let d = vision_dims(config)?;
        let root = ROOTS.iter().find(|r| w.contains(&format!("{r}.patch_embed.proj.weight"))).ok_or_else(|| {
            Error::ModelLoad("the checkpoint has no vision tower weights (model.visual.patch_embed.proj.weight)".into())
        })?;
        let (h, c, t, p) = (d.hidden, d.channels, d.temporal, d.patch);
        let name = format!("{root}.patch_embed.proj.weight");
        let pw = w.take(&name)?;
        // PyTorch's Conv3d layout [out, C, T, p, p], or MLX's [out, T, p, p, C]
        let pw = match pw.shape().as_slice() {
            [o, cc, tt, a, b] if *o == h && *cc == c && *tt == t && *a == p && *b == p => pw,
            [o, tt, a, b, cc] if *o == h && *cc == c && *tt == t && *a == p && *b == p => mx::transpose_axes(&pw, &[0, 4, 1, 2, 3])?,
            s => {
                return Err(Error::ModelLoad(format!(
                    "weight {name} has shape {s:?}, not [{h}, {c}, {t}, {p}, {p}] (hidden, channels, temporal_patch_size, patch_size²)"
                )))
            }
        };
        let patch_wt = mx::transpose(&mx::reshape(&pw, &[h, c * t * p * p])?)?;
        let patch_b = w.take_shaped(&format!("{root}.patch_embed.proj.bias"), &[h])?;
        let pos_embed = Embedding::load(w, &format!("{root}.pos_embed"), d.side * d.side, h)?;
        let mut blocks = Vec::with_capacity(d.depth as usize);
        for i in 0..d.depth {
            let b = format!("{root}.blocks.{i}");
            blocks.push(Block {
                norm1: LayerNorm::load(w, &format!("{b}.norm1"), h, 1e-6)?,
                norm2: LayerNorm::load(w, &format!("{b}.norm2"), h, 1e-6)?,
                qkv: Linear::load(w, &format!("{b}.attn.qkv"), true, 3 * h, h)?,
                proj: Linear::load(w, &format!("{b}.attn.proj"), true, h, h)?,
                fc1: Linear::load(w, &format!("{b}.mlp.linear_fc1"), true, d.inter, h)?,
                fc2: Linear::load(w, &format!("{b}.mlp.linear_fc2"), true, h, d.inter)?,
            });
        }
        let mh = h * d.merge * d.merge;
        let merger_norm = LayerNorm::load(w, &format!("{root}.merger.norm"), h, 1e-6)?;
        let merger_fc1 = Linear::load(w, &format!("{root}.merger.linear_fc1"), true, mh, mh)?;
        let merger_fc2 = Linear::load(w, &format!("{root}.merger.linear_fc2"), true, d.out, mh)?;
        Ok(Tower { patch_wt, patch_b, pos_embed, blocks, merger_norm, merger_fc1, merger_fc2, d, processor })
    }

    /// The learned position grid bilinearly interpolated to `gh`×`gw` patches (mlx-vlm's
    /// `fast_pos_embed_interpolate`: `linspace` corners in float32, the four weighted rows summed in
    /// order), in block order, repeated for `gt` frames: `[gt·gh·gw, hidden]`.
    fn pos_embeds(&self, gt: i32, gh: i32, gw: i32) -> Result<Array> {
        let side = self.d.side;
        let lin = |n: i32| -> Vec<f32> {
            if n == 1 {
                return vec![0.0];
            }
            (0..n).map(|i| (i as f32 / (n - 1) as f32) * (side - 1) as f32).collect()
        };
        let (hs, ws) = (lin(gh), lin(gw));
        let n = (gh * gw) as usize;
        let mut idx = vec![0i32; 4 * n];
        let mut wts = vec![0f32; 4 * n];
        for (i, &hv) in hs.iter().enumerate() {
            let (hf, hc) = (hv as i32, (hv as i32 + 1).min(side - 1));
            let dh = hv - hf as f32;
            for (j, &wv) in ws.iter().enumerate() {
                let (wf, wc) = (wv as i32, (wv as i32 + 1).min(side - 1));
                let dw = wv - wf as f32;
                let k = i * gw as usize + j;
                idx[k] = hf * side + wf;
                idx[n + k] = hf * side + wc;
                idx[2 * n + k] = hc * side + wf;
                idx[3 * n + k] = hc * side + wc;
                wts[k] = (1.0 - dh) * (1.0 - dw);
                wts[n + k] = (1.0 - dh) * dw;
                wts[2 * n + k] = dh * (1.0 - dw);
                wts[3 * n + k] = dh * dw;
            }
        }
        let e = self.pos_embed.forward(&Array::from_slice(&idx, &[4, n as i32])?)?;
        let wt = mx::astype(&Array::from_slice(&wts, &[4, n as i32, 1])?, e.dtype())?;
        let e = mx::multiply(&e, &wt)?;
        let part = |i: i32| -> Result<Array> { mx::squeeze(&mx::slice_axis(&e, 0, i, i + 1)?, &[0]) };
        let sum = mx::add(&mx::add(&mx::add(&part(0)?, &part(1)?)?, &part(2)?)?, &part(3)?)?;
        let (m, h) = (self.d.merge, self.d.hidden);
        let blocks = mx::reshape(&sum, &[gh / m, m, gw / m, m, h])?;
        let blocks = mx::reshape(&mx::transpose_axes(&blocks, &[0, 2, 1, 3, 4])?, &[n as i32, h])?;
        if gt == 1 {
            return Ok(blocks);
        }
        let reps: Vec<&Array> = (0..gt).map(|_| &blocks).collect();
        mx::concatenate(&reps, 0)
    }

    /// cos and sin `[N, 1, head_dim]` (float32) of the 2-D rotary embedding of `gt` frames of
    /// `gh`×`gw` patches in block order: the row's then the column's frequencies (mlx-vlm's
    /// `rot_pos_emb`), each duplicated.
    fn rope(&self, gt: i32, gh: i32, gw: i32) -> Result<(Array, Array)> {
        let dim = self.d.hidden / self.d.heads / 2;
        let exps = mx::divide(&mx::arange(0.0, dim as f64, 2.0, Dtype::Float32)?, &Array::f32(dim as f32)?)?;
        let inv = mx::divide(&Array::f32(1.0)?, &mx::power(&Array::f32(10000.0)?, &exps)?)?;
        let max_hw = gh.max(gw);
        let seq = mx::arange(0.0, max_hw as f64, 1.0, Dtype::Float32)?;
        let table = mx::multiply(&mx::reshape(&seq, &[-1, 1])?, &mx::reshape(&inv, &[1, -1])?)?;
        let m = self.d.merge;
        let (mut rows, mut cols) = (Vec::new(), Vec::new());
        for _ in 0..gt {
            for bh in 0..gh / m {
                for bw in 0..gw / m {
                    for ih in 0..m {
                        for iw in 0..m {
                            rows.push(bh * m + ih);
                            cols.push(bw * m + iw);
                        }
                    }
                }
            }
        }
        let n = rows.len() as i32;
        let fr = mx::take(&table, &Array::from_slice(&rows, &[n])?, 0)?;
        let fc = mx::take(&table, &Array::from_slice(&cols, &[n])?, 0)?;
        let emb = mx::concatenate(&[&fr, &fc], -1)?;
        let dup = |a: Array| -> Result<Array> { mx::expand_dims(&mx::concatenate(&[&a, &a], -1)?, 1) };
        Ok((dup(mx::cos(&emb)?)?, dup(mx::sin(&emb)?)?))
    }

    /// The merged features `[gt·gh·gw / merge², out_hidden]` of an image (one frame, repeated to
    /// the temporal patch) or a video (its frames, the last repeated up to a multiple of it), in
    /// `dtype`.
    fn encode(&self, px: &Pixels, dtype: Dtype) -> Result<Array> {
        let d = &self.d;
        let (p, m, t) = (d.patch, d.merge, d.temporal);
        let (hh, ww) = (px.height as i32, px.width as i32);
        let frames = px.video_frames.max(1) as usize;
        let frame = (3 * hh * ww) as usize;
        if hh % (p * m) != 0 || ww % (p * m) != 0 || px.data.len() != frames * frame {
            return Err(Error::Invalid(format!(
                "pixel values of {ww}x{hh}: not a grid of {m}x{m} blocks of {p}x{p} patches"
            )));
        }
        let (gh, gw) = (hh / p, ww / p);
        let nf = (frames as i32 + t - 1) / t * t;
        let mut data = Vec::with_capacity(nf as usize * frame);
        for i in 0..nf as usize {
            let f = i.min(frames - 1);
            data.extend_from_slice(&px.data[f * frame..(f + 1) * frame]);
        }
        let gt = nf / t;
        let n = gt * gh * gw;
        let x = Array::from_slice(&data, &[gt, t, 3, gh / m, m, p, gw / m, m, p])?;
        let x = mx::transpose_axes(&x, &[0, 3, 6, 4, 7, 2, 1, 5, 8])?;
        let x = mx::astype(&mx::reshape(&x, &[n, 3 * t * p * p])?, self.patch_wt.dtype())?;
        let mut h = mx::addmm(&self.patch_b, &x, &self.patch_wt, 1.0, 1.0)?;
        h = mx::add(&h, &self.pos_embeds(gt, gh, gw)?)?;
        let (cos, sin) = self.rope(gt, gh, gw)?;
        let (heads, hd) = (d.heads, d.hidden / d.heads);
        let per = gh * gw; // attention within each frame
        let scale = (hd as f32).powf(-0.5);
        let rot = |x: &Array| -> Result<Array> {
            let y = mx::add(&mx::multiply(x, &cos)?, &mx::multiply(&rotate_half(x)?, &sin)?)?;
            mx::astype(&y, x.dtype())
        };
        for b in &self.blocks {
            let y = b.norm1.forward(&h)?;
            let qkv = mx::reshape(&b.qkv.forward(&y)?, &[n, 3, heads, hd])?;
            let part = |i: i32| -> Result<Array> { mx::squeeze(&mx::slice_axis(&qkv, 1, i, i + 1)?, &[1]) };
            let heads_first = |a: Array| -> Result<Array> { mx::expand_dims(&mx::transpose_axes(&a, &[1, 0, 2])?, 0) };
            let q = heads_first(rot(&part(0)?)?)?;
            let k = heads_first(rot(&part(1)?)?)?;
            let v = heads_first(part(2)?)?;
            let mut outs = Vec::with_capacity(gt as usize);
            for f in 0..gt {
                let s = |a: &Array| mx::slice_axis(a, 2, f * per, (f + 1) * per);
                outs.push(fused_sdpa(&s(&q)?, &s(&k)?, &s(&v)?, scale)?);
            }
            let refs: Vec<&Array> = outs.iter().collect();
            let o = mx::concatenate(&refs, 2)?;
            let o = mx::reshape(&mx::transpose_axes(&o, &[0, 2, 1, 3])?, &[n, d.hidden])?;
            h = mx::add(&h, &b.proj.forward(&o)?)?;
            let y = b.fc2.forward(&gelu_approx_compiled(&b.fc1.forward(&b.norm2.forward(&h)?)?)?)?;
            h = mx::add(&h, &y)?;
        }
        let x = mx::reshape(&self.merger_norm.forward(&h)?, &[n / (m * m), d.hidden * m * m])?;
        let f = self.merger_fc2.forward(&gelu_compiled(&self.merger_fc1.forward(&x)?)?)?;
        mx::astype(&f, dtype)
    }

    /// The features `[1, total tokens, text_hidden]` of `pixels` (each image at its own size), in
    /// `dtype` (the language model's).
    pub fn features(&self, pixels: &[&Pixels], dtype: Dtype) -> Result<Array> {
        // each image evaluated before the next is built: as one graph four mid-sized images peaked
        // at 2.4× one's, past the plan's one-image transient
        let feats = pixels
            .iter()
            .map(|p| {
                let f = self.encode(p, dtype)?;
                f.eval()?;
                Ok(f)
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Array> = feats.iter().collect();
        mx::expand_dims(&mx::concatenate(&refs, 0)?, 0)
    }

    /// The prompt's multimodal rotary positions `[L]` × (t, h, w) and the delta of the positions
    /// after it (mlx-vlm's `get_rope_index` for one sequence): each run of image tokens is the next
    /// image's merged grid, each run of video tokens the next temporal group of the video's frames
    /// (a grid one frame deep: mlx-vlm splits a video's grid so).
    pub fn positions(&self, prompt: &[i32], pixels: &[&Pixels]) -> Result<(Vec<[i32; 3]>, i32)> {
        let (img, vid) = (self.processor.image_token_id, self.processor.video_token_id);
        // the blocks in order: (token, rows, columns, which input)
        let mut blocks = Vec::new();
        for (k, px) in pixels.iter().enumerate() {
            let (g, r, c) = self.processor.grid(px);
            let tok = if px.video_frames > 0 { vid } else { img };
            blocks.extend((0..g).map(|_| (tok, r, c, k)));
        }
        let mut out = Vec::with_capacity(prompt.len());
        let (mut i, mut next, mut b) = (0usize, 0i32, 0usize);
        while i < prompt.len() {
            if prompt[i] != img && prompt[i] != vid {
                out.push([next; 3]);
                next += 1;
                i += 1;
                continue;
            }
            let &(tok, gh, gw, k) = blocks.get(b).ok_or_else(|| {
                Error::Invalid(format!(
                    "the prompt has more image or video tokens than its {} input(s) take",
                    pixels.len()
                ))
            })?;
            let n = (gh * gw) as usize;
            if prompt.len() < i + n || prompt[i..i + n].iter().any(|&t| t != tok) {
                return Err(Error::Invalid(format!(
                    "input {k} takes {n} consecutive {} tokens at position {i}; the prompt has others",
                    if tok == vid { "video" } else { "image" }
                )));
            }
            for r in 0..gh {
                for c in 0..gw {
                    out.push([next, next + r, next + c]);
                }
            }
            next += gh.max(gw);
            i += n;
            b += 1;
        }
        if b != blocks.len() {
            return Err(Error::Invalid(format!(
                "the prompt's image and video tokens take {b} of its inputs' {} blocks",
                blocks.len()
            )));
        }
        Ok((out, next - prompt.len() as i32))
    }

    /// The input embeddings `[1, L, hidden + 4]` (float32) of `prompt` with `pixels`' features at
    /// its image tokens, then per token its (t, h, w) rotary positions and the sequence's position
    /// delta in four trailing columns: what Qwen3.5's `forward_embeds` takes.
    pub fn merged_embeddings(&self, model: &dyn CausalLm, prompt: &[i32], pixels: &[&Pixels]) -> Result<Array> {
        let (img, vid) = (self.processor.image_token_id, self.processor.video_token_id);
        let media = |t: i32| t == img || t == vid;
        let found = prompt.iter().filter(|&&t| media(t)).count();
        let want: usize = pixels.iter().map(|p| self.processor.tokens_of(p)).sum();
        if found != want {
            let what = if pixels.iter().any(|p| p.video_frames > 0) { "image or video" } else { "image" };
            return Err(Error::Invalid(format!(
                "the prompt has {found} {what} tokens for {} input(s) of {want} tokens",
                pixels.len()
            )));
        }
        let (pos, delta) = self.positions(prompt, pixels)?;
        let l = prompt.len();
        let embeds = model.embed_tokens(&Array::from_slice(prompt, &[1, l as i32])?)?;
        let feats = self.features(pixels, embeds.dtype())?;
        let all = mx::concatenate(&[&embeds, &feats], 1)?;
        let mut next = 0usize;
        let idx: Vec<i32> = prompt
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                if media(t) {
                    next += 1;
                    (l + next - 1) as i32
                } else {
                    i as i32
                }
            })
            .collect();
        let merged = mx::astype(&mx::take(&all, &Array::from_slice(&idx, &[l as i32])?, 1)?, Dtype::Float32)?;
        let cols: Vec<f32> = pos.iter().flat_map(|p| [p[0] as f32, p[1] as f32, p[2] as f32, delta as f32]).collect();
        mx::concatenate(&[&merged, &Array::from_slice(&cols, &[1, l as i32, 4])?], -1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A processor of 8×8 patches two frames deep merged 2×2 (16×16 pixels a token), fps 2.
    fn proc() -> Processor {
        let (vs, ve) = ("<|vision_start|>".to_string(), "<|vision_end|>".to_string());
        Processor {
            patch: 8,
            temporal: 2,
            merge: 2,
            min_pixels: 256,
            max_pixels: 1 << 20,
            rescale: None,
            normalize: None,
            marker: format!("{vs}<|image_pad|>{ve}"),
            image_token: "<|image_pad|>".into(),
            image_token_id: 1,
            video_min_pixels: 256,
            video_max_pixels: 1 << 20,
            fps: 2.0,
            min_frames: 4,
            max_frames: 768,
            video_token: "<|video_pad|>".into(),
            video_token_id: 2,
            video_marker: format!("{vs}<|video_pad|>{ve}"),
            vision_start: vs,
            vision_end: ve,
        }
    }

    #[test]
    fn expand_videos_in_order_with_their_own_times() {
        let p = proc();
        let v = |frames, h, w, times: Option<Vec<f64>>| VideoShape { frames, height: h, width: w, times };
        let text = format!("a {} b <|video_pad|> c", p.video_marker);
        // the first: 3 frames of 32×32 at the source's times (the last repeats: groups (0, 0.7), (1.5, 1.5));
        // the second, bare: 2 frames of 16×32, 2 tokens a group, one group
        let out = p.expand_videos(&text, &[v(3, 32, 32, Some(vec![0.0, 0.7, 1.5])), v(2, 16, 32, None)]).unwrap();
        let block =
            |t: &str, n: usize| format!("<{t} seconds><|vision_start|>{}<|vision_end|>", "<|video_pad|>".repeat(n));
        assert_eq!(out, format!("a {}{} b {} c", block("0.3", 4), block("1.5", 4), "<|video_pad|>".repeat(2)));
        // evenly at fps without times: (0 + 0.5) / 2
        let even = p.expand_videos(&p.video_marker, &[v(2, 32, 32, None)]).unwrap();
        assert_eq!(even, block("0.2", 4));
        let e = p.expand_videos(&text, &[v(2, 32, 32, None)]).unwrap_err().to_string();
        assert!(e.contains("2 video marker(s)") && e.contains("for 1 video(s)"), "{e}");
        let e = p.expand_videos(&p.video_marker, &[v(3, 32, 32, Some(vec![0.0]))]).unwrap_err().to_string();
        assert!(e.contains("1 frame time(s) for a video of 3 frames"), "{e}");
    }

    #[test]
    fn smart_resize_rounds_half_to_even_and_keeps_the_budget() {
        // 40 / 16 = 2.5 rounds to 2 (Python's round), 56 / 16 = 3.5 to 4
        assert_eq!(smart_resize(40, 56, 16, 1, 1 << 30).unwrap(), (32, 64));
        let (h, w) = smart_resize(1000, 700, 16, 1024, 8192).unwrap();
        assert!(h % 16 == 0 && w % 16 == 0 && (h as u64) * (w as u64) <= 8192, "{h}x{w}");
        let (h, w) = smart_resize(5, 9, 16, 1024, 8192).unwrap();
        assert!((h as u64) * (w as u64) >= 1024, "{h}x{w}");
        let e = smart_resize(1, 300, 16, 1024, 8192).unwrap_err().to_string();
        assert!(e.contains("aspect ratio"), "{e}");
    }
}
