//! Gemma 3's vision side (mlx-vlm's `models/gemma3/vision.py` and `gemma3.py`): a SigLIP tower
//! (patch embedding, learned positions, pre-norm encoder layers with biased attention and a GELU
//! MLP, a final LayerNorm), then the multi-modal projector (average pooling of the patch grid to
//! `mm_tokens_per_image` tokens, Gemma's `1 + w` RMSNorm, a projection to the text width), and the
//! merge of those embeddings into the prompt at the image-token positions.
use super::image::{Filter, ImageLimits, Pixels, Preprocess};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, AttnMask, Dtype};
// mlx-vlm's SigLIP MLP is `nn.GELU(approx="precise")`, which in MLX is the tanh approximation
use crate::models::layers::{gelu_approx_compiled, Linear, RmsNorm};
use crate::models::{CausalLm, Cfg};
use crate::weights::Weights;
use serde_json::Value;
use std::path::Path;

/// The prompt side: how an image is announced and expanded (Gemma 3's processor).
#[derive(Clone, Debug)]
pub struct Processor {
    pub preprocess: Preprocess,
    /// Image tokens per image (the projector's output length).
    pub tokens_per_image: usize,
    pub boi: String,
    pub eoi: String,
    pub image_token: String,
    pub image_token_id: i32,
}

impl Processor {
    /// Pixel values of an encoded image (`what` names it in errors).
    pub fn pixels(&self, bytes: &[u8], limits: &ImageLimits, what: &str) -> Result<Pixels> {
        Ok(self.preprocess.run(&super::image::decode(bytes, limits, what)?))
    }

    /// Gemma 3's `full_image_sequence`: every `boi` marker in `text` becomes
    /// `"\n\n" + boi + image_token × n + eoi + "\n\n"`. The count of markers must be `images`.
    pub fn expand(&self, text: &str, images: usize) -> Result<String> {
        let found = text.matches(&self.boi).count();
        if found != images {
            return Err(Error::Invalid(format!(
                "the prompt has {found} image marker(s) ({}) for {images} image(s)",
                self.boi
            )));
        }
        let full = format!("\n\n{}{}{}\n\n", self.boi, self.image_token.repeat(self.tokens_per_image), self.eoi);
        Ok(text.replace(&self.boi, &full))
    }
}

/// Vision sizes from `vision_config`, checked.
struct VisionDims {
    hidden: i32,
    inter: i32,
    layers: i32,
    heads: i32,
    patch: i32,
    image_size: i32,
    channels: i32,
    eps: f32,
}

fn vision_dims(v: &Value) -> Result<VisionDims> {
    use crate::models::limits::*;
    let c = Cfg(v);
    let mt = v.get("model_type").and_then(Value::as_str).unwrap_or("siglip_vision_model");
    if !["siglip_vision_model", "gemma3", "gemma3_vision"].contains(&mt) {
        return Err(Error::Unsupported(format!(
            "vision_config.model_type {mt:?} is not a SigLIP tower mlxrs implements"
        )));
    }
    let f = |k: &str, d: Option<i64>, max: i64| super::vision_size(v, k, d, max);
    let d = VisionDims {
        hidden: f("hidden_size", None, HIDDEN)?,
        inter: f("intermediate_size", None, INTERMEDIATE)?,
        layers: f("num_hidden_layers", None, LAYERS)?,
        heads: f("num_attention_heads", None, HEADS)?,
        patch: f("patch_size", None, 1 << 10)?,
        image_size: f("image_size", Some(224), 1 << 14)?,
        channels: f("num_channels", Some(3), 3)?,
        eps: c.f_or("layer_norm_eps", 1e-6) as f32,
    };
    if d.channels != 3 {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.num_channels = {} (only RGB, 3, is supported)",
            d.channels
        )));
    }
    if d.hidden % d.heads != 0 {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.hidden_size {} is not a multiple of num_attention_heads {}",
            d.hidden, d.heads
        )));
    }
    if d.image_size % d.patch != 0 {
        return Err(Error::ModelLoad(format!(
            "config.json: vision_config.image_size {} is not a multiple of patch_size {}",
            d.image_size, d.patch
        )));
    }
    Ok(d)
}

pub(super) struct LayerNorm {
    w: Array,
    b: Array,
    eps: f32,
}

