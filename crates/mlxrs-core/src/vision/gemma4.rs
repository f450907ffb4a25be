//! Gemma 4's vision side (mlx-vlm 0.7.10's `models/gemma4/vision.py`, `gemma4.py` and
//! `processing_gemma4.py`):
//! - the processor keeps the aspect ratio: each image is resized (Pillow bicubic) to the largest
//!   size whose sides are multiples of `pooling_kernel_size × patch_size` and that holds at most
//!   `max_soft_tokens × pooling_kernel_size²` patches, rescaled to [0, 1] in float32 (no
//!   normalization by default), so every image has its own number of image tokens;
//! - the tower: the patches (`2 (x - 0.5)`) through a linear embedding, plus learned x and y position
//!   embeddings; pre/post-normed (RMS) encoder layers with q/k RMS norms, a scale-free v norm, a 2-D
//!   rotary embedding (half the head rotated by the column, half by the row), attention scale 1 and
//!   a GeGLU MLP; `pooling_kernel_size²` patches averaged into one token, scaled by sqrt(hidden);
//!   optionally standardized;
//! - the projector (`embed_vision`): a scale-free RMS norm and a linear map to the text width;
//! - the merge: the scaled token embeddings with the image features in place of the image tokens
//!   (unscaled), the per-layer inputs from the prompt with the image tokens as token 0.
use super::image::{ImageLimits, Pixels, Preprocess};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, AttnMask, Dtype};
use crate::models::layers::{gelu_approx_compiled, Linear, RmsNorm};
use crate::models::{CausalLm, Cfg};
use crate::weights::Weights;
use serde_json::Value;
use std::path::Path;

/// Whether `config` describes Gemma 4 with a vision tower.
pub fn is_gemma4_vision(config: &Value) -> bool {
    config.get("model_type").and_then(Value::as_str) == Some("gemma4")
        && config.get("vision_config").is_some_and(Value::is_object)
}

/// The prompt side: how an image is sized, announced and expanded (Gemma 4's processor).
#[derive(Clone, Debug)]
pub struct Processor {
    pub patch: u32,
    pub pool: u32,
    /// Image tokens per image at most (`max_soft_tokens`).
    pub max_soft_tokens: u32,
    rescale: Option<f64>,
    normalize: Option<([f32; 3], [f32; 3])>,
    pub boi: String,
    pub eoi: String,
    pub image_token: String,
    pub image_token_id: i32,
    /// Prompt tokens that are not text (image and audio), replaced by 0 for the per-layer inputs.
    pub media_token_ids: Vec<i32>,
    /// Why this model's images are refused (a config mlxrs does not implement for images).
    refuse: Option<String>,
    /// The audio side, when the model has an audio tower.
    pub audio: Option<Box<super::gemma4_audio::AudioProcessor>>,
}

impl Processor {
    /// mlx-vlm's `get_aspect_ratio_preserving_size`: the (height, width) an image of `h`×`w` is
    /// resized to.
    pub fn target_size(&self, h: u32, w: u32) -> Result<(u32, u32)> {
        let (p, k) = (self.patch as f64, self.pool as u64);
        let max_patches = self.max_soft_tokens as u64 * k * k;
        let target_px = max_patches as f64 * p * p;
        let factor = (target_px / (h as f64 * w as f64)).sqrt();
        let side = k * self.patch as u64;
        let mut th = (factor * h as f64 / side as f64).floor() as u64 * side;
        let mut tw = (factor * w as f64 / side as f64).floor() as u64 * side;
        if th == 0 && tw == 0 {
            return Err(Error::Invalid(format!("a {w}x{h} image cannot be resized for the vision tower")));
        }
        let max_side = (max_patches / (k * k)) * side;
        if th == 0 {
            th = side;
            tw = ((w as f64 / h as f64).floor() as u64 * side).min(max_side);
        } else if tw == 0 {
            tw = side;
            th = ((h as f64 / w as f64).floor() as u64 * side).min(max_side);
        }
        Ok((th as u32, tw as u32))
    }

    /// Image tokens of an image resized to `h`×`w`.
    pub fn tokens_for(&self, h: u32, w: u32) -> usize {
        ((h / self.patch) * (w / self.patch) / (self.pool * self.pool)) as usize
    }

