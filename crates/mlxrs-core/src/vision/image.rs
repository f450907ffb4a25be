//! Image decoding and preprocessing (pure Rust, no MLX): what Hugging Face's image processors do
//! for a SigLIP tower (mlx-vlm runs them): decode (PNG, JPEG, WebP, GIF's first frame), EXIF
//! orientation, to RGB, resize with Pillow's resampling (reproduced here bit for bit: the same
//! coefficients, the same 22-bit fixed point, horizontal pass then vertical, each rounded to 8 bits),
//! rescale and normalize in float32 as numpy does.
use crate::error::{Error, Result};
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};
use std::io::Cursor;

/// What an image may be before it is decoded.
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// Encoded bytes at most.
    pub max_bytes: usize,
    /// Decoded pixels (width × height) at most, checked from the header before decoding.
    pub max_pixels: u64,
}

/// 20 MiB encoded, 50 megapixels decoded.
pub const DEFAULT_LIMITS: ImageLimits = ImageLimits { max_bytes: 20 << 20, max_pixels: 50_000_000 };

impl Default for ImageLimits {
    fn default() -> Self {
        DEFAULT_LIMITS
    }
}

/// An 8-bit RGB image, row-major, 3 bytes a pixel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

fn bad(what: &str, why: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("{what}: {why}"))
}

/// Decode `bytes` (`what` names the input in errors) into RGB: PNG, JPEG, WebP or GIF (its first
/// frame), the EXIF orientation applied, alpha dropped (Pillow's `convert("RGB")`, as mlx-vlm's
/// `load_image` does). The size is read from the header and checked against `limits` before any
/// pixel is decoded.
pub fn decode(bytes: &[u8], limits: &ImageLimits, what: &str) -> Result<Rgb> {
    if bytes.is_empty() {
        return Err(bad(what, "the image is empty"));
    }
    if bytes.len() > limits.max_bytes {
        return Err(bad(
            what,
            format!("the image is {} bytes, more than the limit of {} bytes", bytes.len(), limits.max_bytes),
        ));
    }
    let reader = || -> Result<ImageReader<Cursor<&[u8]>>> {
        let r = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(what, e))?;
        match r.format() {
            Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => Ok(r),
            Some(f) => {
                Err(bad(what, format!("unsupported image format {f:?} (PNG, JPEG, WebP and GIF are supported)")))
            }
            None => Err(bad(what, "not an image mlxrs can read (PNG, JPEG, WebP or GIF)")),
        }
    };
    let (w, h) = reader()?.into_dimensions().map_err(|e| bad(what, format!("cannot read the image header: {e}")))?;
    let pixels = w as u64 * h as u64;
    if pixels == 0 || pixels > limits.max_pixels {
        return Err(bad(
            what,
            format!("the image is {w}x{h} pixels; at most {} pixels are accepted", limits.max_pixels),
        ));
    }
    let mut r = reader()?;
    let mut l = image::Limits::default();
    l.max_image_width = Some(w);
    l.max_image_height = Some(h);
    // the decoded image (up to 16-bit RGBA) plus the decoders' own buffers
    l.max_alloc = Some(pixels * 8 * 2 + (64 << 20));
    r.limits(l);
    let mut dec = r.into_decoder().map_err(|e| bad(what, format!("cannot decode the image: {e}")))?;
    let orientation = dec.orientation().map_err(|e| bad(what, format!("cannot decode the image: {e}")))?;
    let mut img = DynamicImage::from_decoder(dec).map_err(|e| bad(what, format!("cannot decode the image: {e}")))?;
    img.apply_orientation(orientation);
    let rgb = img.to_rgb8();
    Ok(Rgb { width: rgb.width(), height: rgb.height(), data: rgb.into_raw() })
}

