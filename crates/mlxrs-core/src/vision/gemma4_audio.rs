//! Gemma 4's audio side (mlx-vlm 0.7.10's `models/gemma4/audio.py`, `gemma4.py` and
//! `processing_gemma4.py`):
//! - the processor: a clip (decoded and resampled to 16 kHz by [`super::audio`]) stands for
//!   `min(ceil(duration_ms / audio_ms_per_token), audio_seq_length)` audio tokens between its
//!   boa/eoa markers; its log-mel features come from [`super::audio::log_mel`];
//! - the encoder (a USM conformer): two stride-2 3×3 convolutions over (time, mel) each with a
//!   channel layer norm and ReLU, a linear map to the hidden width; conformer blocks of a macaron
//!   feed-forward (half residual), chunked local self-attention with relative position logits and
//!   a logit soft cap, a causal light convolution (GLU, depthwise), a second feed-forward; every
//!   projection a clippable linear; an output projection; padded frames zeroed;
//! - the projector (`embed_audio`): a scale-free RMS norm and a linear map to the text width;
//! - the merge: the audio features in place of the audio tokens, as the images' are. mlx-vlm
//!   scatters the features of one clip in order, wrapping round when the clip has more tokens than
//!   encoder frames (`masked_scatter`'s `indices % size`): the same here, per clip.
use super::audio::{FeatureConfig, Mel};
use super::gemma4::ClipLinear;
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};
use crate::models::layers::{Linear, RmsNorm};
use crate::models::Cfg;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use serde_json::Value;

/// Whether `config` describes Gemma 4 with an audio tower.
pub fn has_audio(config: &Value) -> bool {
    config.get("model_type").and_then(Value::as_str) == Some("gemma4")
        && config.get("audio_config").is_some_and(Value::is_object)
}

/// The prompt side of the audio tower.
#[derive(Clone, Debug)]
pub struct AudioProcessor {
    pub features: FeatureConfig,
    pub boa: String,
    pub eoa: String,
    pub audio_token: String,
    pub audio_token_id: i32,
    /// Audio tokens per clip at most (`audio_seq_length`).
    pub seq_length: usize,
    pub ms_per_token: f64,
}

impl AudioProcessor {
    /// The audio tokens of a clip of `samples` samples at the extractor's rate (mlx-vlm's
    /// `_compute_audio_num_tokens`).
    pub fn tokens_for(&self, samples: usize) -> usize {
        let ms = samples as f64 / self.features.sampling_rate as f64 * 1000.0;
        ((ms / self.ms_per_token).ceil() as usize).min(self.seq_length)
    }

    /// Decode, resample and featurize one WAV clip (`what` names it in errors).
    pub fn mel(&self, bytes: &[u8], limits: &super::audio::AudioLimits, what: &str) -> Result<Mel> {
        let w = super::audio::decode(bytes, limits, what)?;
        let x = super::audio::resample(&w.samples, w.rate, self.features.sampling_rate)
            .map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        if self.tokens_for(x.len()) == 0 || x.len() < self.features.frame_length {
            return Err(Error::Invalid(format!(
                "{what}: the clip is too short ({} samples at {} Hz)",
                x.len(),
                self.features.sampling_rate
            )));
        }
        super::audio::log_mel(&x, &self.features).map_err(|e| Error::Invalid(format!("{what}: {e}")))
    }

    /// `text` with each audio marker expanded to `boa + audio_token × n_i + eoa`, `n_i` the `i`-th
    /// clip's token count.
    pub fn expand(&self, text: &str, tokens: &[usize]) -> Result<String> {
        super::expand_markers(text, &self.audio_token, ("audio", "clip(s)"), tokens.len(), |i| {
            Ok(format!("{}{}{}", self.boa, self.audio_token.repeat(tokens[i]), self.eoa))
        })
    }
}