    /// Image tokens of an image of `h`×`w` before resizing.
    pub fn tokens_of_size(&self, h: u32, w: u32) -> Result<usize> {
        let (th, tw) = self.target_size(h, w)?;
        Ok(self.tokens_for(th, tw))
    }

    /// Pixel values of an encoded image (`what` names it in errors).
    pub fn pixels(&self, bytes: &[u8], limits: &ImageLimits, what: &str) -> Result<Pixels> {
        if let Some(why) = &self.refuse {
            return Err(Error::Unsupported(format!("{what}: {why}")));
        }
        let size = |h, w| self.target_size(h, w);
        Preprocess::bicubic_f32_pixels(bytes, limits, what, size, self.rescale, self.normalize)
    }

    /// Gemma 4's expansion: the `i`-th image token of `text` becomes
    /// `boi + image_token × n_i + eoi`, `n_i` from the `i`-th image's (height, width) in `sizes`.
    pub fn expand(&self, text: &str, sizes: &[(u32, u32)]) -> Result<String> {
        super::expand_markers(text, &self.image_token, ("image", "image(s)"), sizes.len(), |i| {
            let (h, w) = sizes[i];
            Ok(format!("{}{}{}", self.boi, self.image_token.repeat(self.tokens_of_size(h, w)?), self.eoi))
        })
    }
}

/// The processor of a Gemma 4 model directory: processor_config.json's `image_processor` (else
/// preprocessor_config.json's flat keys, as mlx-vlm reads them), checked against the tower's
/// config; the tokenizer's boi/eoi/image tokens.
/// The processor's settings as mlx-vlm reads them: (the file's name, its whole content,
/// the image processor's name for errors, the image processor's settings) — processor_config.json's
/// `image_processor`, else preprocessor_config.json's flat keys.
pub(super) fn processor_files(dir: &Path) -> Result<(&'static str, Value, String, Value)> {
    let (file, proc_cfg) = match super::json_file(dir, "processor_config.json")? {
        Some(p) => ("processor_config.json", p),
        None => ("preprocessor_config.json", super::json_file(dir, "preprocessor_config.json")?.unwrap_or(Value::Null)),
    };
    let (name, ip) = match proc_cfg.get("image_processor") {
        Some(ip @ Value::Object(_)) => (format!("{file}: image_processor"), ip.clone()),
        _ => (file.to_string(), proc_cfg.clone()),
    };
    Ok((file, proc_cfg, name, ip))
}

/// The image processor's positive integer `k` (`dflt` where absent); `name` names it in errors.
fn processor_uint(ip: &Value, name: &str, k: &str, dflt: u32) -> Result<u32> {
    match ip.get(k) {
        None | Some(Value::Null) => Ok(dflt),
        Some(x) => match x.as_u64() {
            Some(n) if (1..=1 << 16).contains(&n) => Ok(n as u32),
            _ => Err(Error::ModelLoad(format!("{name}.{k} = {x} is not a positive integer"))),
        },
    }
}

/// The peak bytes the tower allocates while encoding one image at the processor's largest size
/// (`max_soft_tokens` pooled tokens: N = max_soft_tokens·k² patches), in `a`-byte activations (the
/// tower's dtype), on the CPU, where one layer's intermediates are live at a time. With hidden h,
/// heads H (KV heads G), head width d, intermediate I, patch p, pooling k:
/// - once: the pixels, float32, as given and patch-ordered, then cast: 3·N·p²·(2·4 + a); the patch
///   embedding, the positions and their sum: 3·N·h·a; the 2-D rotary tables (float32 cos and sin
///   per spatial dimension): 2·N·d·4; the pooling (float32 hidden states and the 1/k² weights
///   `[N / k², N]`): N·h·4 + N²/k²·4
/// - per layer: the residual, the normed input, the attention output and its projection, the MLP's
///   normed input and output: 6·N·h·a; q, k and v and their float32 RMS norms: (H + 2G)·N·d·(a + 4);
///   the rotated q and k: 2·(H + G)·N·d·a; the attention scores SDPA's general path materializes and
///   its float32 softmax: H·N²·(a + 4) (with `host_half`, a 16-bit tower on the CPU: the host
///   attention's scratch, [`crate::handle::half_attention_scratch_bytes`]); the GeGLU's gate, up and
///   product: 3·N·I·a
///
/// `tests/test_vision_gemma4.py` measures MLX's peak over `image_features` of an image at the
/// largest size against this (at least the measured peak, within 2× of it) for the tiny and a
/// mid-sized tower.
pub fn encode_transient_bytes(config: &Value, dir: &Path, a: u64, host_half: bool) -> Result<u64> {
    let d = vision_dims(config.get("vision_config").unwrap_or(&Value::Null))?;
    let (_, _, name, ip) = processor_files(dir)?;
    let k = d.pool as u64;
    let n = processor_uint(&ip, &name, "max_soft_tokens", 280)? as u64 * k * k;
    let (p, h, inter) = (d.patch as u64, d.hidden as u64, d.inter as u64);
    let (heads, kv, hd) = (d.heads as u64, d.kv_heads as u64, d.head_dim as u64);
    let once = 3 * n * p * p * (2 * 4 + a) + 3 * n * h * a + 2 * n * hd * 4 + n * h * 4 + n * n / (k * k) * 4;
    let scores = if host_half {
        crate::handle::half_attention_scratch_bytes(heads, kv, n, n, hd, hd)
    } else {
        heads * n * n * (a + 4)
    };
    let layer = 6 * n * h * a
        + (heads + 2 * kv) * n * hd * (a + 4)
        + 2 * (heads + kv) * n * hd * a
        + scores
        + 3 * n * inter * a;
    Ok(once + layer)
}

