//! Audio decoding and preprocessing (pure Rust, no MLX), as mlx-vlm 0.7.10 prepares a clip for
//! Gemma 4 (`mlx_vlm.utils.load_audio` through mlx-audio 0.6.2, then
//! `models/gemma4/audio_feature_extractor.py`):
//! - **decode**: WAV only, through the `hound` crate (a small, well-kept pure-Rust WAV reader:
//!   PCM 8/16/24/32-bit and float32, any channel count, WAVE_FORMAT_EXTENSIBLE; it checks the
//!   header and fails on a data chunk shorter than the header says). Other containers (MP3, FLAC,
//!   Ogg, MP4/M4A, AIFF, WebM) are refused naming the format: no decoder for them fits the
//!   "well-kept, small" bar today, and a wrong decode would be silent. The samples become 16-bit
//!   integers as miniaudio makes them (mlx-audio decodes through miniaudio to signed 16-bit), then
//!   `/ 32768` in float32; channels are averaged (float32);
//! - **resample** to 16 kHz: scipy's `resample_poly(x, up, down, window=h, padtype="edge")` with
//!   mlx-audio's filter `h = firwin(2·64·max(up, down) + 1, 0.9475937…/max(up, down),
//!   window=("kaiser", 14.7696…))` (librosa's `kaiser_best`), both reproduced here in float64;
//! - **log-mel** (Gemma 4's USM feature extractor): at most 30 s, zero-padded to a multiple of 128
//!   samples, `frame_length / 2` zeros in front, frames of 320 samples every 160 with a periodic
//!   Hann window, |rFFT(512)|, 128 HTK mel bins (0–8 kHz, no norm), `log(mel + 1e-3)`, frames that
//!   end in the padding zeroed and masked.
use crate::error::{Error, Result};
use serde_json::Value;
use std::io::Cursor;

/// What an audio clip may be.
#[derive(Clone, Copy, Debug)]
pub struct AudioLimits {
    /// Encoded bytes at most.
    pub max_bytes: usize,
    /// Seconds at most (checked from the header before decoding).
    pub max_seconds: f64,
}

/// 50 MiB encoded, 30 seconds (Gemma 4's audio window: 750 tokens of 40 ms).
pub const DEFAULT_AUDIO_LIMITS: AudioLimits = AudioLimits { max_bytes: 50 << 20, max_seconds: 30.0 };

impl Default for AudioLimits {
    fn default() -> Self {
        DEFAULT_AUDIO_LIMITS
    }
}

fn bad(what: &str, why: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("{what}: {why}"))
}

/// The container `bytes` look like, from their first bytes (None: WAV or unknown).
pub fn sniff_container(bytes: &[u8]) -> Option<&'static str> {
    let at = |i: usize, s: &[u8]| bytes.len() >= i + s.len() && &bytes[i..i + s.len()] == s;
    if at(0, b"RIFF") && at(8, b"WAVE") {
        return None;
    }
    Some(if at(0, b"ID3") || (bytes.len() >= 2 && bytes[0] == 0xFF && bytes[1] & 0xE0 == 0xE0) {
        "MP3"
    } else if at(0, b"fLaC") {
        "FLAC"
    } else if at(0, b"OggS") {
        "Ogg"
    } else if at(4, b"ftyp") {
        "MP4/M4A"
    } else if at(0, b"FORM") && (at(8, b"AIFF") || at(8, b"AIFC")) {
        "AIFF"
    } else if at(0, b"\x1a\x45\xdf\xa3") {
        "WebM/Matroska"
    } else if at(0, b"RF64") || at(0, b"RIFX") || at(0, b"RIFF") {
        "a RIFF file that is not little-endian WAVE"
    } else {
        "unrecognized"
    })
}

/// A decoded clip: mono float32 samples at `rate` Hz.
#[derive(Clone, Debug, PartialEq)]
pub struct Wave {
    pub samples: Vec<f32>,
    pub rate: u32,
}

/// miniaudio's float32 → signed 16-bit (`ma_pcm_f32_to_s16`, no dither): clamp to [-1, 1],
/// `(x + 1) · 32767.5` in float32, truncated, minus 32768.
fn f32_to_s16(x: f32) -> i16 {
    let c = x.clamp(-1.0, 1.0);
    (((c + 1.0) * 32767.5f32) as i32 - 32768) as i16
}