/// The audio processor of a Gemma 4 model with an audio tower: processor_config.json's
/// `feature_extractor` (defaults where absent), `audio_seq_length`, `audio_ms_per_token`; the
/// tokenizer's boa/eoa/audio tokens, checked against config.json's `audio_token_id`.
pub fn processor(
    config: &Value,
    proc_cfg: &Value,
    name: &str,
    tokenizer: &Tokenizer,
) -> Result<Option<AudioProcessor>> {
    if !has_audio(config) {
        return Ok(None);
    }
    audio_dims(config)?;
    let fe = proc_cfg.get("feature_extractor").filter(|v| v.is_object()).unwrap_or(&Value::Null);
    let features = FeatureConfig::from_json(fe, &format!("{name}: feature_extractor"))?;
    let uint = |k: &str, dflt: u64| -> Result<u64> {
        match proc_cfg.get(k) {
            None | Some(Value::Null) => Ok(dflt),
            Some(x) => x
                .as_u64()
                .filter(|n| (1..=1 << 20).contains(n))
                .ok_or_else(|| Error::ModelLoad(format!("{name}.{k} = {x} is not a positive integer"))),
        }
    };
    let seq_length = uint("audio_seq_length", 750)? as usize;
    let ms_per_token = uint("audio_ms_per_token", 40)? as f64;
    let audio_token_id = Cfg(config).opt_i("audio_token_id").unwrap_or(258881);
    let [boa, eoa, audio_token] = super::markers(
        tokenizer,
        [("boa_token", "<|audio>"), ("eoa_token", "<audio|>"), ("audio_token", "<|audio|>")],
        "audio_token_id",
        audio_token_id,
        "Gemma 4's audio markers",
    )?;
    Ok(Some(AudioProcessor { features, boa, eoa, audio_token, audio_token_id, seq_length, ms_per_token }))
}

/// Sizes from `audio_config`, checked.
#[derive(Clone, Debug)]
struct AudioDims {
    hidden: i32,
    layers: i32,
    heads: i32,
    channels: [i32; 2],
    kernel: i32,
    residual_weight: f32,
    chunk: i32,
    context_left: i32,
    context_right: i32,
    logit_cap: f32,
    invalid_logit: f32,
    eps: f32,
    clip: f32,
    out_dims: Option<i32>,
}

fn audio_dims(config: &Value) -> Result<AudioDims> {
    use crate::models::limits::*;
    let a = config.get("audio_config").unwrap_or(&Value::Null);
    let c = Cfg(a);
    let f = |k: &str, d: Option<i64>, max: i64| {
        c.size(k, d, max)
            .map_err(|e| Error::ModelLoad(e.to_string().replace("config.json: ", "config.json: audio_config.")))
    };
    let num = |k: &str, d: f64| -> Result<f32> {
        match a.get(k) {
            None | Some(Value::Null) => Ok(d as f32),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| Error::ModelLoad(format!("config.json: audio_config.{k} = {v} is not a number"))),
        }
    };
    let act = a.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    if act != "silu" && act != "swish" {
        return Err(Error::Unsupported(format!(
            "config.json: audio_config.hidden_act {act:?} is not supported (silu)"
        )));
    }
    let channels = match a.get("subsampling_conv_channels") {
        None | Some(Value::Null) => [128, 32],
        Some(Value::Array(v))
            if v.len() == 2 && v.iter().all(|x| x.as_u64().is_some_and(|n| (1..=4096).contains(&n))) =>
        {
            [v[0].as_u64().unwrap_or(1) as i32, v[1].as_u64().unwrap_or(1) as i32]
        }
        Some(v) => {
            return Err(Error::ModelLoad(format!(
                "config.json: audio_config.subsampling_conv_channels = {v} is not two positive integers"
            )))
        }
    };
    let out_dims = match a.get("output_proj_dims") {
        Some(Value::Null) => None,
        None => Some(1536),
        Some(_) => Some(f("output_proj_dims", None, HIDDEN)?),
    };
    let d = AudioDims {
        hidden: f("hidden_size", Some(1024), HIDDEN)?,
        layers: f("num_hidden_layers", Some(12), LAYERS)?,
        heads: f("num_attention_heads", Some(8), HEADS)?,
        channels,
        kernel: f("conv_kernel_size", Some(5), 1 << 10)?,
        residual_weight: num("residual_weight", 0.5)?,
        chunk: f("attention_chunk_size", Some(12), 1 << 12)?,
        context_left: f("attention_context_left", Some(13), 1 << 12)?,
        context_right: match a.get("attention_context_right") {
            Some(Value::Number(n)) if n.as_u64() == Some(0) => 0,
            None | Some(Value::Null) => 0,
            _ => f("attention_context_right", Some(0), 1 << 12)?,
        },
        logit_cap: num("attention_logit_cap", 50.0)?,
        invalid_logit: num("attention_invalid_logits_value", -1e9)?,
        eps: num("rms_norm_eps", 1e-6)?,
        clip: num("gradient_clipping", 1e10)?,
        out_dims,
    };
    if d.hidden % d.heads != 0 {
        return Err(Error::ModelLoad(format!(
            "config.json: audio_config.hidden_size {} is not a multiple of num_attention_heads {}",
            d.hidden, d.heads
        )));
    }
    if d.logit_cap <= 0.0 {
        return Err(Error::ModelLoad(format!(
            "config.json: audio_config.attention_logit_cap {} is not positive",
            d.logit_cap
        )));
    }
    Ok(d)
}