pub fn processor(config: &Value, dir: &Path, tokenizer: &crate::tokenizer::Tokenizer) -> Result<Processor> {
    let v = config.get("vision_config").unwrap_or(&Value::Null);
    let d = vision_dims(v)?;
    let (file, proc_cfg, name, ip) = processor_files(dir)?;
    let uint = |k: &str, dflt: u32| processor_uint(&ip, &name, k, dflt);
    let patch = uint("patch_size", 16)?;
    let pool = uint("pooling_kernel_size", 3)?;
    let max_soft_tokens = uint("max_soft_tokens", 280)?;
    if patch as i32 != d.patch {
        return Err(Error::ModelLoad(format!(
            "{name}.patch_size {patch} differs from config.json's vision_config.patch_size {}",
            d.patch
        )));
    }
    if pool as i32 != d.pool {
        return Err(Error::ModelLoad(format!(
            "{name}.pooling_kernel_size {pool} differs from config.json's vision_config.pooling_kernel_size {}",
            d.pool
        )));
    }
    // the widest image: max_soft_tokens pooled tokens in one row
    let widest = max_soft_tokens as i64 * pool as i64;
    if widest > d.pos_size as i64 {
        return Err(Error::ModelLoad(format!(
            "{name}.max_soft_tokens {max_soft_tokens} allows images {widest} patches wide, more than config.json's \
             vision_config.position_embedding_size {}",
            d.pos_size
        )));
    }
    let b = |k: &str, dflt: bool| ip.get(k).and_then(Value::as_bool).unwrap_or(dflt);
    if !b("do_resize", true) {
        return Err(Error::Unsupported(format!(
            "{name}.do_resize = false is not supported (Gemma 4 resizes to its patch budget)"
        )));
    }
    let rescale = if b("do_rescale", true) {
        Some(ip.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0))
    } else {
        None
    };
    let three = |k: &str| -> Result<[f32; 3]> {
        match ip.get(k) {
            None | Some(Value::Null) => Ok([0.5; 3]),
            Some(Value::Number(x)) => Ok([x.as_f64().unwrap_or(0.5) as f32; 3]),
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32))
            }
            Some(x) => Err(Error::ModelLoad(format!("{name}.{k} = {x} is not three numbers"))),
        }
    };
    let normalize = if b("do_normalize", false) { Some((three("image_mean")?, three("image_std")?)) } else { None };
    if normalize.is_some_and(|(_, std)| std.contains(&0.0)) {
        return Err(Error::ModelLoad(format!("{name}.image_std has a zero")));
    }
    let audio = super::gemma4_audio::processor(config, &proc_cfg, file, tokenizer)?.map(Box::new);
    let c = Cfg(config);
    let image_token_id = c.opt_i("image_token_id").unwrap_or(258880);
    let [boi, eoi, image_token] = super::markers(
        tokenizer,
        [("boi_token", "<|image>"), ("eoi_token", "<image|>"), ("image_token", "<|image|>")],
        "image_token_id",
        image_token_id,
        "Gemma 4's image markers",
    )?;
    let mut media_token_ids = vec![image_token_id, c.opt_i("audio_token_id").unwrap_or(258881)];
    if let Some(v) = c.opt_i("video_token_id") {
        media_token_ids.push(v);
    }
    // mlx-vlm attends bidirectionally within each image's tokens then (not implemented here)
    let bidi = config.get("text_config").and_then(|t| t.get("use_bidirectional_attention")).and_then(Value::as_str);
    let refuse = (bidi == Some("vision")).then(|| {
        "config.json: text_config.use_bidirectional_attention = \"vision\" (bidirectional attention over each image's \
         tokens) is not implemented: this model cannot take images in mlxrs"
            .to_string()
    });
    Ok(Processor {
        patch,
        pool,
        max_soft_tokens,
        rescale,
        normalize,
        boi,
        eoi,
        image_token,
        image_token_id,
        media_token_ids,
        refuse,
        audio,
    })
}

