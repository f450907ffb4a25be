//! The one validated reader of safetensors headers. Everything that trusts a header (the weight
//! loader before MLX reads the file, the memory planner, the registry through `mlxrs._native`) goes
//! through [`read_header`], which accepts a header only when every tensor it describes lies inside
//! the file, has exactly the bytes its dtype and shape need, and overlaps no other tensor.
use crate::error::{Error, Result};
use crate::handle::Dtype;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The safetensors files of a model directory: the shards `model.safetensors.index.json` names when
/// it is there (each must exist), else every `*.safetensors` of the directory; sorted, never empty.
/// The one answer to "which files hold the weights" (the loader, the planner, the registry).
pub fn model_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    let mut files: Vec<PathBuf> = Vec::new();
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::Io { path: index.clone(), source: e })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::ModelLoad(format!("{}: invalid JSON: {e}", index.display())))?;
        let mut names: Vec<String> = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::ModelLoad(format!("{}: no weight_map", index.display())))?
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        names.sort();
        names.dedup();
        for n in names {
            let p = dir.join(&n);
            if !p.is_file() {
                return Err(Error::ModelLoad(format!(
                    "{} lists shard {n}, which is missing from {}: re-download the model",
                    index.display(),
                    dir.display()
                )));
            }
            files.push(p);
        }
    } else {
        let rd = std::fs::read_dir(dir).map_err(|e| Error::Io { path: dir.to_path_buf(), source: e })?;
        files = rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect();
        files.sort();
    }
    if files.is_empty() {
        return Err(Error::ModelLoad(format!(
            "no *.safetensors weights in {}: is this an MLX/Hugging Face model directory? \
             (a model directory needs config.json and *.safetensors)",
            dir.display()
        )));
    }
    Ok(files)
}

/// A header larger than this is not a model file's (real ones are a few MB at most).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One tensor's entry, checked against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    /// The safetensors dtype name ("F32", "BF16", "U32", ...).
    pub dtype: String,
    pub shape: Vec<i32>,
    /// Offsets into the data section (after the 8-byte length and the JSON header).
    pub begin: u64,
    pub end: u64,
}

impl TensorEntry {
    pub fn nbytes(&self) -> u64 {
        self.end - self.begin
    }
    /// The MLX dtype the entry loads as.
    pub fn mlx_dtype(&self) -> Dtype {
        dtype_of(&self.dtype).expect("validated").0
    }
}

/// A validated header.
#[derive(Clone, Debug)]
pub struct Header {
    pub tensors: Vec<TensorEntry>,
    /// Bytes of the data section (the file's length less the header).
    pub data_len: u64,
}

/// safetensors dtype name → (MLX dtype, bytes per element). Only dtypes MLX loads are known.
pub fn dtype_of(name: &str) -> Option<(Dtype, u64)> {
    Some(match name {
        "BOOL" => (Dtype::Bool, 1),
        "U8" => (Dtype::Uint8, 1),
        // FP8 checkpoints (`quant_method: fp8`): MLX loads the codes as uint8; the architectures whose
        // mlx-lm sanitize dequantizes them do so at load (`weights::dequantize_fp8`)
        "F8_E4M3" => (Dtype::Uint8, 1),
        "I8" => (Dtype::Int8, 1),
        "U16" => (Dtype::Uint16, 2),
        "I16" => (Dtype::Int16, 2),
        "F16" => (Dtype::Float16, 2),
        "BF16" => (Dtype::Bfloat16, 2),
        "U32" => (Dtype::Uint32, 4),
        "I32" => (Dtype::Int32, 4),
        "F32" => (Dtype::Float32, 4),
        "U64" => (Dtype::Uint64, 8),
        "I64" => (Dtype::Int64, 8),
        "F64" => (Dtype::Float64, 8),
        _ => return None,
    })
}

/// The header's top-level entries in file order, duplicates kept (a JSON object with a repeated key
/// is refused: readers disagree on which one wins).
struct Entries(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry::<String, Value>()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Validate a header's JSON against a data section of `data_len` bytes. The error says what is
/// wrong, naming the tensor and the field.
pub fn parse_header(json: &[u8], data_len: u64) -> std::result::Result<Header, String> {
    let Entries(entries) = serde_json::from_slice(json).map_err(|e| format!("has an invalid header ({e})"))?;
    let mut seen = std::collections::HashSet::new();
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, t) in entries {
        if !seen.insert(name.clone()) {
            return Err(format!("lists tensor {name} twice"));
        }
        if name == "__metadata__" {
            // MLX writes null when there is none
            if !(t.is_null() || t.as_object().is_some_and(|m| m.values().all(Value::is_string))) {
                return Err("has a __metadata__ that is neither null nor an object of strings".into());
            }
            continue;
        }
        let bad = |what: String| format!("tensor {name}: {what}");
        let o = t.as_object().ok_or_else(|| bad("the entry is not an object".into()))?;
        let dtype = o.get("dtype").and_then(Value::as_str).ok_or_else(|| bad("dtype is missing".into()))?;
        let (_, size) = dtype_of(dtype).ok_or_else(|| bad(format!("dtype {dtype:?} is not one mlxrs loads")))?;
        let shape: Vec<i32> = o
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("shape is missing".into()))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| i32::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("shape {} is not a list of sizes below 2^31", o["shape"])))?;
        let offs: Vec<u64> = o
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .ok_or_else(|| bad("data_offsets is not [begin, end]".into()))?;
        let (begin, end) = (offs[0], offs[1]);
        if begin > end {
            return Err(bad(format!("data_offsets [{begin}, {end}] begin after they end")));
        }
        if end > data_len {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] run past the data ({data_len} bytes): the file is truncated"
            )));
        }
        let need = shape.iter().try_fold(size, |a, &d| a.checked_mul(d as u64));
        if need != Some(end - begin) {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] hold {} bytes but dtype {dtype} and shape {shape:?} need {}",
                end - begin,
                need.map_or("more than 2^64".into(), |n| n.to_string())
            )));
        }
        tensors.push(TensorEntry { name, dtype: dtype.to_string(), shape, begin, end });
    }
    let mut by_offset: Vec<&TensorEntry> = tensors.iter().filter(|t| t.end > t.begin).collect();
    by_offset.sort_by_key(|t| t.begin);
    for w in by_offset.windows(2) {
        if w[1].begin < w[0].end {
            return Err(format!(
                "tensors {} [{}, {}] and {} [{}, {}] overlap",
                w[0].name, w[0].begin, w[0].end, w[1].name, w[1].begin, w[1].end
            ));
        }
    }
    Ok(Header { tensors, data_len })
}

