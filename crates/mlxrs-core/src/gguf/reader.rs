//! GGUF container reader: header, metadata (every value type, nested arrays), tensor infos,
//! alignment. Every length is checked against the bytes that remain before anything is
//! allocated, so a truncated or mutated file gives an error naming the offset, never a panic or an
//! unbounded allocation.
use std::collections::HashMap;
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const MAX_DIMS: u32 = 8;

/// A parse failure at a byte offset.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufError {
    pub offset: u64,
    pub msg: String,
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GGUF parse error at byte {}: {}", self.offset, self.msg)
    }
}

impl std::error::Error for GgufError {}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            MetaValue::U8(v) => v as u64,
            MetaValue::U16(v) => v as u64,
            MetaValue::U32(v) => v as u64,
            MetaValue::U64(v) => v,
            MetaValue::I8(v) if v >= 0 => v as u64,
            MetaValue::I16(v) if v >= 0 => v as u64,
            MetaValue::I32(v) if v >= 0 => v as u64,
            MetaValue::I64(v) if v >= 0 => v as u64,
            MetaValue::Bool(b) => b as u64,
            _ => return None,
        })
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            MetaValue::I8(v) => Some(v as f64),
            MetaValue::I16(v) => Some(v as f64),
            MetaValue::I32(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => self.as_u64().map(|v| v != 0),
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor types mlxrs can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    /// Any other id: listed, not dequantizable.
    Other(u32),
}

impl GgmlType {
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }
    /// (elements per block, bytes per block).
    pub fn block(self) -> Option<(u64, u64)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2K => (256, 84),
            GgmlType::Q3K => (256, 110),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Other(_) => return None,
        })
    }
    pub fn name(self) -> String {
        match self {
            GgmlType::Other(id) => format!("ggml type {id}"),
            t => format!("{t:?}").replace("K", "_K").to_uppercase(),
        }
    }
    /// Whether the type is a k-quant or legacy block quant (not a float format).
    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }
}

/// One tensor's entry in the header.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order (ne0 fastest); the row-major shape is the reverse.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row-major shape (numpy order).
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
    /// The tensor's size in bytes: None for a type mlxrs cannot read, or a size past u64.
    pub fn nbytes(&self) -> Option<u64> {
        let (be, bb) = self.ty.block()?;
        self.n_elements().div_ceil(be).checked_mul(bb)
    }
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
}

impl GgufHeader {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

struct Parser<R: Read> {
    r: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Parser<R> {
    fn err<T>(&self, msg: impl Into<String>) -> Result<T, GgufError> {
        Err(GgufError { offset: self.pos, msg: msg.into() })
    }

    fn need(&self, n: u64, what: &str) -> Result<(), GgufError> {
        if n > self.len.saturating_sub(self.pos) {
            return self.err(format!(
                "{what} needs {n} bytes but only {} remain (truncated file?)",
                self.len - self.pos.min(self.len)
            ));
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        if let Err(e) = self.r.read_exact(&mut b) {
            return self.err(format!("reading {what}: {e}"));
        }
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        self.need(n, what)?;
        let mut v = vec![0u8; n as usize];
        if let Err(e) = self.r.read_exact(&mut v) {
            return self.err(format!("reading {what}: {e}"));
        }
        let start = self.pos;
        self.pos += n;
        String::from_utf8(v).map_err(|_| GgufError { offset: start, msg: format!("{what} is not valid UTF-8") })
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(self.bytes::<1>("u8")?[0]),
            1 => MetaValue::I8(self.bytes::<1>("i8")?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.bytes::<2>("u16")?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.bytes::<2>("i16")?)),
            4 => MetaValue::U32(self.u32("u32")?),
            5 => MetaValue::I32(i32::from_le_bytes(self.bytes::<4>("i32")?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.bytes::<4>("f32")?)),
            7 => {
                let b = self.bytes::<1>("bool")?[0];
                if b > 1 {
                    return self.err(format!("bool value {b} is neither 0 nor 1"));
                }
                MetaValue::Bool(b == 1)
            }
            8 => MetaValue::Str(self.string("string value")?),
            9 => {
                if depth > 4 {
                    return self.err("arrays nested deeper than 4 levels");
                }
                let ety = self.u32("array element type")?;
                let n = self.u64("array length")?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => return self.err(format!("unknown array element type {ety}")),
                };
                self.need(n.saturating_mul(min), "array elements")?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64("u64")?),
            11 => MetaValue::I64(i64::from_le_bytes(self.bytes::<8>("i64")?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.bytes::<8>("f64")?)),
            other => return self.err(format!("unknown metadata value type {other}")),
        })
    }
}