/// Decode WAV `bytes` (`what` names the clip in errors) to mono float32 as mlx-vlm's loader does.
pub fn decode(bytes: &[u8], limits: &AudioLimits, what: &str) -> Result<Wave> {
    if bytes.len() > limits.max_bytes {
        return Err(bad(
            what,
            format!("{} bytes of audio, more than the limit of {} bytes", bytes.len(), limits.max_bytes),
        ));
    }
    if let Some(fmt) = sniff_container(bytes) {
        return Err(bad(what, format!("{fmt} audio is not supported: send WAV (PCM 8/16/24/32-bit or float32)")));
    }
    let reader =
        hound::WavReader::new(Cursor::new(bytes)).map_err(|e| bad(what, format!("not a valid WAV file: {e}")))?;
    let spec = reader.spec();
    let (ch, rate) = (spec.channels as usize, spec.sample_rate);
    if ch == 0 || !(1000..=768_000).contains(&rate) {
        return Err(bad(
            what,
            format!("a WAV file of {ch} channel(s) at {rate} Hz is not supported (1 kHz to 768 kHz)"),
        ));
    }
    let frames = reader.duration() as u64;
    let seconds = frames as f64 / rate as f64;
    if seconds > limits.max_seconds {
        return Err(bad(what, format!("{seconds:.2} s of audio, longer than the limit of {} s", limits.max_seconds)));
    }
    if frames == 0 {
        return Err(bad(what, "the WAV file has no samples"));
    }
    let want = frames as usize * ch;
    let mut s16 = Vec::with_capacity(want);
    let eof = |e: hound::Error| bad(what, format!("the WAV data is shorter than its header says or corrupt: {e}"));
    match (spec.sample_format, spec.bits_per_sample) {
        (hound::SampleFormat::Int, bits @ (8 | 16 | 24 | 32)) => {
            for x in reader.into_samples::<i32>() {
                let x = x.map_err(eof)?;
                s16.push(match bits {
                    8 => (x << 8) as i16,
                    16 => x as i16,
                    24 => (x >> 8) as i16,
                    _ => (x >> 16) as i16,
                });
            }
        }
        (hound::SampleFormat::Float, 32) => {
            for x in reader.into_samples::<f32>() {
                let x = x.map_err(eof)?;
                if !x.is_finite() {
                    return Err(bad(what, "the WAV file has a non-finite float sample"));
                }
                s16.push(f32_to_s16(x));
            }
        }
        (f, b) => {
            let kind = if f == hound::SampleFormat::Float { "float" } else { "PCM" };
            return Err(bad(what, format!("{b}-bit {kind} WAV is not supported (PCM 8/16/24/32-bit or float32)")));
        }
    }
    if s16.len() != want {
        return Err(bad(what, format!("the WAV data holds {} samples, its header says {want}", s16.len())));
    }
    let samples = if ch == 1 {
        s16.iter().map(|&x| x as f32 / 32768.0).collect()
    } else {
        s16.chunks_exact(ch)
            .map(|f| {
                let sum = f.iter().fold(0f32, |acc, &x| acc + x as f32 / 32768.0);
                sum / ch as f32
            })
            .collect()
    };
    Ok(Wave { samples, rate })
}

/// The modified Bessel function of the first kind, order 0 (power series, float64).
fn bessel_i0(x: f64) -> f64 {
    let (mut sum, mut term, q) = (1.0f64, 1.0f64, x * x / 4.0);
    for k in 1..500 {
        term *= q / (k as f64 * k as f64);
        sum += term;
        if term < sum * 1e-17 {
            break;
        }
    }
    sum
}

/// scipy's `firwin(numtaps, cutoff, window=("kaiser", beta))` (low-pass, scaled to unit DC gain;
/// `cutoff` relative to Nyquist).
pub fn firwin_kaiser(numtaps: usize, cutoff: f64, beta: f64) -> Vec<f64> {
    let alpha = 0.5 * (numtaps as f64 - 1.0);
    let sinc = |x: f64| if x == 0.0 { 1.0 } else { (std::f64::consts::PI * x).sin() / (std::f64::consts::PI * x) };
    let i0b = bessel_i0(beta);
    let mut h: Vec<f64> = (0..numtaps)
        .map(|n| {
            let m = n as f64 - alpha;
            let r = if alpha == 0.0 { 0.0 } else { m / alpha };
            let w = bessel_i0(beta * (1.0 - r * r).max(0.0).sqrt()) / i0b;
            cutoff * sinc(cutoff * m) * w
        })
        .collect();
    let s: f64 = h.iter().sum();
    for x in &mut h {
        *x /= s;
    }
    h
}