impl LayerNorm {
    pub(super) fn load(ws: &mut Weights, p: &str, dim: i32, eps: f32) -> Result<LayerNorm> {
        Ok(LayerNorm {
            w: ws.take_shaped(&format!("{p}.weight"), &[dim])?,
            b: ws.take_shaped(&format!("{p}.bias"), &[dim])?,
            eps,
        })
    }
    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        mx::layer_norm(x, Some(&self.w), Some(&self.b), self.eps)
    }
}

struct EncoderLayer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln1: LayerNorm,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// The tower and the projector, on the engine thread.
pub struct Tower {
    /// `[hidden, patch·patch·3]` (the conv weight flattened in (kh, kw, c) order) and its bias.
    patch_w: Array,
    patch_b: Array,
    pos: Array,
    layers: Vec<EncoderLayer>,
    post_ln: LayerNorm,
    soft_norm: RmsNorm,
    proj: Array,
    d: VisionDims,
    tokens_per_side: i32,
    /// 1 / sqrt(the top-level hidden_size): mlx-vlm divides the image features by it before the
    /// language model multiplies every input embedding by its own scale.
    feature_div: f64,
    pad_token_id: i32,
    pub processor: Processor,
}

/// Whether `config` describes Gemma 3 with a vision tower.
/// The peak bytes the SigLIP tower allocates while encoding one image (always `image_size`²), in
/// `a`-byte activations, on the CPU (one layer's intermediates live at a time). With N patches
/// ((image_size / patch)²), hidden h, heads H, intermediate I, image side S, patch p:
/// - once: the pixels as given (float32), transposed and cast, patch-ordered: 3·S²·4 + 3·S²·a +
///   N·3·p²·a; the patch embedding with its positions and the post-norm: 3·N·h·a
/// - per layer: the norms, q, k, v, the attention output and its projection, the residual:
///   8·N·h·a; the attention scores SDPA's general path materializes, at least float32 wide for
///   its softmax: H·N²·max(a, 4); the MLP's fc1 output and the tanh-GELU's intermediates: 4·N·I·a
///
/// With `host_half` (a 16-bit tower on the CPU: the host attention of `handle/half.rs`) the scores are
/// that op's scratch instead ([`crate::handle::half_attention_scratch_bytes`]).
///
/// `tests/test_vision.py` measures MLX's peak over `image_features` against this (at least the
/// measured peak, within 2× of it) for a tiny and a mid-sized tower.
pub fn encode_transient_bytes(config: &Value, a: u64, host_half: bool) -> Result<u64> {
    let d = vision_dims(config.get("vision_config").unwrap_or(&Value::Null))?;
    let (s, p) = (d.image_size as u64, d.patch as u64);
    let n = (s / p) * (s / p);
    let (h, heads, inter) = (d.hidden as u64, d.heads as u64, d.inter as u64);
    let once = 3 * s * s * 4 + 3 * s * s * a + n * 3 * p * p * a + 3 * n * h * a;
    let scores = if host_half {
        crate::handle::half_attention_scratch_bytes(heads, heads, n, n, h / heads, h / heads)
    } else {
        heads * n * n * a.max(4)
    };
    let layer = 8 * n * h * a + scores + 4 * n * inter * a;
    Ok(once + layer)
}

pub fn is_gemma3_vision(config: &Value) -> bool {
    config.get("model_type").and_then(Value::as_str) == Some("gemma3")
        && config.get("vision_config").is_some_and(Value::is_object)
}

/// mm_tokens_per_image: the text config's (what mlx-vlm's projector reads), else the top level's,
/// else 256.
fn tokens_per_image(config: &Value) -> Result<i32> {
    let text = config.get("text_config").unwrap_or(&Value::Null);
    let v = text.get("mm_tokens_per_image").or_else(|| config.get("mm_tokens_per_image"));
    match v {
        None => Ok(256),
        Some(v) => match v.as_i64() {
            Some(n) if (1..=1 << 16).contains(&n) => Ok(n as i32),
            _ => Err(Error::ModelLoad(format!("config.json: mm_tokens_per_image = {v} is not a positive integer"))),
        },
    }
}

