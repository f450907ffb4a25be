//! Model weights: safetensors files (sharded or not), and MLX's quantization config.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array};
use crate::safetensors;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use crate::models::experts::{Streaming, TensorLoc};

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
    /// Where each tensor of the safetensors files is (from their validated headers); empty for
    /// weights that did not come from files (a GGUF import).
    locations: HashMap<String, TensorLoc>,
    /// Set by [`Weights::stream_experts`]: MoE layers leave their experts in the files.
    streaming: Option<Arc<Streaming>>,
    /// LoRA/DoRA adapters the linears load with (`crate::lora`).
    lora: Option<Arc<crate::lora::Registry>>,
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

/// A weight matrix `[out, in]` as stored: dense, or MLX-quantized (packed uint32 values, with a
/// scale and an optional bias per group of `q.group_size` inputs).
pub enum Matrix {
    Dense(Array),
    Quant { w: Array, scales: Array, biases: Option<Array>, q: QuantSpec },
}

/// Bit widths and group sizes of MLX's affine quantization.
const QUANT_BITS: &[i32] = &[2, 3, 4, 5, 6, 8];
const QUANT_GROUPS: &[i32] = &[32, 64, 128];

fn shape_error(name: &str, got: &[i32], want: &str) -> Error {
    Error::ModelLoad(format!(
        "weight {name} has shape {got:?} but config.json implies {want}: the checkpoint does not match config.json; \
         re-download or re-convert the model"
    ))
}

/// Load one safetensors file through MLX, after its header passed [`safetensors::read_header`], and
/// check that MLX read what the header says (names, dtypes, shapes).
fn load_file(path: &Path, locations: &mut HashMap<String, TensorLoc>) -> Result<HashMap<String, Array>> {
    let header = safetensors::read_header(path)?;
    let file = std::fs::File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
    let len = file.metadata().map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?.len();
    let (file, shared_path) = (Arc::new(file), Arc::new(path.to_path_buf()));
    for t in &header.tensors {
        let loc = TensorLoc { file: file.clone(), path: shared_path.clone(), data_start: len - header.data_len, entry: t.clone() };
        locations.insert(t.name.clone(), loc);
    }
    let (tensors, _meta) = mx::load_safetensors(path).map_err(|e| Error::ModelLoad(format!("{}: {e}", path.display())))?;
    let disagree = |what: String| Error::ModelLoad(format!("{}: MLX read {what}: the file is corrupt; re-download the model", path.display()));
    if tensors.len() != header.tensors.len() {
        return Err(disagree(format!("{} tensors where the header lists {}", tensors.len(), header.tensors.len())));
    }
    for t in &header.tensors {
        let a = tensors.get(&t.name).ok_or_else(|| disagree(format!("no tensor {}", t.name)))?;
        if a.shape() != t.shape || a.dtype() != t.mlx_dtype() {
            return Err(disagree(format!("tensor {} as {:?} {:?} (the header: {} {:?})", t.name, a.dtype(), a.shape(), t.dtype, t.shape)));
        }
    }
    Ok(tensors.into_iter().collect())
}

impl Weights {
    /// Load every `*.safetensors` of `dir` (the index file, when present, names the shards).
    pub fn load_dir(dir: &Path, config: &Value) -> Result<Weights> {
        let files = crate::safetensors::model_files(dir)?;
        let mut map = HashMap::new();
        let mut locations = HashMap::new();
        for f in &files {
            map.extend(load_file(f, &mut locations)?);
        }
        let mut w = Weights::from_map(map, config);
        w.locations = locations;
        Ok(w)
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
        Weights { map, default_q, per_layer, locations: HashMap::new(), streaming: None, lora: None }
    }

    /// Open the weights for streaming: MoE layers built from them leave their experts in the
    /// files, read on demand into `ctx`'s cache (`models::experts`).
    pub fn stream_experts(&mut self, ctx: Arc<Streaming>) {
        self.streaming = Some(ctx);
    }

    /// Load the linears with these adapters ([`crate::lora::Registry::apply`]).
    pub fn set_lora(&mut self, reg: Arc<crate::lora::Registry>) {
        self.lora = Some(reg);
    }

    pub fn lora(&self) -> Option<&Arc<crate::lora::Registry>> {
        self.lora.as_ref()
    }

    pub fn streaming(&self) -> Option<Arc<Streaming>> {
        self.streaming.clone()
    }