/// Parse a GGUF header from `r`, whose total length is `len` bytes.
pub fn parse_header<R: Read>(r: R, len: u64) -> Result<GgufHeader, GgufError> {
    let mut p = Parser { r, pos: 0, len };
    let magic = p.bytes::<4>("magic")?;
    if &magic != MAGIC {
        return Err(GgufError { offset: 0, msg: format!("not a GGUF file (magic {magic:?})") });
    }
    let version = p.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError { offset: 4, msg: format!("unsupported GGUF version {version} (2 and 3 are)") });
    }
    let n_tensors = p.u64("tensor count")?;
    let n_kv = p.u64("metadata count")?;
    // each kv needs at least a key length, a type and a value byte; each tensor info at least 28 bytes
    p.need(n_kv.saturating_mul(13), "metadata entries")?;
    p.need(n_tensors.saturating_mul(28), "tensor infos")?;
    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut index = HashMap::new();
    for _ in 0..n_kv {
        let key = p.string("metadata key")?;
        let ty = p.u32("metadata type")?;
        let v = p.value(ty, 0)?;
        index.insert(key.clone(), metadata.len());
        metadata.push((key, v));
    }
    let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return p.err(format!("general.alignment {v:?} is not a power of two")),
        },
        None => 32,
    };
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = p.string("tensor name")?;
        let nd = p.u32("tensor dimension count")?;
        if nd == 0 || nd > MAX_DIMS {
            return p.err(format!("tensor {name} has {nd} dimensions"));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            dims.push(p.u64("tensor dimension")?);
        }
        let ty = GgmlType::from_id(p.u32("tensor type")?);
        let offset = p.u64("tensor offset")?;
        let n: Option<u64> = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if n.is_none() || n == Some(0) {
            return p.err(format!("tensor {name} has invalid dimensions {dims:?}"));
        }
        tensors.push(TensorInfo { name, dims, ty, offset });
    }
    let data_offset = p.pos.div_ceil(alignment) * alignment;
    check_tensors(&tensors, alignment, data_offset, len)?;
    Ok(GgufHeader { version, metadata, index, tensors, alignment, data_offset })
}