/// The peak bytes the encoder allocates while encoding one clip of the longest length the feature
/// extractor keeps (`max_length` samples: T0 mel frames), on the CPU. The log-mel features are
/// float32, so the encoder computes in float32 whatever its weights' dtype (4-byte activations).
/// MLX evaluates the two convolutions as one graph and their intermediates add up (as measured);
/// the peak is the features as given, both convolutions and one conformer block:
/// - each stride-2 3×3 convolution (mel bins 128 → 64 → 32, channels 1 → c0 → c1) from X input bytes
///   to Y output bytes: the input masked, padded and copied for the convolution: 3·X; MLX's CPU
///   convolution unrolls its input patches (im2col): T_out·F_out·9·c_in·4; the output, its layer
///   norm's intermediates and the ReLU: 6·Y
/// - a conformer block over T2 frames of hidden h (H heads, chunks of W with C frames of context,
///   U = ⌈T2 / W⌉ chunks): the feed-forward's expansion and its SiLU: 2·T2·4h·4; the residuals,
///   norms, q, k, v and the light convolution's parts: 12·T2·h·4; k and v gathered into their
///   chunks' context: 2·U·C·h·4; the logits (content and relative, shifted, capped, masked) and the
///   softmax: 6·H·U·W·(C + 1)·4
///
/// `tests/test_audio_gemma4.py` measures MLX's peak over `audio_features` of the longest clip
/// against this (at least the measured peak, within 2× of it) for the tiny and a mid-sized encoder.
pub fn encode_transient_bytes(config: &Value, proc_cfg: &Value, name: &str) -> Result<u64> {
    let d = audio_dims(config)?;
    let fe = proc_cfg.get("feature_extractor").filter(|v| v.is_object()).unwrap_or(&Value::Null);
    let features = FeatureConfig::from_json(fe, &format!("{name}: feature_extractor"))?;
    let t0 = features.frames(features.max_length).unwrap_or(0) as u64;
    let half = |t: u64| (t + 2 - 3) / 2 + 1;
    let conv = |t_in: u64, f_in: u64, c_in: u64, c_out: u64| {
        let (t, f) = (half(t_in), half(f_in));
        3 * t_in * f_in * c_in * 4 + t * f * 9 * c_in * 4 + 6 * t * f * c_out * 4
    };
    let (c0, c1) = (d.channels[0] as u64, d.channels[1] as u64);
    let (t1, t2) = (half(t0), half(half(t0)));
    let (h, heads, w) = (d.hidden as u64, d.heads as u64, d.chunk as u64);
    let ctx = w + (d.context_left as u64).saturating_sub(1) + d.context_right as u64;
    let u = t2.div_ceil(w);
    let block = 2 * t2 * 4 * h * 4 + 12 * t2 * h * 4 + 2 * u * ctx * h * 4 + 6 * heads * u * w * (ctx + 1) * 4;
    Ok(t0 * 128 * 4 + conv(t0, 128, 1, c0) + conv(t1, 64, c0, c1) + block)
}