    /// Where tensor `name` is in the safetensors files (None: not from a file).
    pub fn location(&self, name: &str) -> Option<&TensorLoc> {
        self.locations.get(name)
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

    /// Rename a tensor (sanitize), keeping where it is in the files (a streamed expert is read from
    /// there by its new name). Nothing happens when `from` is not there.
    pub fn rename(&mut self, from: &str, to: String) {
        if let Some(a) = self.map.remove(from) {
            if let Some(l) = self.locations.remove(from) {
                self.locations.insert(to.clone(), l);
            }
            self.map.insert(to, a);
        }
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

    /// Take a float tensor whose shape must be `want`.
    pub fn take_shaped(&mut self, name: &str, want: &[i32]) -> Result<Array> {
        let a = self.take(name)?;
        if a.shape() != want {
            return Err(shape_error(name, &a.shape(), &format!("{want:?}")));
        }
        if !a.dtype().is_float() {
            return Err(Error::ModelLoad(format!("weight {name} is {}, not a float type: re-convert the model", a.dtype().name())));
        }
        Ok(a)
    }

    /// The rows of `{prefix}.weight` as stored (None when it is missing or not 2-D).
    /// Rename the modules of the config's per-layer quantization entries as `f` says (None: keep):
    /// for a sanitize that renames the tensors of those modules.
    pub fn rename_quant_modules(&mut self, f: impl Fn(&str) -> Option<String>) {
        let old = std::mem::take(&mut self.per_layer);
        self.per_layer = old.into_iter().map(|(k, v)| (f(&k).unwrap_or(k), v)).collect();
    }

    /// The shape of tensor `name`, when present.
    pub fn shape_of(&self, name: &str) -> Option<Vec<i32>> {
        self.map.get(name).map(Array::shape)
    }

    pub fn rows_of(&self, prefix: &str) -> Option<i32> {
        let s = self.map.get(&format!("{prefix}.weight"))?.shape();
        (s.len() == 2).then_some(s[0])
    }

    /// Take the `[out, inp]` matrix of module `prefix`, dense or quantized, every part's shape and
    /// dtype checked (and the quantization's bits and group size) before it is used.
    pub fn take_matrix(&mut self, prefix: &str, out: i32, inp: i32) -> Result<Matrix> {
        let name = format!("{prefix}.weight");
        let Some(q) = self.quant_of(prefix) else {
            return Ok(Matrix::Dense(self.take_shaped(&name, &[out, inp])?));
        };
        if !QUANT_BITS.contains(&q.bits) || !QUANT_GROUPS.contains(&q.group_size) || inp % q.group_size != 0 {
            return Err(Error::ModelLoad(format!(
                "{prefix}: quantization bits {} / group_size {} do not fit its {inp} inputs (bits: {QUANT_BITS:?}, \
                 group_size: {QUANT_GROUPS:?} dividing the inputs): config.json's quantization is wrong",
                q.bits, q.group_size
            )));
        }
        let w = self.take(&name)?;
        let packed = [out, inp / 32 * q.bits];
        if w.shape() != packed || w.dtype() != crate::handle::Dtype::Uint32 {
            return Err(shape_error(&name, &w.shape(), &format!("uint32 {packed:?} ({}-bit quantized [{out}, {inp}])", q.bits)));
        }
        let groups = [out, inp / q.group_size];
        let scales = self.take_shaped(&format!("{prefix}.scales"), &groups)?;
        let bname = format!("{prefix}.biases");
        let biases = if self.contains(&bname) { Some(self.take_shaped(&bname, &groups)?) } else { None };
        Ok(Matrix::Quant { w, scales, biases, q })
    }

    /// Take the `[experts, out, inp]` stacked expert matrices of module `prefix` (mlx-lm's
    /// `SwitchLinear`), dense or quantized, every part's shape checked as [`Weights::take_matrix`]
    /// does: a checkpoint with another expert count or width is refused naming the tensor.
    pub fn take_experts(&mut self, prefix: &str, experts: i32, out: i32, inp: i32) -> Result<Matrix> {
        let name = format!("{prefix}.weight");
        let Some(q) = self.quant_of(prefix) else {
            return Ok(Matrix::Dense(self.take_shaped(&name, &[experts, out, inp])?));
        };
        if !QUANT_BITS.contains(&q.bits) || !QUANT_GROUPS.contains(&q.group_size) || inp % q.group_size != 0 {
            return Err(Error::ModelLoad(format!(
                "{prefix}: quantization bits {} / group_size {} do not fit its {inp} inputs: config.json's quantization is wrong",
                q.bits, q.group_size
            )));
        }
        let w = self.take(&name)?;
        let packed = [experts, out, inp / 32 * q.bits];
        if w.shape() != packed || w.dtype() != crate::handle::Dtype::Uint32 {
            return Err(shape_error(&name, &w.shape(), &format!("uint32 {packed:?} ({}-bit quantized [{experts}, {out}, {inp}])", q.bits)));
        }
        let groups = [experts, out, inp / q.group_size];
        let scales = self.take_shaped(&format!("{prefix}.scales"), &groups)?;
        let bname = format!("{prefix}.biases");
        let biases = if self.contains(&bname) { Some(self.take_shaped(&bname, &groups)?) } else { None };
        Ok(Matrix::Quant { w, scales, biases, q })
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
}