/// The (width, height) of an encoded image as [`decode`] would return it (the EXIF orientation
/// applied), from its header alone: what a processor whose token count depends on the image size
/// needs before the prompt is tokenized. The same checks and errors as [`decode`] up to the pixels.
pub fn dimensions(bytes: &[u8], limits: &ImageLimits, what: &str) -> Result<(u32, u32)> {
    if bytes.is_empty() {
        return Err(bad(what, "the image is empty"));
    }
    if bytes.len() > limits.max_bytes {
        return Err(bad(
            what,
            format!("the image is {} bytes, more than the limit of {} bytes", bytes.len(), limits.max_bytes),
        ));
    }
    let r = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(what, e))?;
    match r.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {}
        Some(f) => {
            return Err(bad(what, format!("unsupported image format {f:?} (PNG, JPEG, WebP and GIF are supported)")))
        }
        None => return Err(bad(what, "not an image mlxrs can read (PNG, JPEG, WebP or GIF)")),
    }
    let mut dec = r.into_decoder().map_err(|e| bad(what, format!("cannot read the image header: {e}")))?;
    let (w, h) = dec.dimensions();
    let pixels = w as u64 * h as u64;
    if pixels == 0 || pixels > limits.max_pixels {
        return Err(bad(
            what,
            format!("the image is {w}x{h} pixels; at most {} pixels are accepted", limits.max_pixels),
        ));
    }
    let orientation = dec.orientation().map_err(|e| bad(what, format!("cannot decode the image: {e}")))?;
    use image::metadata::Orientation as O;
    Ok(match orientation {
        O::Rotate90 | O::Rotate270 | O::Rotate90FlipH | O::Rotate270FlipH => (h, w),
        _ => (w, h),
    })
}

/// Pillow's resampling filters (`PIL.Image.Resampling`), by their numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    Nearest,
    Box,
    Bilinear,
    Hamming,
    Bicubic,
    Lanczos,
}