/// Read and validate the header of the safetensors file at `path`.
pub fn read_header(path: &Path) -> Result<Header> {
    use std::io::Read;
    let bad = |why: String| {
        Error::ModelLoad(format!(
            "{} {why}: the download is incomplete or corrupt; re-download the model",
            path.display()
        ))
    };
    let io = |e| Error::Io { path: path.to_path_buf(), source: e };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| bad(format!("is too short to be a safetensors file ({len} bytes)")))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > MAX_HEADER_BYTES {
        return Err(bad(format!("is not a valid safetensors file (header of {n} bytes in a file of {len})")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|_| bad("has an unreadable header".into()))?;
    parse_header(&header, len - 8 - n).map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn hdr(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn a_consistent_header_is_accepted() {
        assert!(parse_header(&hdr(json!({"__metadata__": null})), 0).unwrap().tensors.is_empty());
        assert!(parse_header(&hdr(json!({"__metadata__": {"a": 1}})), 0).is_err());
        let h = hdr(json!({"__metadata__": {"format": "mlx"},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
            "empty": {"dtype": "F16", "shape": [0], "data_offsets": [32, 32]}}));
        let got = parse_header(&h, 32).unwrap();
        assert_eq!(got.tensors.len(), 3);
        assert_eq!(
            got.tensors[0],
            TensorEntry { name: "a".into(), dtype: "F32".into(), shape: vec![2, 3], begin: 0, end: 24 }
        );
    }

    #[test]
    fn each_disagreement_is_refused_with_the_tensor_and_field() {
        let one = |t: Value, data: u64| parse_header(&hdr(json!({ "w": t })), data).unwrap_err();
        // a begin past the end (the old check looked only at the largest end)
        assert!(one(json!({"dtype": "F32", "shape": [1], "data_offsets": [40, 4]}), 64).contains("begin after"));
        assert!(one(json!({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}), 8).contains("truncated"));
        let e = one(json!({"dtype": "F32", "shape": [8, 2], "data_offsets": [0, 16]}), 64);
        assert!(e.contains("tensor w") && e.contains("need 64"), "{e}");
        assert!(one(json!({"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}), 8).contains("dtype \"Q4\""));
        assert!(one(json!({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}), 8).contains("shape"));
        assert!(one(json!({"dtype": "F32", "shape": [4294967296u64], "data_offsets": [0, 4]}), 8).contains("shape"));
        assert!(one(json!({"dtype": "F32", "shape": [1], "data_offsets": [0]}), 8).contains("data_offsets"));
        let huge =
            one(json!({"dtype": "F64", "shape": [2147483647, 2147483647, 2147483647], "data_offsets": [0, 8]}), 8);
        assert!(huge.contains("more than 2^64"), "{huge}");
        let overlap = hdr(json!({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}));
        assert!(parse_header(&overlap, 16).unwrap_err().contains("overlap"));
        let dup = br#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#;
        assert!(parse_header(dup, 8).unwrap_err().contains("twice"));
        assert!(parse_header(b"[1, 2]", 8).is_err());
    }

    fn entry() -> impl Strategy<Value = (String, String, Vec<u64>, u64, u64)> {
        (
            "[a-c]{1,2}",
            prop::sample::select(vec!["F32", "BF16", "U32", "I8", "Q4", "F64"]),
            prop::collection::vec(prop_oneof![0u64..6, Just(1u64 << 31), Just(u64::MAX)], 0..3),
            prop_oneof![0u64..80, Just(u64::MAX)],
            prop_oneof![0u64..80, Just(u64::MAX)],
        )
            .prop_map(|(n, d, s, b, e)| (n, d.to_string(), s, b, e))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

        /// Arbitrary headers: never a panic, and an accepted header is consistent.
        #[test]
        fn accepted_headers_are_consistent(es in prop::collection::vec(entry(), 0..5), data_len in 0u64..100) {
            let obj: serde_json::Map<String, Value> = es
                .iter()
                .map(|(n, d, s, b, e)| (n.clone(), json!({"dtype": d, "shape": s, "data_offsets": [b, e]})))
                .collect();
            if let Ok(h) = parse_header(&hdr(Value::Object(obj)), data_len) {
                let mut spans = Vec::new();
                for t in &h.tensors {
                    let (_, size) = dtype_of(&t.dtype).unwrap();
                    prop_assert!(t.begin <= t.end && t.end <= data_len);
                    prop_assert_eq!(t.shape.iter().map(|&d| d as u64).product::<u64>() * size, t.end - t.begin);
                    if t.end > t.begin {
                        spans.push((t.begin, t.end));
                    }
                }
                spans.sort();
                prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
            }
        }

        /// Arbitrary bytes as a header: an error, never a panic.
        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200), data_len in 0u64..1000) {
            let _ = parse_header(&bytes, data_len);
        }
    }
}