/// Vision sizes from `vision_config`, checked.
struct VisionDims {
    hidden: i32,
    inter: i32,
    layers: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    patch: i32,
    pool: i32,
    pos_size: i32,
    eps: f32,
    theta: f32,
    clipped: bool,
    standardize: bool,
}

fn vision_dims(v: &Value) -> Result<VisionDims> {
    use crate::models::limits::*;
    let c = Cfg(v);
    let mt = v.get("model_type").and_then(Value::as_str).unwrap_or("gemma4_vision");
    if mt != "gemma4_vision" {
        return Err(Error::Unsupported(format!(
            "vision_config.model_type {mt:?} is not a Gemma 4 vision tower mlxrs implements"
        )));
    }
    let f = |k: &str, d: Option<i64>, max: i64| super::vision_size(v, k, d, max);
    let heads = f("num_attention_heads", Some(12), HEADS)?;
    let theta = match v.get("rope_parameters") {
        None | Some(Value::Null) => 100.0,
        Some(r) => match r.get("rope_theta") {
            Some(t) if t.as_f64().is_some_and(|t| t > 0.0) => t.as_f64().unwrap_or(100.0) as f32,
            _ => {
                return Err(Error::ModelLoad(format!(
                    "config.json: vision_config.rope_parameters = {r} has no positive rope_theta"
                )))
            }
        },
    };
    let d = VisionDims {
        hidden: f("hidden_size", Some(768), HIDDEN)?,
        inter: f("intermediate_size", Some(3072), INTERMEDIATE)?,
        layers: f("num_hidden_layers", Some(16), LAYERS)?,
        heads,
        kv_heads: f("num_key_value_heads", Some(heads as i64), HEADS)?,
        head_dim: f("head_dim", Some(64), 1 << 12)?,
        patch: f("patch_size", Some(16), 1 << 10)?,
        pool: f("pooling_kernel_size", Some(3), 64)?,
        pos_size: f("position_embedding_size", Some(10240), 1 << 20)?,
        eps: c.f_or("rms_norm_eps", 1e-6) as f32,
        theta,
        clipped: c.b_or("use_clipped_linears", false),
        standardize: c.b_or("standardize", false),
    };
    if d.head_dim % 4 != 0 {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.head_dim {} is not a multiple of 4 (the 2-D rotary embedding splits it in two halves)",
            d.head_dim
        )));
    }
    if d.heads % d.kv_heads != 0 {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.num_attention_heads {} is not a multiple of num_key_value_heads {}",
            d.heads, d.kv_heads
        )));
    }
    Ok(d)
}

/// mlx-vlm's `ClippableLinear`: a bias-free linear map, its input and output clamped to the
/// checkpoint's bounds when `use_clipped_linears` is set.
pub(super) struct ClipLinear {
    lin: Linear,
    clip: Option<[Array; 4]>,
}

