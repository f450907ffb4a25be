//! Dequantization of ggml block formats to f32, block for block as ggml's `dequantize_row_*`.
//! Layouts: legacy quants hold 32 values per block, k-quants 256 (a super-block of sub-blocks
//! with 6- or 8-bit scales).
use super::reader::GgmlType;
use half::{bf16, f16};

const QK_K: usize = 256;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    let mut o = 0;
    for n in (0..QK_K).step_by(128) {
        let q = &qs[n / 4..];
        let mut shift = 0;
        for _ in 0..4 {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 0..16 {
                    y[o] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    o += 1;
                }
            }
            shift += 2;
        }
    }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let qs = &b[32..96];
    let sc_raw = &b[96..108];
    let d_all = f16_at(b, 108);
    let mut aux = [0u32; 4];
    for (i, a) in aux.iter_mut().take(3).enumerate() {
        *a = u32::from_le_bytes([sc_raw[4 * i], sc_raw[4 * i + 1], sc_raw[4 * i + 2], sc_raw[4 * i + 3]]);
    }
    const KM1: u32 = 0x0303_0303;
    const KM2: u32 = 0x0f0f_0f0f;
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KM2) | (((tmp >> 4) & KM1) << 4);
    aux[3] = ((aux[1] >> 4) & KM2) | (((tmp >> 6) & KM1) << 4);
    aux[0] = (aux[0] & KM2) | ((tmp & KM1) << 4);
    aux[1] = (aux[1] & KM2) | (((tmp >> 2) & KM1) << 4);
    let mut scales = [0i8; 16];
    for i in 0..4 {
        for (k, byte) in aux[i].to_le_bytes().iter().enumerate() {
            scales[4 * i + k] = *byte as i8;
        }
    }
    let mut is = 0;
    let mut m: u8 = 1;
    let mut o = 0;
    for n in (0..QK_K).step_by(128) {
        let q = &qs[n / 4..];
        let mut shift = 0;
        for _ in 0..4 {
            for half in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let li = l + 16 * half;
                    let v = ((q[li] >> shift) & 3) as i32 - if hm[li] & m != 0 { 0 } else { 4 };
                    y[o] = dl * v as f32;
                    o += 1;
                }
            }
            shift += 2;
            m <<= 1;
        }
    }
}

fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// A tensor's values as int8 values with one float32 scale, and for the formats with a minimum one
/// float32 bias, per `group` consecutive values ([`crate::handle::BlocksRef`]'s layout, which the CPU
/// decodes from): [`dequantize`] gives `q as f32 · s`, plus `b` where there are biases, for each value.
pub struct Blocks {
    pub q: Vec<i8>,
    pub s: Vec<f32>,
    pub b: Option<Vec<f32>>,
    pub group: usize,
}

/// One ggml block dequantized into `y` (the formats that are not [`Blocks`]).
type Dequant = fn(&[u8], &mut [f32]);

/// One ggml block as [`Blocks`]: its values into `q`, a scale per group into `s` and a bias into `m`.
type BlockSplit = fn(&[u8], &mut [i8], &mut [f32], &mut [f32]);

fn b_q4_0(b: &[u8], q: &mut [i8], s: &mut [f32], _: &mut [f32]) {
    s[0] = f16_at(b, 0);
    for j in 0..16 {
        q[j] = (b[2 + j] & 0x0F) as i8 - 8;
        q[j + 16] = (b[2 + j] >> 4) as i8 - 8;
    }
}

fn b_q4_1(b: &[u8], q: &mut [i8], s: &mut [f32], m: &mut [f32]) {
    (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        q[j] = (b[4 + j] & 0x0F) as i8;
        q[j + 16] = (b[4 + j] >> 4) as i8;
    }
}

fn b_q5_0(b: &[u8], q: &mut [i8], s: &mut [f32], _: &mut [f32]) {
    s[0] = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        q[j] = ((b[6 + j] as u32 & 0x0F) | xh0) as i8 - 16;
        q[j + 16] = ((b[6 + j] as u32 >> 4) | xh1) as i8 - 16;
    }
}

fn b_q5_1(b: &[u8], q: &mut [i8], s: &mut [f32], m: &mut [f32]) {
    (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        q[j] = ((b[8 + j] as u32 & 0x0F) | xh0) as i8;
        q[j + 16] = ((b[8 + j] as u32 >> 4) | xh1) as i8;
    }
}

fn b_q8_0(b: &[u8], q: &mut [i8], s: &mut [f32], _: &mut [f32]) {
    s[0] = f16_at(b, 0);
    for j in 0..32 {
        q[j] = b[2 + j] as i8;
    }
}