impl Filter {
    /// From a preprocessor_config.json `resample` value (Pillow's enum numbers).
    pub fn from_pil(v: i64) -> Result<Filter> {
        Ok(match v {
            0 => Filter::Nearest,
            1 => Filter::Lanczos,
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            4 => Filter::Box,
            5 => Filter::Hamming,
            _ => {
                return Err(Error::ModelLoad(format!(
                    "preprocessor_config.json: resample = {v} is not a Pillow filter (0-5)"
                )))
            }
        })
    }
    fn support(self) -> f64 {
        match self {
            Filter::Nearest | Filter::Box => 0.5,
            Filter::Bilinear | Filter::Hamming => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }
    fn weight(self, x: f64) -> f64 {
        let sinc = |x: f64| if x == 0.0 { 1.0 } else { (x * std::f64::consts::PI).sin() / (x * std::f64::consts::PI) };
        match self {
            Filter::Nearest => 0.0,
            Filter::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let xp = x * std::f64::consts::PI;
                    xp.sin() / xp * (0.54 + 0.46 * xp.cos())
                }
            }
            Filter::Bicubic => {
                let a = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`: per output index, the first input index,
/// the count, and the fixed-point weights.
fn coeffs(in_size: usize, out_size: usize, f: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = f.support() * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let n = xmax.saturating_sub(xmin);
            let mut k: Vec<f64> = (0..n).map(|x| f.weight((x as f64 + xmin as f64 - center + 0.5) * ss)).collect();
            let ww: f64 = k.iter().sum();
            if ww != 0.0 {
                k.iter_mut().for_each(|v| *v /= ww);
            }
            let one = (1u32 << PRECISION_BITS) as f64;
            let fixed =
                k.iter().map(|&v| if v < 0.0 { (-0.5 + v * one) as i32 } else { (0.5 + v * one) as i32 }).collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(ss: i64) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's `Image.resize((w, h), resample)` of an RGB image (box the whole image, no reducing gap):
/// two separable passes, each rounded to 8 bits. Pillow 13.0 (what mlx-vlm's processor runs here)
/// takes the vertical pass first when the height shrinks by more than twice what the width does
/// (`ih > h && ih - h > 2 (iw - w)`), the horizontal one first otherwise: the rounding between the
/// passes makes the order visible. Found by comparing both orders with Pillow 13.0 on 170 sizes
/// (`tests/test_vision.py` checks it on both sides of the rule).
pub fn resize(src: &Rgb, w: u32, h: u32, f: Filter) -> Rgb {
    if f == Filter::Nearest {
        return resize_nearest(src, w, h);
    }
    let (iw, ih) = (src.width as i64, src.height as i64);
    let vertical_first = ih > h as i64 && ih - h as i64 > 2 * (iw - w as i64);
    if vertical_first {
        let tmp = vertical(src, h, f);
        horizontal(&tmp, w, f)
    } else {
        let tmp = horizontal(src, w, f);
        vertical(&tmp, h, f)
    }
}

/// Pillow's horizontal pass (`ImagingResampleHorizontal_8bpc`) to width `w`; none when equal.
fn horizontal(src: &Rgb, w: u32, f: Filter) -> Rgb {
    let (iw, ih, ow) = (src.width as usize, src.height as usize, w as usize);
    if ow == iw {
        return src.clone();
    }
    let half = 1i64 << (PRECISION_BITS - 1);
    let kk = coeffs(iw, ow, f);
    let mut out = vec![0u8; ih * ow * 3];
    for y in 0..ih {
        let row = &src.data[y * iw * 3..(y + 1) * iw * 3];
        for (x, (xmin, k)) in kk.iter().enumerate() {
            for c in 0..3 {
                let mut ss = half;
                for (i, &kv) in k.iter().enumerate() {
                    ss += row[(xmin + i) * 3 + c] as i64 * kv as i64;
                }
                out[(y * ow + x) * 3 + c] = clip8(ss);
            }
        }
    }
    Rgb { width: w, height: src.height, data: out }
}

/// Pillow's vertical pass (`ImagingResampleVertical_8bpc`) to height `h`; none when equal.
fn vertical(src: &Rgb, h: u32, f: Filter) -> Rgb {
    let (w, ih, oh) = (src.width as usize, src.height as usize, h as usize);
    if oh == ih {
        return src.clone();
    }
    let half = 1i64 << (PRECISION_BITS - 1);
    let kk = coeffs(ih, oh, f);
    let mut out = vec![0u8; oh * w * 3];
    for (y, (ymin, k)) in kk.iter().enumerate() {
        for x in 0..w * 3 {
            let mut ss = half;
            for (i, &kv) in k.iter().enumerate() {
                ss += src.data[(ymin + i) * w * 3 + x] as i64 * kv as i64;
            }
            out[y * w * 3 + x] = clip8(ss);
        }
    }
    Rgb { width: src.width, height: h, data: out }
}

/// Pillow's nearest-neighbour resize (`ImagingTransform` affine with the pixel centres).
fn resize_nearest(src: &Rgb, w: u32, h: u32) -> Rgb {
    let (iw, ih) = (src.width as f64, src.height as f64);
    let (sx, sy) = (iw / w as f64, ih / h as f64);
    let mut data = Vec::with_capacity(w as usize * h as usize * 3);
    for y in 0..h as usize {
        let yi = (((y as f64 + 0.5) * sy) as usize).min(src.height as usize - 1);
        for x in 0..w as usize {
            let xi = (((x as f64 + 0.5) * sx) as usize).min(src.width as usize - 1);
            let o = (yi * src.width as usize + xi) * 3;
            data.extend_from_slice(&src.data[o..o + 3]);
        }
    }
    Rgb { width: w, height: h, data }
}

/// How an image becomes pixel values (a preprocessor_config.json).
#[derive(Clone, Debug, PartialEq)]
pub struct Preprocess {
    /// Output (height, width); None: no resize.
    pub size: Option<(u32, u32)>,
    pub filter: Filter,
    pub rescale: Option<f64>,
    /// Rescale in float32 (`uint8 as float32 * factor`, Gemma 4's processor) rather than in float64
    /// then rounded (Hugging Face's `rescale`).
    pub rescale_f32: bool,
    /// Per-channel mean and std; None: no normalization.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

/// Pixel values `[3, height, width]`, float32, channels first (what the processor returns); or a
/// video's frames, each so.
#[derive(Clone, Debug, PartialEq)]
pub struct Pixels {
    pub height: u32,
    pub width: u32,
    pub data: Vec<f32>,
    /// A video's frames (`data` is `[frames, 3, height, width]`); 0: a still image.
    pub video_frames: u32,
}

impl Preprocess {
    /// Resize to `size` with bicubic resampling, rescale in float32, normalize: the image step of
    /// Gemma 4's and Qwen3.5's processors (an image, or each frame of a video).
    pub fn bicubic_f32(size: (u32, u32), rescale: Option<f64>, normalize: Option<([f32; 3], [f32; 3])>) -> Self {
        Preprocess { size: Some(size), filter: Filter::Bicubic, rescale, rescale_f32: true, normalize }
    }

    /// An encoded image decoded, then [`Preprocess::bicubic_f32`] to the size `size` gives for its
    /// (height, width) (Gemma 4's and Qwen3.5's processors; `what` names the image in errors).
    pub fn bicubic_f32_pixels(
        bytes: &[u8],
        limits: &ImageLimits,
        what: &str,
        size: impl FnOnce(u32, u32) -> Result<(u32, u32)>,
        rescale: Option<f64>,
        normalize: Option<([f32; 3], [f32; 3])>,
    ) -> Result<Pixels> {
        let img = decode(bytes, limits, what)?;
        let size = size(img.height, img.width).map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        Ok(Preprocess::bicubic_f32(size, rescale, normalize).run(&img))
    }

    /// Resize, rescale (`uint8 as float64 * factor`, then float32; or in float32) and normalize (`(x - mean) /
    /// std` in float32), as Hugging Face's image processors do with numpy.
    pub fn run(&self, img: &Rgb) -> Pixels {
        let img = match self.size {
            Some((h, w)) if (h, w) != (img.height, img.width) => resize(img, w, h, self.filter),
            _ => img.clone(),
        };
        let (h, w) = (img.height as usize, img.width as usize);
        let mut data = vec![0f32; 3 * h * w];
        for c in 0..3 {
            for i in 0..h * w {
                let v = img.data[i * 3 + c];
                let mut x = match self.rescale {
                    Some(s) if self.rescale_f32 => v as f32 * s as f32,
                    Some(s) => (v as f64 * s) as f32,
                    None => v as f32,
                };
                if let Some((mean, std)) = &self.normalize {
                    x = (x - mean[c]) / std[c];
                }
                data[c * h * w + i] = x;
            }
        }
        Pixels { height: img.height, width: img.width, data, video_frames: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 7 % 256) as u8, (y * 13 % 256) as u8, ((x + y) % 256) as u8])
        });
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
        out
    }

    #[test]
    fn decodes_and_refuses_with_the_part_named() {
        let p = png(5, 3);
        let img = decode(&p, &DEFAULT_LIMITS, "part 1").unwrap();
        assert_eq!((img.width, img.height, img.data.len()), (5, 3, 45));
        assert_eq!(&img.data[3..6], &[7, 0, 1]);
        let e = decode(&p[..p.len() / 2], &DEFAULT_LIMITS, "messages[0].content[1]").unwrap_err().to_string();
        assert!(e.starts_with("messages[0].content[1]: "), "{e}");
        let e = decode(b"hello world, not an image", &DEFAULT_LIMITS, "x").unwrap_err().to_string();
        assert!(e.contains("not an image"), "{e}");
        let e = decode(&p, &ImageLimits { max_bytes: 10, max_pixels: 100 }, "x").unwrap_err().to_string();
        assert!(e.contains("more than the limit of 10 bytes"), "{e}");
        let e = decode(&p, &ImageLimits { max_bytes: 1 << 20, max_pixels: 14 }, "x").unwrap_err().to_string();
        assert!(e.contains("5x3 pixels"), "{e}");
    }

    /// A PNG header claiming 50000×50000 pixels (a valid IHDR, a little pixel data) is refused from
    /// the header, before anything is decoded or allocated.
    #[test]
    fn a_huge_header_is_refused_before_decoding() {
        fn chunk(kind: &[u8], data: &[u8]) -> Vec<u8> {
            let mut crc = flate2::Crc::new();
            crc.update(kind);
            crc.update(data);
            let mut c = (data.len() as u32).to_be_bytes().to_vec();
            c.extend_from_slice(kind);
            c.extend_from_slice(data);
            c.extend_from_slice(&crc.sum().to_be_bytes());
            c
        }
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&50_000u32.to_be_bytes());
        ihdr.extend_from_slice(&50_000u32.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        let mut p = b"\x89PNG\r\n\x1a\n".to_vec();
        p.extend(chunk(b"IHDR", &ihdr));
        p.extend(chunk(b"IDAT", &[0x78, 0x9c, 0x63, 0x00, 0x00, 0x00, 0x01, 0x00, 0x01]));
        p.extend(chunk(b"IEND", &[]));
        let e = decode(&p, &DEFAULT_LIMITS, "image 1").unwrap_err().to_string();
        assert!(e.contains("image 1: the image is 50000x50000 pixels; at most 50000000"), "{e}");
    }

    #[test]
    fn identity_resize_and_bilinear_weights_sum_to_one() {
        let img = decode(&png(9, 7), &DEFAULT_LIMITS, "x").unwrap();
        assert_eq!(resize(&img, 9, 7, Filter::Bilinear), img);
        for f in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos, Filter::Box, Filter::Hamming] {
            for (i, o) in [(100, 7), (7, 100), (33, 33), (640, 224)] {
                for (_, k) in coeffs(i, o, f) {
                    let s: i64 = k.iter().map(|&v| v as i64).sum();
                    assert!((s - (1 << PRECISION_BITS)).abs() <= k.len() as i64, "{f:?} {i}->{o}: {s}");
                }
            }
        }
    }
}