impl ClipLinear {
    pub(super) fn load(w: &mut Weights, p: &str, clipped: bool, out: i32, inp: i32) -> Result<ClipLinear> {
        let lin = Linear::load(w, &format!("{p}.linear"), false, out, inp)?;
        let clip = if clipped {
            let mut b = |k: &str| -> Result<Array> {
                let name = format!("{p}.{k}");
                let a = w.take(&name)?;
                if a.size() != 1 {
                    return Err(Error::ModelLoad(format!(
                        "weight {name} has shape {:?} but a clip bound is a scalar",
                        a.shape()
                    )));
                }
                mx::reshape(&a, &[])
            };
            Some([b("input_min")?, b("input_max")?, b("output_min")?, b("output_max")?])
        } else {
            None
        };
        Ok(ClipLinear { lin, clip })
    }
    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        match &self.clip {
            None => self.lin.forward(x),
            Some([imin, imax, omin, omax]) => {
                let y = self.lin.forward(&mx::clip(x, Some(imin), Some(imax))?)?;
                mx::clip(&y, Some(omin), Some(omax))
            }
        }
    }
}

/// RMS normalization in float32 (mlx-vlm's `VisionRMSNorm`, `VisionRMSNormNoScale`): `x ·
/// rsqrt(mean(x²) + eps) · weight`, back to x's dtype.
fn rms_f32(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let xf = mx::astype(x, Dtype::Float32)?;
    let var = mx::mean(&mx::power(&xf, &Array::f32(2.0)?)?, &[-1], true)?;
    let mut y = mx::multiply(&xf, &mx::rsqrt(&mx::add(&var, &Array::f32(eps)?)?)?)?;
    if let Some(w) = weight {
        y = mx::multiply(&y, &mx::astype(w, Dtype::Float32)?)?;
    }
    mx::astype(&y, x.dtype())
}

struct Layer {
    q: ClipLinear,
    k: ClipLinear,
    v: ClipLinear,
    o: ClipLinear,
    q_norm: Array,
    k_norm: Array,
    gate: ClipLinear,
    up: ClipLinear,
    down: ClipLinear,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
}

/// The tower and the projector, on the engine thread.
pub struct Tower {
    input_proj: Linear,
    /// `[2, position_embedding_size, hidden]`: the x and the y tables.
    pos_table: Array,
    layers: Vec<Layer>,
    std: Option<(Array, Array)>,
    proj: Linear,
    d: VisionDims,
    pub processor: Processor,
    /// The audio encoder, when the model has one.
    pub audio: Option<Box<super::gemma4_audio::AudioTower>>,
}

/// The 2-D rotary embedding of a `rows`×`cols` patch grid: per spatial dimension (x, then y) the
/// cos and sin `[1, L, 1, head_dim / 2]` (mlx-vlm computes them in float32, then casts).
struct Rope2d {
    parts: Vec<(Array, Array)>,
    /// Channels per spatial dimension (head_dim / 2).
    cpd: i32,
}

impl Tower {
    /// Take the tower's and the projector's weights (`[model.]vision_tower.*`,
    /// `[model.]embed_vision.*`) out of `w`.
    pub fn load(config: &Value, w: &mut Weights, processor: Processor) -> Result<Tower> {
        let d = vision_dims(config.get("vision_config").unwrap_or(&Value::Null))?;
        let text = config
            .get("text_config")
            .ok_or_else(|| Error::ModelLoad("config.json: gemma4 has no text_config".into()))?;
        let text_hidden = Cfg(text).size("hidden_size", Some(1536), crate::models::limits::HIDDEN)?;
        let root = if w.keys().any(|k| k.starts_with("model.vision_tower.")) { "model." } else { "" };
        let p = format!("{root}vision_tower");
        let (h, pd) = (d.hidden, 3 * d.patch * d.patch);
        let input_proj = Linear::load(w, &format!("{p}.patch_embedder.input_proj"), false, h, pd)?;
        let pos_table = w.take_shaped(&format!("{p}.patch_embedder.position_embedding_table"), &[2, d.pos_size, h])?;
        let (q_out, kv_out) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let mut layers = Vec::with_capacity(d.layers as usize);
        for i in 0..d.layers {
            let l = format!("{p}.encoder.layers.{i}");
            let cl = |w: &mut Weights, n: &str, o: i32, inp: i32| {
                ClipLinear::load(w, &format!("{l}.{n}"), d.clipped, o, inp)
            };
            let norm = |w: &mut Weights, n: &str| RmsNorm::load(w, &format!("{l}.{n}"), d.eps, h);
            layers.push(Layer {
                q: cl(w, "self_attn.q_proj", q_out, h)?,
                k: cl(w, "self_attn.k_proj", kv_out, h)?,
                v: cl(w, "self_attn.v_proj", kv_out, h)?,
                o: cl(w, "self_attn.o_proj", h, q_out)?,
                q_norm: w.take_shaped(&format!("{l}.self_attn.q_norm.weight"), &[d.head_dim])?,
                k_norm: w.take_shaped(&format!("{l}.self_attn.k_norm.weight"), &[d.head_dim])?,
                gate: cl(w, "mlp.gate_proj", d.inter, h)?,
                up: cl(w, "mlp.up_proj", d.inter, h)?,
                down: cl(w, "mlp.down_proj", h, d.inter)?,
                input_norm: norm(w, "input_layernorm")?,
                post_attn_norm: norm(w, "post_attention_layernorm")?,
                pre_ff_norm: norm(w, "pre_feedforward_layernorm")?,
                post_ff_norm: norm(w, "post_feedforward_layernorm")?,
            });
        }
        let std = if d.standardize {
            Some((w.take_shaped(&format!("{p}.std_bias"), &[h])?, w.take_shaped(&format!("{p}.std_scale"), &[h])?))
        } else {
            None
        };
        let proj = Linear::load(w, &format!("{root}embed_vision.embedding_projection"), false, text_hidden, h)?;
        let audio = match &processor.audio {
            Some(ap) => Some(Box::new(super::gemma4_audio::AudioTower::load(config, w, (**ap).clone())?)),
            None => None,
        };
        Ok(Tower { input_proj, pos_table, layers, std, proj, d, processor, audio })
    }