/// Every tensor listed once, its offset aligned, its dimensions MLX-sized (below 2^31), whole blocks
/// of its type along the first dimension, its bytes inside the file and overlapping no other's.
fn check_tensors(tensors: &[TensorInfo], alignment: u64, data_offset: u64, len: u64) -> Result<(), GgufError> {
    let err = |t: &TensorInfo, msg: String| GgufError {
        offset: data_offset.saturating_add(t.offset),
        msg: format!("tensor {} {msg}", t.name),
    };
    let mut names = std::collections::HashSet::new();
    let mut spans = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(err(t, "is listed twice".into()));
        }
        if t.offset % alignment != 0 {
            return Err(err(t, format!("has data offset {}, not a multiple of the alignment {alignment}", t.offset)));
        }
        if let Some(d) = t.dims.iter().find(|&&d| d > i32::MAX as u64) {
            return Err(err(t, format!("has a dimension of {d} (at most 2^31 - 1)")));
        }
        let Some((be, bb)) = t.ty.block() else { continue };
        if t.dims[0] % be != 0 {
            return Err(err(
                t,
                format!("has {} values per row, not whole {}-value blocks of {}", t.dims[0], be, t.ty.name()),
            ));
        }
        let nb = t.nbytes();
        let end = nb.and_then(|nb| data_offset.checked_add(t.offset)?.checked_add(nb));
        if end.is_none_or(|e| e > len) {
            let size = match nb {
                Some(nb) => format!("{nb} bytes"),
                None => format!("{} blocks of {bb} bytes", t.n_elements().div_ceil(be)),
            };
            return Err(err(
                t,
                format!("({size} at data offset {}) runs past the end of the file ({len} bytes)", t.offset),
            ));
        }
        spans.push((t.offset, t.offset + nb.unwrap_or(0), t));
    }
    spans.sort_by_key(|s| s.0);
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(err(
                w[1].2,
                format!(
                    "(at data offset {}) overlaps tensor {} (data offsets {}..{})",
                    w[1].0, w[0].2.name, w[0].0, w[0].1
                ),
            ));
        }
    }
    Ok(())
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: GgufHeader,
    file: std::fs::File,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, crate::Error> {
        let file = std::fs::File::open(path).map_err(|e| crate::Error::Io { path: path.to_path_buf(), source: e })?;
        let len = file.metadata().map_err(|e| crate::Error::Io { path: path.to_path_buf(), source: e })?.len();
        let header = parse_header(std::io::BufReader::with_capacity(1 << 20, &file), len)
            .map_err(|e| crate::Error::ModelLoad(format!("{}: {e}", path.display())))?;
        Ok(GgufFile { path: path.to_path_buf(), header, file })
    }

    /// The raw bytes of a tensor.
    pub fn read_raw(&self, t: &TensorInfo) -> Result<Vec<u8>, crate::Error> {
        let nb = t.nbytes().ok_or_else(|| {
            crate::Error::Unsupported(format!("tensor {} has {}, which mlxrs cannot read", t.name, t.ty.name()))
        })?;
        let mut f = &self.file;
        let io = |e| crate::Error::Io { path: self.path.clone(), source: e };
        f.seek(SeekFrom::Start(self.header.data_offset + t.offset)).map_err(io)?;
        let mut buf = vec![0u8; nb as usize];
        f.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small valid GGUF: two metadata entries and three tensors (F32, Q8_0, F16), alignment 32.
    fn sample() -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, t: &str| {
            b.extend((t.len() as u64).to_le_bytes());
            b.extend(t.as_bytes());
        };
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(3u64.to_le_bytes()); // tensors
        b.extend(2u64.to_le_bytes()); // metadata
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "llama.block_count");
        b.extend(4u32.to_le_bytes());
        b.extend(2u32.to_le_bytes());
        // (name, dims, type, offset, bytes)
        let tensors: [(&str, &[u64], u32, u64); 3] = [("a", &[8, 2], 0, 0), ("q", &[64], 8, 64), ("h", &[4], 1, 160)];
        for (name, dims, ty, off) in tensors {
            s(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(off.to_le_bytes());
        }
        let data = b.len().div_ceil(32) * 32;
        b.resize(data + 168, 7); // a: 0..64, q: 64..132 (two 34-byte blocks), h: 160..168
        b
    }

    fn parse(b: &[u8]) -> Result<GgufHeader, GgufError> {
        parse_header(b, b.len() as u64)
    }

    #[test]
    fn the_sample_parses_and_bad_offsets_are_refused() {
        let b = sample();
        let h = parse(&b).unwrap();
        assert_eq!(h.tensors.len(), 3);
        let off_of = |name: &str| {
            let pos = b
                .windows(name.len() + 8)
                .position(|w| w[..8] == (name.len() as u64).to_le_bytes() && &w[8..] == name.as_bytes());
            let pos = pos.unwrap() + 8 + name.len();
            let nd = u32::from_le_bytes(b[pos..pos + 4].try_into().unwrap()) as usize;
            pos + 4 + 8 * nd + 4
        };
        let with = |name: &str, v: u64| {
            let mut m = b.clone();
            let o = off_of(name);
            m[o..o + 8].copy_from_slice(&v.to_le_bytes());
            m
        };
        assert!(parse(&with("q", 65)).unwrap_err().msg.contains("not a multiple of the alignment 32"));
        assert!(parse(&with("q", 32)).unwrap_err().msg.contains("overlaps tensor a"));
        assert!(parse(&with("h", 1 << 40)).unwrap_err().msg.contains("runs past the end"));
        let mut dup = b.clone();
        let o = off_of("h") - 4 - 8 - 4 - 1;
        dup[o] = b'q';
        assert!(parse(&dup).unwrap_err().msg.contains("listed twice"));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// Byte edits and truncations of a valid file: never a panic; an accepted header's tensors
        /// are aligned, inside the file and disjoint.
        #[test]
        fn accepted_headers_are_consistent(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), any::<bool>()), 1..6),
            cut in prop::option::of(any::<prop::sample::Index>()),
        ) {
            let mut b = sample();
            for (i, v, wide) in edits {
                let i = i.index(b.len());
                if wide && i + 8 <= b.len() {
                    b[i..i + 8].copy_from_slice(&(u64::MAX >> (v % 64)).to_le_bytes());
                } else {
                    b[i] = v;
                }
            }
            if let Some(c) = cut {
                b.truncate(c.index(b.len()));
            }
            if let Ok(h) = parse(&b) {
                let mut spans = Vec::new();
                for t in &h.tensors {
                    prop_assert_eq!(t.offset % h.alignment, 0);
                    if let Some(nb) = t.nbytes() {
                        prop_assert!(h.data_offset + t.offset + nb <= b.len() as u64);
                        spans.push((t.offset, t.offset + nb));
                    }
                }
                spans.sort();
                prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
            }
        }
    }
}