/// Filter taps at most of a resampling (2·64·max(up, down) + 1): rates whose reduced ratio needs
/// more are refused (no common rate comes near: 44.1 kHz → 16 kHz needs 56 449).
const MAX_TAPS: usize = 2 * 64 * 8192 + 1;

/// mlx-audio's `resample_audio` from `from` Hz to `to` Hz: scipy's `resample_poly` with the
/// `kaiser_best` filter and `padtype="edge"`, in float64, back to float32.
pub fn resample(x: &[f32], from: u32, to: u32) -> Result<Vec<f32>> {
    if from == to || x.is_empty() {
        return Ok(x.to_vec());
    }
    let g = gcd(from as u64, to as u64);
    let (up, down) = ((to as u64 / g) as usize, (from as u64 / g) as usize);
    let max_rate = up.max(down);
    let taps = 2 * 64 * max_rate + 1;
    if taps > MAX_TAPS {
        return Err(Error::Invalid(format!(
            "resampling {from} Hz to {to} Hz needs a {taps}-tap filter: the rate is not supported"
        )));
    }
    let (rolloff, beta) = (0.947_593_716_739_959_6, 14.769_656_459_379_492);
    let mut h = firwin_kaiser(taps, rolloff / max_rate as f64, beta);
    for v in &mut h {
        *v *= up as f64;
    }
    let half_len = (taps - 1) / 2;
    let n_pre_pad = down - half_len % down;
    let n_pre_remove = (half_len + n_pre_pad) / down;
    let n_in = x.len();
    let n_out = (n_in * up).div_ceil(down);
    // the padded filter hp = [0 × n_pre_pad, h]; y[k] = Σ_n x_edge[n] · hp[k·down − n·up]
    let hp_len = n_pre_pad + taps;
    let xe = |n: i64| -> f64 { x[n.clamp(0, n_in as i64 - 1) as usize] as f64 };
    let mut out = Vec::with_capacity(n_out);
    for i in 0..n_out {
        let m = ((i + n_pre_remove) * down) as i64;
        // n with 0 <= m - n·up < hp_len
        let n_hi = m.div_euclid(up as i64);
        let n_lo = (m - hp_len as i64 + 1 + up as i64 - 1).div_euclid(up as i64);
        let mut acc = 0f64;
        for n in n_lo..=n_hi {
            let j = (m - n * up as i64) as usize;
            if j >= n_pre_pad {
                acc += xe(n) * h[j - n_pre_pad];
            }
        }
        out.push(acc as f32);
    }
    Ok(out)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Gemma 4's audio feature extractor settings (processor_config.json's `feature_extractor`, the
/// defaults where absent, as mlx-vlm reads them).
#[derive(Clone, Debug)]
pub struct FeatureConfig {
    pub feature_size: usize,
    pub sampling_rate: u32,
    pub frame_length: usize,
    pub hop_length: usize,
    pub fft_length: usize,
    pub min_frequency: f64,
    pub max_frequency: f64,
    pub preemphasis: f64,
    pub preemphasis_htk_flavor: bool,
    pub input_scale_factor: f64,
    pub mel_floor: f64,
    pub per_bin_mean: Option<Vec<f64>>,
    pub per_bin_stddev: Option<Vec<f64>>,
    pub padding_value: f32,
    /// Samples at most (the extractor's `max_length`: longer clips are cut).
    pub max_length: usize,
    /// The padded length's multiple (`pad_to_multiple_of`).
    pub pad_to_multiple_of: usize,
}

impl Default for FeatureConfig {
    fn default() -> Self {
        FeatureConfig::from_json(&Value::Null, "feature_extractor").expect("the defaults are valid")
    }
}

impl FeatureConfig {
    /// The settings in `fe` (`name` names it in errors); refused: dithering (random), a feature
    /// size other than 128 (the encoder's input), out-of-range values.
    pub fn from_json(fe: &Value, name: &str) -> Result<FeatureConfig> {
        let num = |k: &str, dflt: f64| -> Result<f64> {
            match fe.get(k) {
                None | Some(Value::Null) => Ok(dflt),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| Error::ModelLoad(format!("{name}.{k} = {v} is not a number"))),
            }
        };
        let boolean = |k: &str, dflt: bool| -> Result<bool> {
            match fe.get(k) {
                None | Some(Value::Null) => Ok(dflt),
                Some(v) => v.as_bool().ok_or_else(|| Error::ModelLoad(format!("{name}.{k} = {v} is not a boolean"))),
            }
        };
        let feature_size = num("feature_size", 128.0)?;
        if feature_size != 128.0 {
            return Err(Error::ModelLoad(format!(
                "{name}.feature_size = {feature_size}: Gemma 4's audio encoder takes 128 mel bins"
            )));
        }
        let sr = num("sampling_rate", 16000.0)?;
        if !(1000.0..=192_000.0).contains(&sr) || sr.fract() != 0.0 {
            return Err(Error::ModelLoad(format!("{name}.sampling_rate = {sr} is not a sample rate in Hz")));
        }
        let frame_ms = num("frame_length_ms", 20.0)?;
        let hop_ms = num("hop_length_ms", 10.0)?;
        let frame_length = (sr * frame_ms / 1000.0).round();
        let hop_length = (sr * hop_ms / 1000.0).round();
        if !(2.0..=65536.0).contains(&frame_length) || !(1.0..=65536.0).contains(&hop_length) {
            return Err(Error::ModelLoad(format!(
                "{name}: frame_length_ms {frame_ms} / hop_length_ms {hop_ms} give no usable frames"
            )));
        }
        let (frame_length, hop_length) = (frame_length as usize, hop_length as usize);
        let mut fft_length = frame_length.next_power_of_two();
        if boolean("fft_overdrive", false)? {
            fft_length *= 2;
        }
        let dither = num("dither", 0.0)?;
        if dither != 0.0 {
            return Err(Error::Unsupported(format!(
                "{name}.dither = {dither}: dithered (random) features are not supported"
            )));
        }
        let (min_frequency, max_frequency) = (num("min_frequency", 0.0)?, num("max_frequency", 8000.0)?);
        if !(0.0..max_frequency).contains(&min_frequency) || max_frequency > sr / 2.0 {
            return Err(Error::ModelLoad(format!(
                "{name}: min_frequency {min_frequency} / max_frequency {max_frequency} are not a band below Nyquist ({})",
                sr / 2.0
            )));
        }
        let mel_floor = num("mel_floor", 1e-3)?;
        if mel_floor <= 0.0 {
            return Err(Error::ModelLoad(format!("{name}.mel_floor = {mel_floor} is not positive")));
        }
        let per_bin = |k: &str| -> Result<Option<Vec<f64>>> {
            match fe.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) if a.len() == 128 && a.iter().all(Value::is_number) => {
                    Ok(Some(a.iter().map(|x| x.as_f64().unwrap_or(0.0)).collect()))
                }
                Some(_) => Err(Error::ModelLoad(format!("{name}.{k} is not 128 numbers"))),
            }
        };
        let per_bin_stddev = per_bin("per_bin_stddev")?;
        if per_bin_stddev.as_ref().is_some_and(|s| s.contains(&0.0)) {
            return Err(Error::ModelLoad(format!("{name}.per_bin_stddev has a zero")));
        }
        Ok(FeatureConfig {
            feature_size: 128,
            sampling_rate: sr as u32,
            frame_length,
            hop_length,
            fft_length,
            min_frequency,
            max_frequency,
            preemphasis: num("preemphasis", 0.0)?,
            preemphasis_htk_flavor: boolean("preemphasis_htk_flavor", true)?,
            input_scale_factor: num("input_scale_factor", 1.0)?,
            mel_floor,
            per_bin_mean: per_bin("per_bin_mean")?,
            per_bin_stddev,
            padding_value: num("padding_value", 0.0)? as f32,
            max_length: 480_000,
            pad_to_multiple_of: 128,
        })
    }

    /// The samples a clip of `samples` is featurized as: cut at `max_length`, padded to a
    /// multiple of `pad_to_multiple_of`.
    fn padded_len(&self, samples: usize) -> usize {
        samples.min(self.max_length).div_ceil(self.pad_to_multiple_of) * self.pad_to_multiple_of
    }

    /// The feature frames of a clip of `samples` ([`log_mel`]'s rows); None: too short for one.
    pub fn frames(&self, samples: usize) -> Option<usize> {
        let len = self.frame_length / 2 + self.padded_len(samples);
        let unfold = self.frame_length + 1;
        (len >= unfold).then(|| (len - unfold) / self.hop_length + 1)
    }

    /// The HTK mel filter bank `[fft_length / 2 + 1][feature_size]` (float64, no norm), as
    /// transformers' `mel_filter_bank` builds it: each filter as the range of FFT bins it covers
    /// and their weights.
    fn mel_filters(&self) -> Vec<(usize, Vec<f64>)> {
        let bins = self.fft_length / 2 + 1;
        let hz_to_mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
        let mel_to_hz = |m: f64| 700.0 * (10f64.powf(m / 2595.0) - 1.0);
        let (lo, hi) = (hz_to_mel(self.min_frequency), hz_to_mel(self.max_frequency));
        let n = self.feature_size + 2;
        // numpy's linspace: start + i · step
        let step = (hi - lo) / (n - 1) as f64;
        let pts: Vec<f64> = (0..n).map(|i| mel_to_hz(if i == n - 1 { hi } else { lo + i as f64 * step })).collect();
        let nyq = (self.sampling_rate / 2) as f64;
        let fft_freqs: Vec<f64> = (0..bins).map(|i| nyq * i as f64 / (bins - 1) as f64).collect();
        (0..self.feature_size)
            .map(|m| {
                let w: Vec<f64> = fft_freqs
                    .iter()
                    .map(|&f| {
                        let down = (f - pts[m]) / (pts[m + 1] - pts[m]);
                        let up = (pts[m + 2] - f) / (pts[m + 2] - pts[m + 1]);
                        down.min(up).max(0.0)
                    })
                    .collect();
                let first = w.iter().position(|&x| x > 0.0).unwrap_or(0);
                let last = w.iter().rposition(|&x| x > 0.0).map_or(first, |i| i + 1);
                (first, w[first..last.max(first)].to_vec())
            })
            .collect()
    }
}