    fn rope(&self, rows: i32, cols: i32) -> Result<Rope2d> {
        let cpd = self.d.head_dim / 2; // channels per spatial dimension
        let half = cpd / 2;
        let exps = mx::multiply(
            &mx::astype(&mx::arange(0.0, half as f64, 1.0, Dtype::Int32)?, Dtype::Float32)?,
            &Array::f32((2.0 / cpd as f64) as f32)?,
        )?;
        let timescale = mx::power(&Array::f32(self.d.theta)?, &exps)?;
        let l = rows * cols;
        let xs: Vec<f32> = (0..l).map(|i| (i % cols) as f32).collect();
        let ys: Vec<f32> = (0..l).map(|i| (i / cols) as f32).collect();
        let mut parts = Vec::with_capacity(2);
        for pos in [xs, ys] {
            let ang = mx::divide(&Array::from_slice(&pos, &[1, l, 1])?, &timescale)?;
            let (c, s) = (mx::cos(&ang)?, mx::sin(&ang)?);
            let dup = |a: &Array| -> Result<Array> { mx::expand_dims(&mx::concatenate(&[a, a], -1)?, 2) };
            parts.push((dup(&c)?, dup(&s)?));
        }
        Ok(Rope2d { parts, cpd })
    }

    /// mlx-vlm's `apply_multidimensional_rope` on `[B, L, N, head_dim]`.
    fn apply_rope(x: &Array, r: &Rope2d) -> Result<Array> {
        let cpd = r.cpd;
        let mut out = Vec::with_capacity(2);
        for (i, (c, s)) in r.parts.iter().enumerate() {
            let part = mx::slice_axis(x, -1, i as i32 * cpd, (i as i32 + 1) * cpd)?;
            let (c, s) = (mx::astype(c, x.dtype())?, mx::astype(s, x.dtype())?);
            let x1 = mx::slice_axis(&part, -1, 0, cpd / 2)?;
            let x2 = mx::slice_axis(&part, -1, cpd / 2, cpd)?;
            let rot = mx::concatenate(&[&mx::negative(&x2)?, &x1], -1)?;
            out.push(mx::add(&mx::multiply(&part, &c)?, &mx::multiply(&rot, &s)?)?);
        }
        mx::concatenate(&[&out[0], &out[1]], -1)
    }