/// The processor of a Gemma 3 model directory: preprocessor_config.json (size, resample, rescale,
/// mean/std; pan-and-scan refused), processor_config.json's image_seq_length (must equal
/// mm_tokens_per_image), the tokenizer's boi/eoi/image tokens.
pub fn processor(config: &Value, dir: &Path, tokenizer: &crate::tokenizer::Tokenizer) -> Result<Processor> {
    let d = vision_dims(config.get("vision_config").unwrap_or(&Value::Null))?;
    let n = tokens_per_image(config)?;
    let pp = Value::Object(Default::default());
    let pre = super::json_file(dir, "preprocessor_config.json")?.unwrap_or(pp);
    let name = "preprocessor_config.json";
    if pre.get("do_pan_and_scan").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Unsupported(format!("{name}: do_pan_and_scan is not supported")));
    }
    let b = |k: &str| pre.get(k).and_then(Value::as_bool).unwrap_or(true);
    let dim = |k: &str| -> Result<Option<u32>> {
        match pre.get("size").and_then(|s| s.get(k)) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) if (1..=1 << 14).contains(&x) => Ok(Some(x as u32)),
                _ => Err(Error::ModelLoad(format!("{name}: size.{k} = {v} is not a positive integer"))),
            },
        }
    };
    let size = if b("do_resize") {
        let s = d.image_size as u32;
        Some((dim("height")?.unwrap_or(s), dim("width")?.unwrap_or(s)))
    } else {
        None
    };
    if size != Some((d.image_size as u32, d.image_size as u32)) {
        return Err(Error::ModelLoad(format!(
            "{name}: images are resized to {size:?} but the vision tower takes {0}x{0}",
            d.image_size
        )));
    }
    let filter = Filter::from_pil(pre.get("resample").and_then(Value::as_i64).unwrap_or(2))?;
    let rescale = if b("do_rescale") {
        Some(pre.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0))
    } else {
        None
    };
    let three = |k: &str, dflt: f32| -> Result<[f32; 3]> {
        match pre.get(k) {
            None => Ok([dflt; 3]),
            Some(Value::Number(x)) => Ok([x.as_f64().unwrap_or(dflt as f64) as f32; 3]),
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32))
            }
            Some(v) => Err(Error::ModelLoad(format!("{name}: {k} = {v} is not three numbers"))),
        }
    };
    let normalize = if b("do_normalize") { Some((three("image_mean", 0.5)?, three("image_std", 0.5)?)) } else { None };
    if let Some((_, std)) = &normalize {
        if std.contains(&0.0) {
            return Err(Error::ModelLoad(format!("{name}: image_std has a zero")));
        }
    }
    if let Some(seq) =
        super::json_file(dir, "processor_config.json")?.and_then(|p| p.get("image_seq_length").and_then(Value::as_i64))
    {
        if seq != n as i64 {
            return Err(Error::ModelLoad(format!(
                "processor_config.json: image_seq_length {seq} differs from config.json's mm_tokens_per_image {n}"
            )));
        }
    }
    let image_token_id = Cfg(config).opt_i("image_token_index").unwrap_or(262144);
    let [boi, eoi, image_token] = super::markers(
        tokenizer,
        [("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"), ("image_token", "<image_soft_token>")],
        "image_token_index",
        image_token_id,
        "Gemma 3's image markers",
    )?;
    Ok(Processor {
        preprocess: Preprocess { size, filter, rescale, rescale_f32: false, normalize },
        tokens_per_image: n as usize,
        boi,
        eoi,
        image_token,
        image_token_id,
    })
}

/// mlx-vlm's `check_array_shape` for a 4-D conv weight: already `[out, kh, kw, in]`?
fn mlx_layout(shape: &[i32]) -> bool {
    shape.len() == 4 && shape[0] >= shape[1] && shape[0] >= shape[2] && shape[1] == shape[2]
}