struct FeedForward {
    pre: RmsNorm,
    ffw1: ClipLinear,
    ffw2: ClipLinear,
    post: RmsNorm,
}

struct Block {
    ff1: FeedForward,
    q: ClipLinear,
    k: ClipLinear,
    v: ClipLinear,
    post: ClipLinear,
    /// `softplus(per_dim_scale) · head_dim^-½ / ln 2` (float32 `[head_dim]`).
    q_scale: Array,
    /// The relative position keys `[heads, head_dim, span]` (float32).
    rel_k: Array,
    lc_pre: RmsNorm,
    lc_start: ClipLinear,
    /// `[hidden, kernel, 1]`.
    dw: Array,
    lc_norm: RmsNorm,
    lc_end: ClipLinear,
    ff2: FeedForward,
    norm_pre_attn: RmsNorm,
    norm_post_attn: RmsNorm,
    norm_out: RmsNorm,
}

/// The audio encoder and its projector, on the engine thread.
pub struct AudioTower {
    conv: [(Array, Array); 2],
    input_proj: Linear,
    blocks: Vec<Block>,
    out_proj: Option<Linear>,
    proj: Linear,
    d: AudioDims,
    /// The chunked attention's local mask `[chunk, context]` (true: attend).
    local: Array,
    pub processor: AudioProcessor,
}

fn clip_linear(w: &mut Weights, p: &str, out: i32, inp: i32) -> Result<ClipLinear> {
    // mlx-vlm's audio linears are always clippable: the bounds when the checkpoint has them
    let clipped = w.contains(&format!("{p}.input_min"));
    ClipLinear::load(w, p, clipped, out, inp)
}