    /// The projected features `[tokens, text_hidden]` of one image's pixels (`[3, H, W]`, H and W
    /// multiples of pooling_kernel_size × patch_size), in `dtype`.
    fn image_features(&self, px: &Pixels, dtype: Dtype) -> Result<Array> {
        let d = &self.d;
        let (p, k) = (d.patch, d.pool);
        let (hh, ww) = (px.height as i32, px.width as i32);
        if hh % (p * k) != 0 || ww % (p * k) != 0 || px.data.len() != (3 * hh * ww) as usize {
            return Err(Error::Invalid(format!(
                "pixel values of {ww}x{hh}: not a grid of {k}x{k} blocks of {p}x{p} patches"
            )));
        }
        let (rows, cols) = (hh / p, ww / p);
        if cols > d.pos_size || rows > d.pos_size {
            return Err(Error::Invalid(format!(
                "an image of {cols}x{rows} patches is past the position table ({})",
                d.pos_size
            )));
        }
        let l = rows * cols;
        let x = Array::from_slice(&px.data, &[1, 3, rows, p, cols, p])?;
        let x = mx::reshape(&mx::transpose_axes(&x, &[0, 2, 4, 3, 5, 1])?, &[1, l, 3 * p * p])?;
        let x = mx::multiply(&Array::f32(2.0)?, &mx::subtract(&x, &Array::f32(0.5)?)?)?;
        let mut h = self.input_proj.forward(&mx::astype(&x, dtype)?)?;
        // position embeddings: the x table at each patch's column plus the y table at its row
        let xs: Vec<i32> = (0..l).map(|i| i % cols).collect();
        let ys: Vec<i32> = (0..l).map(|i| i / cols).collect();
        let tx = mx::squeeze(&mx::slice_axis(&self.pos_table, 0, 0, 1)?, &[0])?;
        let ty = mx::squeeze(&mx::slice_axis(&self.pos_table, 0, 1, 2)?, &[0])?;
        let pos = mx::add(
            &mx::take(&tx, &Array::from_slice(&xs, &[l])?, 0)?,
            &mx::take(&ty, &Array::from_slice(&ys, &[l])?, 0)?,
        )?;
        h = mx::add(&h, &mx::astype(&pos, h.dtype())?)?;
        let rope = self.rope(rows, cols)?;
        let hd = d.head_dim;
        for layer in &self.layers {
            let y = layer.input_norm.forward(&h)?;
            let q = rms_f32(&mx::reshape(&layer.q.forward(&y)?, &[1, l, d.heads, hd])?, Some(&layer.q_norm), 1e-6)?;
            let kk = rms_f32(&mx::reshape(&layer.k.forward(&y)?, &[1, l, d.kv_heads, hd])?, Some(&layer.k_norm), 1e-6)?;
            let v = rms_f32(&mx::reshape(&layer.v.forward(&y)?, &[1, l, d.kv_heads, hd])?, None, 1e-6)?;
            let q = mx::transpose_axes(&Self::apply_rope(&q, &rope)?, &[0, 2, 1, 3])?;
            let kk = mx::transpose_axes(&Self::apply_rope(&kk, &rope)?, &[0, 2, 1, 3])?;
            let v = mx::transpose_axes(&v, &[0, 2, 1, 3])?;
            let o = crate::models::sdpa::attention(&q, &kk, &v, 1.0, AttnMask::None, None)?;
            let o = mx::reshape(&mx::transpose_axes(&o, &[0, 2, 1, 3])?, &[1, l, d.heads * hd])?;
            h = mx::add(&h, &layer.post_attn_norm.forward(&layer.o.forward(&o)?)?)?;
            let y = layer.pre_ff_norm.forward(&h)?;
            let g = mx::multiply(&gelu_approx_compiled(&layer.gate.forward(&y)?)?, &layer.up.forward(&y)?)?;
            h = mx::add(&h, &layer.post_ff_norm.forward(&layer.down.forward(&g)?)?)?;
        }
        // k×k average pooling as mlx-vlm's einsum with float32 weights 1/k² (row-major pooled grid)
        let n = l / (k * k);
        let pooled = if n == l {
            h
        } else {
            let (pc, w) = (cols / k, 1.0f32 / (k * k) as f32);
            let mut weights = vec![0f32; (n * l) as usize];
            for i in 0..l {
                let (x, y) = (i % cols, i / cols);
                let t = x / k + pc * (y / k);
                weights[(t * l + i) as usize] = w;
            }
            let wm = Array::from_slice(&weights, &[1, n, l])?;
            mx::astype(&mx::matmul(&wm, &mx::astype(&h, Dtype::Float32)?)?, h.dtype())?
        };
        let mut out = mx::multiply(&pooled, &mx::scalar_as((d.hidden as f64).sqrt(), pooled.dtype())?)?;
        if let Some((bias, scale)) = &self.std {
            out = mx::multiply(&mx::subtract(&out, bias)?, scale)?;
        }
        let normed = mx::rms_norm(&out, None, d.eps)?;
        let f = self.proj.forward(&normed)?;
        mx::astype(&mx::reshape(&f, &[n, f.dim(-1)])?, dtype)
    }