impl Tower {
    /// Take the tower's and the projector's weights (`vision_tower.vision_model.*`,
    /// `multi_modal_projector.*`) out of `w`, sanitized as mlx-vlm does (the patch convolution from
    /// PyTorch's `[out, in, kh, kw]` to MLX's `[out, kh, kw, in]`).
    pub fn load(config: &Value, w: &mut Weights, processor: Processor) -> Result<Tower> {
        let d = vision_dims(config.get("vision_config").unwrap_or(&Value::Null))?;
        let text = config
            .get("text_config")
            .ok_or_else(|| Error::ModelLoad("config.json: gemma3 has no text_config".into()))?;
        let text_hidden = Cfg(text).size("hidden_size", Some(1152), crate::models::limits::HIDDEN)?;
        let n = tokens_per_image(config)?;
        let side = (n as f64).sqrt() as i32;
        let patches = d.image_size / d.patch;
        if side * side != n || patches % side != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: mm_tokens_per_image {n} is not a square whose side divides the {patches}x{patches} patch grid"
            )));
        }
        let p = "vision_tower.vision_model";
        let name = format!("{p}.embeddings.patch_embedding.weight");
        let mut conv = w.take(&name)?;
        if !mlx_layout(&conv.shape()) {
            conv = mx::transpose_axes(&conv, &[0, 2, 3, 1])?;
        }
        let want = [d.hidden, d.patch, d.patch, 3];
        if conv.shape() != want {
            return Err(Error::ModelLoad(format!(
                "weight {name} has shape {:?} but config.json implies {want:?}",
                conv.shape()
            )));
        }
        let patch_w = mx::transpose(&mx::reshape(&conv, &[d.hidden, d.patch * d.patch * 3])?)?;
        let patch_b = w.take_shaped(&format!("{p}.embeddings.patch_embedding.bias"), &[d.hidden])?;
        let pos =
            w.take_shaped(&format!("{p}.embeddings.position_embedding.weight"), &[patches * patches, d.hidden])?;
        let mut layers = Vec::with_capacity(d.layers as usize);
        for i in 0..d.layers {
            let l = format!("{p}.encoder.layers.{i}");
            let lin = |w: &mut Weights, n: &str, o: i32, inp: i32| Linear::load(w, &format!("{l}.{n}"), true, o, inp);
            layers.push(EncoderLayer {
                q: lin(w, "self_attn.q_proj", d.hidden, d.hidden)?,
                k: lin(w, "self_attn.k_proj", d.hidden, d.hidden)?,
                v: lin(w, "self_attn.v_proj", d.hidden, d.hidden)?,
                o: lin(w, "self_attn.out_proj", d.hidden, d.hidden)?,
                ln1: LayerNorm::load(w, &format!("{l}.layer_norm1"), d.hidden, d.eps)?,
                ln2: LayerNorm::load(w, &format!("{l}.layer_norm2"), d.hidden, d.eps)?,
                fc1: lin(w, "mlp.fc1", d.inter, d.hidden)?,
                fc2: lin(w, "mlp.fc2", d.hidden, d.inter)?,
            });
        }
        // nn.LayerNorm's default eps (mlx-vlm builds the post-layernorm without the config's)
        let post_ln = LayerNorm::load(w, &format!("{p}.post_layernorm"), d.hidden, 1e-5)?;
        let soft_norm = RmsNorm::load_offset(w, "multi_modal_projector.mm_soft_emb_norm", d.eps, d.hidden)?;
        let proj = w.take_shaped("multi_modal_projector.mm_input_projection_weight", &[d.hidden, text_hidden])?;
        let top_hidden = Cfg(config).opt_i("hidden_size").unwrap_or(2048);
        Ok(Tower {
            patch_w,
            patch_b,
            pos,
            layers,
            post_ln,
            soft_norm,
            proj,
            tokens_per_side: side,
            feature_div: (top_hidden as f64).sqrt(),
            pad_token_id: Cfg(config).opt_i("pad_token_id").unwrap_or(0),
            d,
            processor,
        })
    }

    /// The projected image features `[N, mm_tokens_per_image, text_hidden]` of `pixels` (each
    /// `[3, S, S]`), in `dtype` (the language model's): each image through the tower alone and
    /// evaluated before the next (the plan counts one image's transient; a batch of four mid-sized
    /// images peaked at 4.4× one's).
    pub fn features(&self, pixels: &[&Pixels], dtype: Dtype) -> Result<Array> {
        if pixels.len() == 1 {
            return self.features_batch(pixels, dtype);
        }
        let feats = pixels
            .iter()
            .map(|p| {
                let f = self.features_batch(&[p], dtype)?;
                f.eval()?;
                Ok(f)
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Array> = feats.iter().collect();
        mx::concatenate(&refs, 0)
    }

    /// [`Tower::features`] of `pixels` as one batch.
    fn features_batch(&self, pixels: &[&Pixels], dtype: Dtype) -> Result<Array> {
        let d = &self.d;
        let s = d.image_size;
        let mut data = Vec::with_capacity(pixels.len() * (3 * s * s) as usize);
        for p in pixels {
            if (p.height as i32, p.width as i32) != (s, s) || p.data.len() != (3 * s * s) as usize {
                return Err(Error::Invalid(format!(
                    "pixel values of {}x{} for a {s}x{s} vision tower",
                    p.height, p.width
                )));
            }
            data.extend_from_slice(&p.data);
        }
        let b = pixels.len() as i32;
        let x = Array::from_slice(&data, &[b, 3, s, s])?;
        // NCHW -> NHWC in the model dtype (mlx-vlm: pixel_values.transpose(0, 2, 3, 1).astype)
        let x = mx::astype(&mx::transpose_axes(&x, &[0, 2, 3, 1])?, dtype)?;
        // the stride-p p×p convolution as a matmul over the patches, (kh, kw, c) order
        let g = s / d.patch;
        let x = mx::reshape(&x, &[b, g, d.patch, g, d.patch, 3])?;
        let x = mx::transpose_axes(&x, &[0, 1, 3, 2, 4, 5])?;
        let x = mx::reshape(&x, &[b, g * g, d.patch * d.patch * 3])?;
        let mut h = mx::add(&mx::addmm(&self.patch_b, &x, &self.patch_w, 1.0, 1.0)?, &self.pos)?;
        let hd = d.hidden / d.heads;
        let scale = (hd as f32).powf(-0.5);
        let l = g * g;
        for layer in &self.layers {
            let y = layer.ln1.forward(&h)?;
            let heads = |a: Array| -> Result<Array> {
                mx::transpose_axes(&mx::reshape(&a, &[b, l, d.heads, hd])?, &[0, 2, 1, 3])
            };
            let (q, k, v) = (heads(layer.q.forward(&y)?)?, heads(layer.k.forward(&y)?)?, heads(layer.v.forward(&y)?)?);
            let o = crate::models::sdpa::attention(&q, &k, &v, scale, AttnMask::None, None)?;
            let o = mx::reshape(&mx::transpose_axes(&o, &[0, 2, 1, 3])?, &[b, l, d.hidden])?;
            h = mx::add(&h, &layer.o.forward(&o)?)?;
            let y = layer.fc1.forward(&layer.ln2.forward(&h)?)?;
            h = mx::add(&h, &layer.fc2.forward(&gelu_approx_compiled(&y)?)?)?;
        }
        let h = self.post_ln.forward(&h)?;
        // average pooling of the g×g grid in k×k windows to side×side tokens
        let (t, k) = (self.tokens_per_side, g / self.tokens_per_side);
        let pooled = mx::mean(&mx::reshape(&h, &[b, t, k, t, k, d.hidden])?, &[2, 4], false)?;
        let pooled = mx::reshape(&pooled, &[b, t * t, d.hidden])?;
        let normed = self.soft_norm.forward(&pooled)?;
        let out = mx::matmul(&normed, &self.proj)?;
        mx::astype(&out, dtype)
    }

    /// The input embeddings `[1, L, hidden]` of `prompt` with `pixels`' features at its image
    /// tokens, as mlx-vlm's `prepare_inputs_for_multimodal` builds them: the token embeddings
    /// elsewhere, zeros at pad tokens, the features divided by sqrt(hidden_size). The language model
    /// then scales all of them ([`CausalLm::forward_embeds`]).
    pub fn merged_embeddings(&self, model: &dyn CausalLm, prompt: &[i32], pixels: &[&Pixels]) -> Result<Array> {
        let image_id = self.processor.image_token_id;
        let at: Vec<usize> = prompt.iter().enumerate().filter(|(_, &t)| t == image_id).map(|(i, _)| i).collect();
        let want = pixels.len() * self.processor.tokens_per_image;
        if at.len() != want {
            return Err(Error::Invalid(format!(
                "the prompt has {} image tokens for {} image(s) of {} tokens each",
                at.len(),
                pixels.len(),
                self.processor.tokens_per_image
            )));
        }
        let l = prompt.len();
        let tokens = Array::from_slice(prompt, &[1, l as i32])?;
        let embeds = model.embed_tokens(&tokens)?; // [1, L, H]
        let dtype = embeds.dtype();
        let feats = self.features(pixels, dtype)?;
        let hidden = feats.dim(2);
        let feats =
            mx::divide(&mx::reshape(&feats, &[1, want as i32, hidden])?, &mx::scalar_as(self.feature_div, dtype)?)?;
        let zero = mx::zeros(&[1, 1, hidden], dtype)?;
        let all = mx::concatenate(&[&embeds, &feats, &zero], 1)?;
        // row of `all` each position takes: its own, the next image feature, or the zero row
        let pad = self.pad_token_id;
        let idx = super::merge_rows(prompt, image_id, |i, t| if t == pad { (l + want) as i32 } else { i as i32 });
        mx::take(&all, &Array::from_slice(&idx, &[l as i32])?, 1)
    }
}
