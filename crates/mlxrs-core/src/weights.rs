//! Model weights: safetensors files (sharded or not), and MLX's quantization config.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Quantization parameters of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
}

/// Tensors by name, with the model's quantization config.
pub struct Weights {
    map: HashMap<String, Array>,
    default_q: Option<QuantSpec>,
    per_layer: HashMap<String, Option<QuantSpec>>,
}

fn parse_spec(v: &Value, fallback: Option<QuantSpec>) -> Option<QuantSpec> {
    let gs = v.get("group_size").and_then(Value::as_i64).map(|x| x as i32);
    let bits = v.get("bits").and_then(Value::as_i64).map(|x| x as i32);
    match (gs, bits, fallback) {
        (Some(g), Some(b), _) => Some(QuantSpec { group_size: g, bits: b }),
        (g, b, Some(f)) => Some(QuantSpec { group_size: g.unwrap_or(f.group_size), bits: b.unwrap_or(f.bits) }),
        (g, b, None) => Some(QuantSpec { group_size: g.unwrap_or(64), bits: b.unwrap_or(4) }),
    }
}

/// Check that a safetensors file is whole before handing it to MLX, which reads tensor data lazily
/// and would otherwise compute with whatever a truncated download left.
fn check_safetensors(path: &Path) -> Result<()> {
    use std::io::Read;
    let bad = |why: String| {
        Error::ModelLoad(format!("{} {why}: the download is incomplete or corrupt; re-download the model", path.display()))
    };
    let mut f = std::fs::File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
    let len = f.metadata().map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| bad(format!("is too short to be a safetensors file ({len} bytes)")))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > 100 << 20 {
        return Err(bad(format!("is not a valid safetensors file (header of {n} bytes in a file of {len})")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|_| bad("has an unreadable header".into()))?;
    let header: Value = serde_json::from_slice(&header).map_err(|e| bad(format!("has an invalid header ({e})")))?;
    let obj = header.as_object().ok_or_else(|| bad("has an invalid header".into()))?;
    let end = obj
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, t)| t.get("data_offsets")?.as_array()?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let need = (8 + n).saturating_add(end);
    if need > len {
        return Err(bad(format!("is truncated ({len} bytes; its header describes {need})")));
    }
    Ok(())
}

impl Weights {
    /// Load every `*.safetensors` of `dir` (the index file, when present, names the shards).
    pub fn load_dir(dir: &Path, config: &Value) -> Result<Weights> {
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<std::path::PathBuf> = Vec::new();
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
            files = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
        }
        if files.is_empty() {
            return Err(Error::ModelLoad(format!(
                "no *.safetensors weights in {}: is this an MLX/Hugging Face model directory?",
                dir.display()
            )));
        }
        let mut map = HashMap::new();
        for f in &files {
            check_safetensors(f)?;
            let (tensors, _meta) = mx::load_safetensors(f)
                .map_err(|e| Error::ModelLoad(format!("{}: {e}", f.display())))?;
            map.extend(tensors);
        }
        Ok(Weights::from_map(map, config))
    }

    pub fn from_map(map: HashMap<String, Array>, config: &Value) -> Weights {
        let q = config.get("quantization").or_else(|| config.get("quantization_config"));
        let default_q = q.and_then(|q| parse_spec(q, None));
        let mut per_layer = HashMap::new();
        if let Some(obj) = q.and_then(Value::as_object) {
            for (k, v) in obj {
                match v {
                    Value::Object(_) => {
                        per_layer.insert(k.clone(), parse_spec(v, default_q));
                    }
                    Value::Bool(false) => {
                        per_layer.insert(k.clone(), None);
                    }
                    _ => {}
                }
            }
        }
        Weights { map, default_q, per_layer }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    pub fn remove(&mut self, name: &str) -> Option<Array> {
        self.map.remove(name)
    }

    pub fn insert(&mut self, name: String, a: Array) {
        self.map.insert(name, a);
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.map.keys()
    }

    /// Drop every tensor whose name matches `pred` (sanitize).
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.map.retain(|k, _| keep(k));
    }

    pub fn take(&mut self, name: &str) -> Result<Array> {
        self.map
            .remove(name)
            .ok_or_else(|| {
                Error::ModelLoad(format!(
                    "weight {name} is missing from the checkpoint: the *.safetensors files are incomplete or do not \
                     match config.json; re-download or re-convert the model"
                ))
            })
    }

    /// Quantization of module `prefix` (present when `{prefix}.scales` exists).
    pub fn quant_of(&self, prefix: &str) -> Option<QuantSpec> {
        if !self.map.contains_key(&format!("{prefix}.scales")) {
            return None;
        }
        match self.per_layer.get(prefix) {
            Some(spec) => *spec,
            None => self.default_q.or(Some(QuantSpec { group_size: 64, bits: 4 })),
        }
    }

    /// Total bytes of the tensors still held.
    pub fn nbytes(&self) -> usize {
        self.map.values().map(Array::nbytes).sum()
    }

    /// Names left over after a model took what it uses.
    pub fn leftover(&self) -> BTreeMap<&String, Vec<i32>> {
        self.map.iter().map(|(k, v)| (k, v.shape())).collect()
    }
}