    /// The projected features `[1, total tokens, text_hidden]` of `pixels` (each image at its own
    /// size), in `dtype` (the language model's). Each image is evaluated before the next is built:
    /// as one graph MLX kept several images' intermediates alive at once (4 mid-sized images peaked
    /// at 2.4× one image's), past the plan's one-image transient.
    pub fn features(&self, pixels: &[&Pixels], dtype: Dtype) -> Result<Array> {
        let feats = pixels
            .iter()
            .map(|p| {
                let f = self.image_features(p, dtype)?;
                f.eval()?;
                Ok(f)
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Array> = feats.iter().collect();
        mx::expand_dims(&mx::concatenate(&refs, 0)?, 0)
    }

    /// The input embeddings `[1, L, hidden (+ per-layer width)]` of `prompt` with `pixels`'
    /// features at its image tokens, as mlx-vlm's `get_input_embeddings` builds them: the scaled
    /// token embeddings, the features (unscaled) at the image tokens; the per-layer token
    /// embeddings of the prompt with its image and audio tokens as 0 in trailing columns.
    pub fn merged_embeddings(&self, model: &dyn CausalLm, prompt: &[i32], pixels: &[&Pixels]) -> Result<Array> {
        self.merged_media(model, prompt, pixels, &[])
    }

    /// [`Tower::merged_embeddings`] with audio clips too: their features at the prompt's audio
    /// tokens (mlx-vlm scatters the images', then the audio's, into the same embeddings).
    pub fn merged_media(
        &self,
        model: &dyn CausalLm,
        prompt: &[i32],
        pixels: &[&Pixels],
        mels: &[&super::audio::Mel],
    ) -> Result<Array> {
        let image_id = self.processor.image_token_id;
        let found = prompt.iter().filter(|&&t| t == image_id).count();
        let want: usize = pixels.iter().map(|p| self.processor.tokens_for(p.height, p.width)).sum();
        if found != want {
            return Err(Error::Invalid(format!(
                "the prompt has {found} image tokens for {} image(s) of {want} tokens",
                pixels.len()
            )));
        }
        let audio = match (&self.audio, mels.is_empty()) {
            (_, true) => None,
            (Some(a), false) => Some(a),
            (None, false) => return Err(Error::Invalid("this model has no audio tower".into())),
        };
        if let Some(a) = audio {
            super::gemma4_audio::check_tokens(&a.processor, prompt, mels)?;
        }
        let l = prompt.len();
        let mut merged = model.embed_tokens(&Array::from_slice(prompt, &[1, l as i32])?)?;
        let dtype = merged.dtype();
        if !pixels.is_empty() {
            merged = scatter(&merged, prompt, image_id, &self.features(pixels, dtype)?)?;
        }
        if let Some(a) = audio {
            merged =
                scatter(&merged, prompt, a.processor.audio_token_id, &mx::expand_dims(&a.features(mels, dtype)?, 0)?)?;
        }
        let text_only: Vec<i32> =
            prompt.iter().map(|&t| if self.processor.media_token_ids.contains(&t) { 0 } else { t }).collect();
        match model.embed_per_layer(&Array::from_slice(&text_only, &[1, l as i32])?)? {
            Some(e) => mx::concatenate(&[&merged, &mx::astype(&e, dtype)?], -1),
            None => Ok(merged),
        }
    }
}

/// `embeds` `[1, L, hidden]` with the rows of `feats` `[1, n, hidden]` in order at `prompt`'s
/// `token` positions (n of them).
fn scatter(embeds: &Array, prompt: &[i32], token: i32, feats: &Array) -> Result<Array> {
    let l = prompt.len();
    let all = mx::concatenate(&[embeds, feats], 1)?;
    let mut next = 0usize;
    let idx: Vec<i32> = prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if t == token {
                next += 1;
                (l + next - 1) as i32
            } else {
                i as i32
            }
        })
        .collect();
    mx::take(&all, &Array::from_slice(&idx, &[l as i32])?, 1)
}