/// A clip's log-mel features `[frames, 128]` (row-major float32) and which frames are real audio.
#[derive(Clone, Debug, PartialEq)]
pub struct Mel {
    pub frames: usize,
    pub data: Vec<f32>,
    pub mask: Vec<bool>,
    /// The clip's 16 kHz samples (before the 30 s cut): what its token count comes from.
    pub samples: usize,
}

/// In-place radix-2 complex FFT (`re`, `im` of a power-of-two length).
fn fft(re: &mut [f64], im: &mut [f64]) {
    let n = re.len();
    let mut j = 0;
    for i in 1..n {
        let mut bit = n >> 1;
        while j & bit != 0 {
            j ^= bit;
            bit >>= 1;
        }
        j |= bit;
        if i < j {
            re.swap(i, j);
            im.swap(i, j);
        }
    }
    let mut len = 2;
    while len <= n {
        let ang = -2.0 * std::f64::consts::PI / len as f64;
        for start in (0..n).step_by(len) {
            for k in 0..len / 2 {
                let (wr, wi) = ((ang * k as f64).cos(), (ang * k as f64).sin());
                let (a, b) = (start + k, start + k + len / 2);
                let (xr, xi) = (re[b] * wr - im[b] * wi, re[b] * wi + im[b] * wr);
                re[b] = re[a] - xr;
                im[b] = im[a] - xi;
                re[a] += xr;
                im[a] += xi;
            }
        }
        len <<= 1;
    }
}