impl AudioTower {
    /// Take the encoder's and the projector's weights (`[model.]audio_tower.*`,
    /// `[model.]embed_audio.*`) out of `w`.
    pub fn load(config: &Value, w: &mut Weights, processor: AudioProcessor) -> Result<AudioTower> {
        let d = audio_dims(config)?;
        let text = config
            .get("text_config")
            .ok_or_else(|| Error::ModelLoad("config.json: gemma4 has no text_config".into()))?;
        let text_hidden = Cfg(text).size("hidden_size", Some(1536), crate::models::limits::HIDDEN)?;
        let root = if w.keys().any(|k| k.starts_with("model.audio_tower.")) { "model." } else { "" };
        let p = format!("{root}audio_tower");
        let h = d.hidden;
        let s = format!("{p}.subsample_conv_projection");
        let mut conv_layer = |i: usize, cin: i32, cout: i32| -> Result<(Array, Array)> {
            let name = format!("{s}.layer{i}.conv.weight");
            let a = w.take(&name)?;
            // Hugging Face's [out, in, 3, 3] or MLX's [out, 3, 3, in]
            let a = match a.shape().as_slice() {
                [o, 3, 3, c] if *o == cout && *c == cin => a,
                [o, c, 3, 3] if *o == cout && *c == cin => mx::transpose_axes(&a, &[0, 2, 3, 1])?,
                sh => {
                    return Err(Error::ModelLoad(format!(
                        "weight {name} has shape {sh:?}, expected [{cout}, {cin}, 3, 3]"
                    )))
                }
            };
            let norm = w.take_shaped(&format!("{s}.layer{i}.norm.weight"), &[cout])?;
            Ok((a, norm))
        };
        let conv = [conv_layer(0, 1, d.channels[0])?, conv_layer(1, d.channels[0], d.channels[1])?];
        let mut freq = 128;
        for _ in 0..2 {
            freq = (freq + 2 - 3) / 2 + 1;
        }
        let input_proj = Linear::load(w, &format!("{s}.input_proj_linear"), false, h, freq * d.channels[1])?;
        let hd = h / d.heads;
        let max_back = (d.context_left - 1).max(0);
        let span = max_back + d.context_right + 1;
        // the sinusoidal relative positions max_back, …, -context_right (float32)
        let nts = h / 2;
        let inc = (10000f64).ln() / ((nts - 1).max(1) as f64);
        let inv_a = mx::exp(&mx::multiply(
            &mx::astype(&mx::arange(0.0, nts as f64, 1.0, Dtype::Int32)?, Dtype::Float32)?,
            &Array::f32(-inc as f32)?,
        )?)?;
        let pos: Vec<f32> = (0..span).map(|i| (max_back - i) as f32).collect();
        let scaled = mx::multiply(&Array::from_slice(&pos, &[1, span, 1])?, &mx::reshape(&inv_a, &[1, 1, nts])?)?;
        let timing = mx::concatenate(&[&mx::sin(&scaled)?, &mx::cos(&scaled)?], -1)?;
        let mut blocks = Vec::with_capacity(d.layers as usize);
        for i in 0..d.layers {
            let l = format!("{p}.layers.{i}");
            let ff = |w: &mut Weights, n: &str| -> Result<FeedForward> {
                Ok(FeedForward {
                    pre: RmsNorm::load(w, &format!("{l}.{n}.pre_layer_norm"), 1e-6, h)?,
                    ffw1: clip_linear(w, &format!("{l}.{n}.ffw_layer_1"), 4 * h, h)?,
                    ffw2: clip_linear(w, &format!("{l}.{n}.ffw_layer_2"), h, 4 * h)?,
                    post: RmsNorm::load(w, &format!("{l}.{n}.post_layer_norm"), 1e-6, h)?,
                })
            };
            let ff1 = ff(w, "feed_forward1")?;
            let a = format!("{l}.self_attn");
            let pds = w.take_shaped(&format!("{a}.per_dim_scale"), &[hd])?;
            // q · (q_scale · softplus(per_dim_scale)), as mlx-vlm computes it in the parameter's dtype
            let q_scale = mx::multiply(
                &mx::scalar_as((hd as f64).powf(-0.5) / std::f64::consts::LN_2, pds.dtype())?,
                &mx::logaddexp(&pds, &mx::scalar_as(0.0, pds.dtype())?)?,
            )?;
            let rw = w.take_shaped(&format!("{a}.relative_k_proj.weight"), &[h, h])?;
            let rel_k =
                mx::astype(&mx::matmul(&mx::astype(&timing, rw.dtype())?, &mx::transpose(&rw)?)?, Dtype::Float32)?;
            let rel_k = mx::transpose_axes(&mx::reshape(&rel_k, &[span, d.heads, hd])?, &[1, 2, 0])?;
            let dw_name = format!("{l}.lconv1d.depthwise_conv1d.weight");
            let dw = w.take(&dw_name)?;
            let dw = match dw.shape().as_slice() {
                [c, k, 1] if *c == h && *k == d.kernel => dw,
                [c, 1, k] if *c == h && *k == d.kernel => mx::transpose_axes(&dw, &[0, 2, 1])?,
                sh => {
                    return Err(Error::ModelLoad(format!(
                        "weight {dw_name} has shape {sh:?}, expected [{h}, 1, {}]",
                        d.kernel
                    )))
                }
            };
            blocks.push(Block {
                ff1,
                q: clip_linear(w, &format!("{a}.q_proj"), h, h)?,
                k: clip_linear(w, &format!("{a}.k_proj"), h, h)?,
                v: clip_linear(w, &format!("{a}.v_proj"), h, h)?,
                post: clip_linear(w, &format!("{a}.post"), h, h)?,
                q_scale,
                rel_k,
                lc_pre: RmsNorm::load(w, &format!("{l}.lconv1d.pre_layer_norm"), d.eps, h)?,
                lc_start: clip_linear(w, &format!("{l}.lconv1d.linear_start"), 2 * h, h)?,
                dw,
                lc_norm: RmsNorm::load(w, &format!("{l}.lconv1d.conv_norm"), d.eps, h)?,
                lc_end: clip_linear(w, &format!("{l}.lconv1d.linear_end"), h, h)?,
                ff2: ff(w, "feed_forward2")?,
                norm_pre_attn: RmsNorm::load(w, &format!("{l}.norm_pre_attn"), 1e-6, h)?,
                norm_post_attn: RmsNorm::load(w, &format!("{l}.norm_post_attn"), 1e-6, h)?,
                norm_out: RmsNorm::load(w, &format!("{l}.norm_out"), 1e-6, h)?,
            });
        }
        let out_proj = match d.out_dims {
            Some(o) => Some(Linear::load(w, &format!("{p}.output_proj"), true, o, h)?),
            None => None,
        };
        let proj = Linear::load(
            w,
            &format!("{root}embed_audio.embedding_projection"),
            false,
            text_hidden,
            d.out_dims.unwrap_or(h),
        )?;
        let ctx = d.chunk + max_back + d.context_right;
        let mut local = Vec::with_capacity((d.chunk * ctx) as usize);
        for q in 0..d.chunk {
            for c in 0..ctx {
                let dist = q + max_back - c;
                local.push(((dist >= 0 && dist < max_back) || (dist < 0 && -dist < d.context_right)) as u8 as f32);
            }
        }
        let local = mx::not_equal(&Array::from_slice(&local, &[d.chunk, ctx])?, &Array::f32(0.0)?)?;
        Ok(AudioTower { conv, input_proj, blocks, out_proj, proj, d, local, processor })
    }