/// Q4_K and Q5_K (`high`: the fifth bits): eight groups of 32, each `d·sc · q − dmin·m`.
fn k_quant_4_5(b: &[u8], q: &mut [i8], s: &mut [f32], m: &mut [f32], high: bool) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = if high { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
    for blk in 0..4 {
        let ql = &qs[32 * blk..32 * blk + 32];
        for half in 0..2 {
            let (sc, mn) = scale_min_k4(2 * blk + half, scales);
            s[2 * blk + half] = d * sc as f32;
            m[2 * blk + half] = -(dmin * mn as f32);
            let bit = 1u8 << (2 * blk + half);
            for l in 0..32 {
                let low = if half == 0 { ql[l] & 0x0F } else { ql[l] >> 4 };
                let h = if high && qh[l] & bit != 0 { 16 } else { 0 };
                q[64 * blk + 32 * half + l] = (low + h) as i8;
            }
        }
    }
}

fn b_q4_k(b: &[u8], q: &mut [i8], s: &mut [f32], m: &mut [f32]) {
    k_quant_4_5(b, q, s, m, false)
}

fn b_q5_k(b: &[u8], q: &mut [i8], s: &mut [f32], m: &mut [f32]) {
    k_quant_4_5(b, q, s, m, true)
}

/// Q6_K: sixteen groups of 16, each `d·sc · (q − 32)`.
fn b_q6_k(b: &[u8], q: &mut [i8], s: &mut [f32], _: &mut [f32]) {
    let d = f16_at(b, 208);
    for (g, &sc) in b[192..208].iter().enumerate() {
        s[g] = d * (sc as i8) as f32;
    }
    for n in 0..2 {
        let ql = &b[64 * n..];
        let qh = &b[128 + 32 * n..];
        let qo = &mut q[128 * n..128 * n + 128];
        for l in 0..32 {
            qo[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            qo[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            qo[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            qo[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
}

/// The formats that are [`Blocks`]: values per group, whether groups have a bias, and the split of one
/// ggml block. [`dequantize`] computes these formats from the same split, so the two agree by
/// construction (and tests/test_gguf.py checks the values against llama.cpp's gguf-py).
fn block_form(ty: GgmlType) -> Option<(usize, bool, BlockSplit)> {
    Some(match ty {
        GgmlType::Q4_0 => (32, false, b_q4_0),
        GgmlType::Q4_1 => (32, true, b_q4_1),
        GgmlType::Q5_0 => (32, false, b_q5_0),
        GgmlType::Q5_1 => (32, true, b_q5_1),
        GgmlType::Q8_0 => (32, false, b_q8_0),
        GgmlType::Q4K => (32, true, b_q4_k),
        GgmlType::Q5K => (32, true, b_q5_k),
        GgmlType::Q6K => (16, false, b_q6_k),
        _ => return None,
    })
}

/// A format's [`Blocks`] layout: values per group and whether groups have a bias; None for the types
/// that are not of that form.
pub fn block_layout(ty: GgmlType) -> Option<(usize, bool)> {
    block_form(ty).map(|(group, bias, _)| (group, bias))
}

/// One ggml block of a [`block_form`] format dequantized: `q · s` per value, `+ b` where the format
/// has biases (not `+ 0`: a product of −0 stays −0, as in ggml).
fn from_blocks<const BE: usize>(group: usize, bias: bool, split: BlockSplit, b: &[u8], y: &mut [f32]) {
    let (mut q, mut s, mut m) = ([0i8; BE], [0f32; 16], [0f32; 16]);
    let g = BE / group;
    split(b, &mut q, &mut s[..g], &mut m[..g]);
    for (i, v) in y.iter_mut().enumerate() {
        let p = q[i] as f32 * s[i / group];
        *v = if bias { p + m[i / group] } else { p };
    }
}

/// `n` values of `ty` as [`Blocks`]; None for the types that are not of that form (the float types,
/// Q2_K and Q3_K: their groups' scales are products of two levels in another order).
pub fn blocks(ty: GgmlType, raw: &[u8], n: usize) -> Result<Option<Blocks>, String> {
    let Some((group, bias, split)) = block_form(ty) else { return Ok(None) };
    let (be, bb) = ty.block().ok_or_else(|| format!("{} has no blocks", ty.name()))?;
    let (be, bb) = (be as usize, bb as usize);
    if !n.is_multiple_of(be) || raw.len() < n / be * bb {
        return Err(format!("{} bytes cannot hold {n} values of {} in whole blocks", raw.len(), ty.name()));
    }
    let (mut q, mut s) = (vec![0i8; n], vec![0f32; n / group]);
    let mut m = vec![0f32; if bias { n / group } else { 0 }];
    let gb = be / group; // groups per ggml block
    let mut none = [0f32; 16];
    for (k, b) in raw[..n / be * bb].chunks_exact(bb).enumerate() {
        let mk = if bias { &mut m[k * gb..(k + 1) * gb] } else { &mut none[..gb] };
        split(b, &mut q[k * be..(k + 1) * be], &mut s[k * gb..(k + 1) * gb], mk);
    }
    Ok(Some(Blocks { q, s, b: bias.then_some(m), group }))
}

/// Dequantize `n` values of type `ty` from `raw` into f32 (in parallel over blocks).
pub fn dequantize(ty: GgmlType, raw: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let (be, bb) = ty.block().ok_or_else(|| format!("cannot dequantize {}", ty.name()))?;
    let (be, bb) = (be as usize, bb as usize);
    let blocks = n.div_ceil(be);
    if raw.len() < blocks * bb {
        return Err(format!("{} bytes cannot hold {n} values of {}", raw.len(), ty.name()));
    }
    let mut out = vec![0f32; blocks * be];
    let direct: Option<Dequant> = match ty {
        GgmlType::F32 => Some(|b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => Some(|b, y| y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::BF16 => Some(|b, y| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q2K => Some(q2_k),
        GgmlType::Q3K => Some(q3_k),
        _ => None,
    };
    let form = block_form(ty);
    let f = |b: &[u8], y: &mut [f32]| match (direct, form) {
        (Some(f), _) => f(b, y),
        (None, Some((group, bias, split))) if be == 32 => from_blocks::<32>(group, bias, split, b, y),
        (None, Some((group, bias, split))) => from_blocks::<QK_K>(group, bias, split, b, y),
        (None, None) => unreachable!("block() is None"),
    };
    let f = &f;
    let threads = crate::handle::host_threads();
    let per = blocks.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (ci, chunk) in out.chunks_mut(per * be).enumerate() {
            let start = ci * per;
            s.spawn(move || {
                for (k, y) in chunk.chunks_mut(be).enumerate() {
                    let b = &raw[(start + k) * bb..(start + k + 1) * bb];
                    f(b, y);
                }
            });
        }
    });
    out.truncate(n);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format [`blocks`] takes, over random bytes: one scale (and bias, for the formats with a
    /// minimum) per group, the int8 values inside the format's range, and the shape refused where the
    /// bytes are short. (That the values are right — [`dequantize`] computes these formats from the
    /// same split — is tests/test_gguf.py's check against llama.cpp's gguf-py, type by type.)
    #[test]
    fn blocks_hold_each_formats_values() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut byte = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 56) as u8
        };
        for (ty, group, bias, lo, hi) in [
            (GgmlType::Q4_0, 32, false, -8, 7),
            (GgmlType::Q4_1, 32, true, 0, 15),
            (GgmlType::Q5_0, 32, false, -16, 15),
            (GgmlType::Q5_1, 32, true, 0, 31),
            (GgmlType::Q8_0, 32, false, -128, 127),
            (GgmlType::Q4K, 32, true, 0, 15),
            (GgmlType::Q5K, 32, true, 0, 31),
            (GgmlType::Q6K, 16, false, -32, 31),
        ] {
            let (be, bb) = ty.block().unwrap();
            let n = 64 * be as usize;
            let raw: Vec<u8> = (0..64 * bb as usize).map(|_| byte()).collect();
            let got = blocks(ty, &raw, n).unwrap().expect("a format with blocks");
            assert_eq!((got.group, got.b.is_some()), (group, bias), "{}", ty.name());
            assert_eq!((got.q.len(), got.s.len()), (n, n / group), "{}", ty.name());
            assert!(got.b.as_ref().is_none_or(|b| b.len() == n / group), "{}", ty.name());
            let (min, max) = (got.q.iter().min().copied().unwrap(), got.q.iter().max().copied().unwrap());
            assert!(lo <= min && max <= hi, "{}: values {min}..={max} outside {lo}..={hi}", ty.name());
            // random bytes reach both ends of the range
            assert!(min == lo && max == hi, "{}: values {min}..={max}, not all of {lo}..={hi}", ty.name());
            assert!(blocks(ty, &raw[..raw.len() - 1], n).is_err(), "{}: a short buffer", ty.name());
        }
        assert!(blocks(GgmlType::Q2K, &[0; 84], 256).unwrap().is_none());
        assert!(blocks(GgmlType::F32, &[0; 4], 1).unwrap().is_none());
    }
}
