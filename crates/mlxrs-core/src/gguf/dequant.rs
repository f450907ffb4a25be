//! Dequantization of ggml block formats to f32, block for block as ggml's `dequantize_row_*`.
//! Layouts: legacy quants hold 32 values per block, k-quants 256 (a super-block of sub-blocks
//! with 6- or 8-bit scales).
use super::reader::GgmlType;
use half::{bf16, f16};

const QK_K: usize = 256;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((qs[j] as u32 & 0x0F) | xh0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] as u32 >> 4) | xh1) as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((qs[j] as u32 & 0x0F) | xh0) as f32 * d + m;
        y[j + 16] = ((qs[j] as u32 >> 4) | xh1) as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
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

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    let mut o = 0;
    for (blk, is) in (0..4).map(|k| (k, 2 * k)) {
        let q = &qs[32 * blk..32 * blk + 32];
        let (sc1, m1) = scale_min_k4(is, scales);
        let (sc2, m2) = scale_min_k4(is + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[o + l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[o + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
        o += 64;
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    let (mut u1, mut u2) = (1u8, 2u8);
    let mut o = 0;
    for blk in 0..4 {
        let ql = &qs[32 * blk..32 * blk + 32];
        let is = 2 * blk;
        let (sc1, m1) = scale_min_k4(is, scales);
        let (sc2, m2) = scale_min_k4(is + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[o + l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[o + 32 + l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
        o += 64;
        u1 <<= 2;
        u2 <<= 2;
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql_all = &b[0..128];
    let qh_all = &b[128..192];
    let sc_all = &b[192..208];
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &ql_all[64 * n..];
        let qh = &qh_all[32 * n..];
        let sc = &sc_all[8 * n..];
        let yo = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            yo[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            yo[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            yo[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            yo[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// A tensor's values as int8 values with one float32 scale, and for the formats with a minimum one
/// float32 bias, per `group` consecutive values ([`crate::handle::BlocksRef`]'s layout, which the CPU
/// decodes from): [`dequantize`] gives `q as f32 · s + b` for each value, bit for bit.
pub struct Blocks {
    pub q: Vec<i8>,
    pub s: Vec<f32>,
    pub b: Option<Vec<f32>>,
    pub group: usize,
}

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

/// `n` values of `ty` as [`Blocks`]; None for the types that are not of that form (the float types,
/// Q2_K and Q3_K: their groups' scales are products of two levels in another order).
pub fn blocks(ty: GgmlType, raw: &[u8], n: usize) -> Result<Option<Blocks>, String> {
    let (group, bias, split): (usize, bool, BlockSplit) = match ty {
        GgmlType::Q4_0 => (32, false, b_q4_0),
        GgmlType::Q4_1 => (32, true, b_q4_1),
        GgmlType::Q5_0 => (32, false, b_q5_0),
        GgmlType::Q5_1 => (32, true, b_q5_1),
        GgmlType::Q8_0 => (32, false, b_q8_0),
        GgmlType::Q4K => (32, true, b_q4_k),
        GgmlType::Q5K => (32, true, b_q5_k),
        GgmlType::Q6K => (16, false, b_q6_k),
        _ => return Ok(None),
    };
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
    let f: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::BF16 => |b, y| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2K => q2_k,
        GgmlType::Q3K => q3_k,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        GgmlType::Other(_) => unreachable!("block() is None"),
    };
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

    /// Every format [`blocks`] takes, over random bytes (scales of every magnitude, NaN and infinity
    /// included): `q · s + b` is [`dequantize`]'s value, bit for bit (NaN where it gives NaN).
    #[test]
    fn blocks_are_the_dequantized_values() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut byte = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 56) as u8
        };
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            let (be, bb) = ty.block().unwrap();
            let n = 3 * be as usize;
            let raw: Vec<u8> = (0..3 * bb as usize).map(|_| byte()).collect();
            let want = dequantize(ty, &raw, n).unwrap();
            let got = blocks(ty, &raw, n).unwrap().expect("a format with blocks");
            assert_eq!((got.q.len(), got.s.len()), (n, n / got.group), "{}", ty.name());
            for (i, w) in want.iter().enumerate() {
                let g = i / got.group;
                let v = got.q[i] as f32 * got.s[g] + got.b.as_ref().map_or(0.0, |b| b[g]);
                assert!(v == *w || (v.is_nan() && w.is_nan()), "{} value {i}: {v} vs {w}", ty.name());
            }
            assert!(blocks(ty, &raw[..raw.len() - 1], n).is_err(), "{}: a short buffer", ty.name());
        }
        assert!(blocks(GgmlType::Q2K, &[0; 84], 256).unwrap().is_none());
        assert!(blocks(GgmlType::F32, &[0; 4], 1).unwrap().is_none());
    }
}