    fn clip(&self, x: &Array) -> Result<Array> {
        let c = self.d.clip as f64;
        mx::clip(x, Some(&mx::scalar_as(-c, x.dtype())?), Some(&mx::scalar_as(c, x.dtype())?))
    }

    fn feed_forward(&self, f: &FeedForward, x: &Array) -> Result<Array> {
        let y = f.pre.forward(&self.clip(x)?)?;
        let y = f.ffw1.forward(&y)?;
        let y = mx::multiply(&y, &mx::sigmoid(&y)?)?;
        let y = f.post.forward(&self.clip(&f.ffw2.forward(&y)?)?)?;
        mx::add(x, &mx::multiply(&y, &mx::scalar_as(self.d.residual_weight as f64, y.dtype())?)?)
    }

    /// `[1, T, ...]` → `[1, blocks, context, ...]` (mlx-vlm's `_extract_block_context`).
    fn block_context(&self, x: &Array, t: i32) -> Result<Array> {
        let max_back = (self.d.context_left - 1).max(0);
        let (pl, pr) = (max_back, self.d.context_right + self.d.chunk - 1);
        let ctx = self.d.chunk + max_back + self.d.context_right;
        let nd = x.ndim();
        let mut lo = vec![0; nd];
        let mut hi = vec![0; nd];
        lo[1] = pl;
        hi[1] = pr;
        let axes: Vec<i32> = (0..nd as i32).collect();
        let zero = mx::scalar_as(0.0, x.dtype())?;
        let xp = mx::pad(x, &axes, &lo, &hi, &zero)?;
        let nb = (t + pl + pr - ctx) / self.d.chunk + 1;
        let idx: Vec<i32> = (0..nb).flat_map(|b| (0..ctx).map(move |o| b * self.d.chunk + o)).collect();
        let g = mx::take(&xp, &Array::from_slice(&idx, &[nb * ctx])?, 1)?;
        let mut shape = x.shape();
        shape.splice(1..2, [nb, ctx]);
        mx::reshape(&g, &shape)
    }