/// Gemma 4's log-mel features of 16 kHz mono `samples` (mlx-vlm's `Gemma4AudioFeatureExtractor`
/// on one clip).
pub fn log_mel(samples: &[f32], cfg: &FeatureConfig) -> Result<Mel> {
    let total = samples.len();
    let kept = total.min(cfg.max_length);
    let padded = cfg.padded_len(total);
    let pad_left = cfg.frame_length / 2;
    let unfold = cfg.frame_length + 1;
    let len = pad_left + padded;
    let frames = cfg
        .frames(total)
        .ok_or_else(|| Error::Invalid(format!("{total} samples of audio are too short for one feature frame")))?;
    // the padded waveform (scaled), with pad_left zeros in front
    let scale = cfg.input_scale_factor as f32;
    let mut wave = vec![0f32; len];
    for i in 0..padded {
        let x = if i < kept { samples[i] } else { cfg.padding_value };
        wave[pad_left + i] = if cfg.input_scale_factor != 1.0 { x * scale } else { x };
    }
    // periodic Hann window in float32, as numpy makes it (the angle in float32; its cosine
    // correctly rounded, where numpy's SIMD float32 cos may be an ulp off)
    let window: Vec<f32> = (0..cfg.frame_length)
        .map(|n| {
            let a = 2.0f32 * std::f32::consts::PI * n as f32 / cfg.frame_length as f32;
            0.5 - 0.5 * ((a as f64).cos() as f32)
        })
        .collect();
    let filters = cfg.mel_filters();
    let nfft = cfg.fft_length;
    let (mut re, mut im) = (vec![0f64; nfft], vec![0f64; nfft]);
    let mut mag = vec![0f64; nfft / 2 + 1];
    let mut data = Vec::with_capacity(frames * cfg.feature_size);
    let mut mask = Vec::with_capacity(frames);
    let p = cfg.preemphasis as f32;
    for f in 0..frames {
        let x = &wave[f * cfg.hop_length..f * cfg.hop_length + unfold];
        re.iter_mut().for_each(|v| *v = 0.0);
        im.iter_mut().for_each(|v| *v = 0.0);
        for n in 0..cfg.frame_length {
            let v = if cfg.preemphasis > 0.0 {
                if cfg.preemphasis_htk_flavor {
                    if n == 0 {
                        x[0] * (1.0 - p)
                    } else {
                        x[n] - p * x[n - 1]
                    }
                } else {
                    x[n + 1] - p * x[n]
                }
            } else {
                x[n]
            };
            re[n] = (v * window[n]) as f64;
        }
        fft(&mut re, &mut im);
        for (k, m) in mag.iter_mut().enumerate() {
            *m = re[k].hypot(im[k]);
        }
        // a frame is real audio when its last sample (in the unpadded clip) is
        let end = f * cfg.hop_length + unfold - 1;
        let valid = end >= pad_left && end - pad_left < kept;
        mask.push(valid);
        for (m, (first, w)) in filters.iter().enumerate() {
            let mel: f64 = w.iter().zip(&mag[*first..]).map(|(a, b)| a * b).sum();
            let mut v = (mel + cfg.mel_floor).ln();
            if let Some(mean) = &cfg.per_bin_mean {
                v -= mean[m];
            }
            if let Some(sd) = &cfg.per_bin_stddev {
                v /= sd[m];
            }
            data.push(if valid { v as f32 } else { 0.0 });
        }
    }
    Ok(Mel { frames, data, mask, samples: total })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fft_matches_a_direct_dft() {
        let n = 64;
        let x: Vec<f64> = (0..n).map(|i| ((i * 7919) % 13) as f64 - 6.0).collect();
        let (mut re, mut im) = (x.clone(), vec![0.0; n]);
        fft(&mut re, &mut im);
        for k in 0..n {
            let (mut r, mut i) = (0.0, 0.0);
            for (t, v) in x.iter().enumerate() {
                let a = -2.0 * std::f64::consts::PI * (k * t) as f64 / n as f64;
                r += v * a.cos();
                i += v * a.sin();
            }
            assert!((r - re[k]).abs() < 1e-9 && (i - im[k]).abs() < 1e-9, "bin {k}");
        }
    }

    #[test]
    fn other_containers_are_named() {
        let lim = DEFAULT_AUDIO_LIMITS;
        for (bytes, name) in [
            (&b"ID3\x04\0\0\0\0\0\0"[..], "MP3"),
            (b"fLaC\0\0\0\x22", "FLAC"),
            (b"OggS\0\x02", "Ogg"),
            (b"\0\0\0\x20ftypM4A ", "MP4/M4A"),
        ] {
            let e = decode(bytes, &lim, "audio 0").unwrap_err().to_string();
            assert!(e.contains(name) && e.contains("audio 0") && e.contains("WAV"), "{e}");
        }
    }
}