    fn attention(&self, b: &Block, x: &Array, valid: &Array, t: i32) -> Result<Array> {
        let (n, hd, w) = (self.d.heads, self.d.hidden / self.d.heads, self.d.chunk);
        let f32_of = |a: Array| -> Result<Array> { mx::reshape(&mx::astype(&a, Dtype::Float32)?, &[1, t, n, hd]) };
        let q = mx::multiply(&f32_of(b.q.forward(x)?)?, &b.q_scale)?;
        let k = mx::multiply(
            &f32_of(b.k.forward(x)?)?,
            &Array::f32(((1.0 + std::f64::consts::E).ln() / std::f64::consts::LN_2) as f32)?,
        )?;
        let v = f32_of(b.v.forward(x)?)?;
        let u = (t + w - 1) / w;
        let zero = Array::f32(0.0)?;
        let qb = mx::reshape(&mx::pad(&q, &[1], &[0], &[u * w - t], &zero)?, &[1, u, w, n, hd])?;
        let kb = self.block_context(&k, t)?; // [1, U, C, N, H]
        let vb = self.block_context(&v, t)?;
        let c = kb.dim(2);
        let span = b.rel_k.dim(-1);
        let qp = mx::transpose_axes(&qb, &[0, 3, 1, 2, 4])?; // [1, N, U, W, H]
        let kp = mx::transpose_axes(&kb, &[0, 3, 1, 4, 2])?; // [1, N, U, H, C]
        let ac = mx::matmul(&qp, &kp)?;
        let bd = mx::reshape(&mx::matmul(&mx::reshape(&qp, &[1, n, u * w, hd])?, &b.rel_k)?, &[1, n, u, w, span])?;
        // the relative shift
        let bd = mx::pad(&bd, &[4], &[0], &[c + 1 - span], &zero)?;
        let bd = mx::reshape(&bd, &[1, n, u, w * (c + 1)])?;
        let bd = mx::reshape(&mx::slice_axis(&bd, 3, 0, w * c)?, &[1, n, u, w, c])?;
        let logits = mx::add(&ac, &bd)?;
        let cap = Array::f32(self.d.logit_cap)?;
        let logits = mx::multiply(&mx::tanh(&mx::divide(&logits, &cap)?)?, &cap)?;
        let ev = mx::not_equal(&self.block_context(valid, t)?, &zero)?; // [1, U, C]
        let cond = mx::logical_and(&mx::reshape(&ev, &[1, 1, u, 1, c])?, &mx::reshape(&self.local, &[1, 1, 1, w, c])?)?;
        let logits = mx::where_(&cond, &logits, &Array::f32(self.d.invalid_logit)?)?;
        let probs = mx::softmax(&logits, &[-1], false)?;
        let vp = mx::transpose_axes(&vb, &[0, 3, 1, 2, 4])?; // [1, N, U, C, H]
        let ctxv = mx::transpose_axes(&mx::matmul(&probs, &vp)?, &[0, 2, 3, 1, 4])?; // [1, U, W, N, H]
        let ctxv = mx::slice_axis(&mx::reshape(&ctxv, &[1, u * w, n * hd])?, 1, 0, t)?;
        b.post.forward(&ctxv)
    }

    fn block(&self, b: &Block, x: &Array, valid: &Array, validf: &Array, t: i32) -> Result<Array> {
        let x = self.feed_forward(&b.ff1, x)?;
        let y = self.attention(b, &b.norm_pre_attn.forward(&self.clip(&x)?)?, valid, t)?;
        let x = mx::add(&x, &b.norm_post_attn.forward(&self.clip(&y)?)?)?;
        let x = mx::multiply(&x, &mx::astype(validf, x.dtype())?)?;
        // the light convolution
        let y = b.lc_start.forward(&b.lc_pre.forward(&x)?)?;
        let h = self.d.hidden;
        let (g1, g2) = (mx::slice_axis(&y, -1, 0, h)?, mx::slice_axis(&y, -1, h, 2 * h)?);
        let y = mx::multiply(&g1, &mx::sigmoid(&g2)?)?;
        let y = mx::pad(&y, &[1], &[self.d.kernel - 1], &[0], &mx::scalar_as(0.0, y.dtype())?)?;
        let y = mx::conv1d(&y, &b.dw, 1, 0, 1, h)?;
        let y = b.lc_norm.forward(&self.clip(&y)?)?;
        let y = b.lc_end.forward(&mx::multiply(&y, &mx::sigmoid(&y)?)?)?;
        let x = mx::add(&y, &x)?;
        let x = self.feed_forward(&b.ff2, &x)?;
        b.norm_out.forward(&self.clip(&x)?)
    }

    /// The projected features `[T', text_hidden]` of one clip's log-mel features (all its encoder
    /// frames, the padded ones zero before the projection), in `dtype`.
    pub fn clip_features(&self, mel: &Mel, dtype: Dtype) -> Result<Array> {
        let frames = mel.frames as i32;
        let mut x = mx::expand_dims(&Array::from_slice(&mel.data, &[1, frames, 128])?, -1)?; // [1, T, F, 1]
        let mut pad: Vec<f32> = mel.mask.iter().map(|&v| if v { 0.0 } else { 1.0 }).collect();
        for (wgt, norm) in &self.conv {
            let t = x.dim(1);
            let m = mx::not_equal(&Array::from_slice(&pad, &[1, t, 1, 1])?, &Array::f32(0.0)?)?;
            x = mx::where_(&m, &mx::scalar_as(0.0, x.dtype())?, &x)?;
            x = mx::pad(&x, &[1, 2], &[1, 1], &[1, 1], &mx::scalar_as(0.0, x.dtype())?)?;
            x = mx::conv2d(&x, wgt, 2, 2, 0, 0, 1, 1, 1)?;
            let t_out = x.dim(1) as usize;
            pad = pad.iter().step_by(2).take(t_out).copied().collect();
            x = mx::maximum(&mx::layer_norm(&x, Some(norm), None, self.d.eps)?, &mx::scalar_as(0.0, x.dtype())?)?;
        }
        let t = x.dim(1);
        let x = mx::reshape(&x, &[1, t, x.dim(2) * x.dim(3)])?;
        let mut h = self.input_proj.forward(&x)?;
        let validv: Vec<f32> = pad.iter().map(|&p| 1.0 - p).collect();
        let validf = mx::reshape(&Array::from_slice(&validv, &[1, t])?, &[1, t, 1])?;
        let valid = Array::from_slice(&validv, &[1, t])?;
        for b in &self.blocks {
            h = self.block(b, &h, &valid, &validf, t)?;
        }
        if let Some(o) = &self.out_proj {
            h = o.forward(&h)?;
        }
        let padm = mx::not_equal(&Array::from_slice(&pad, &[1, t, 1])?, &Array::f32(0.0)?)?;
        h = mx::where_(&padm, &mx::scalar_as(0.0, h.dtype())?, &h)?;
        let f = self.proj.forward(&mx::rms_norm(&h, None, self.d.eps)?)?;
        mx::astype(&mx::reshape(&f, &[t, f.dim(-1)])?, dtype)
    }

    /// The features of each clip's audio tokens `[n_i, text_hidden]` concatenated (mlx-vlm's
    /// scatter: the clip's encoder frames in order, wrapping round past the last).
    pub fn features(&self, mels: &[&Mel], dtype: Dtype) -> Result<Array> {
        let mut parts = Vec::with_capacity(mels.len());
        for m in mels {
            // evaluated clip by clip: the plan counts one clip's transient (as Tower::features' images)
            let f = self.clip_features(m, dtype)?;
            f.eval()?;
            let frames = f.dim(0);
            let n = self.processor.tokens_for(m.samples) as i32;
            let idx: Vec<i32> = (0..n).map(|i| i % frames).collect();
            parts.push(mx::take(&f, &Array::from_slice(&idx, &[n])?, 0)?);
        }
        let refs: Vec<&Array> = parts.iter().collect();
        mx::concatenate(&refs, 0)
    }
}

/// The audio tokens of `mels` (each clip's count), checked against `prompt`.
pub fn check_tokens(p: &AudioProcessor, prompt: &[i32], mels: &[&Mel]) -> Result<()> {
    let found = prompt.iter().filter(|&&t| t == p.audio_token_id).count();
    let want: usize = mels.iter().map(|m| p.tokens_for(m.samples)).sum();
    if found != want {
        return Err(Error::Invalid(format!(
            "the prompt has {found} audio tokens for {} clip(s) of {want} tokens",
            mels.len()
        )));
    }
    Ok(())
}
