//! Model weights: safetensors files (sharded or not), and MLX's quantization config.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype, QuantMode};
use crate::models::experts::{Streaming, TensorLoc};
use crate::safetensors;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// Quantization parameters of one layer: MLX's group size, bits and mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

impl QuantSpec {
    pub fn affine(group_size: i32, bits: i32) -> QuantSpec {
        QuantSpec { group_size, bits, mode: QuantMode::Affine }
    }
}

/// A config's quantization entry: `mode` (default affine, as mlx-lm's `to_quantized`), `group_size`
/// and `bits` (default: the mode's). `field` names the entry in errors.
fn parse_spec(v: &Value, field: &str) -> Result<QuantSpec> {
    let mode = match v.get("mode") {
        None | Some(Value::Null) => QuantMode::Affine,
        Some(m) => m.as_str().and_then(QuantMode::parse).ok_or_else(|| {
            let names: Vec<&str> = QuantMode::ALL.iter().map(|m| m.name()).collect();
            Error::ModelLoad(format!(
                "config.json: {field}.mode = {m} is not a quantization mode MLX supports ({names:?})"
            ))
        })?,
    };
    let (dg, db) = mode.defaults();
    let int = |k: &str, d: i32| -> Result<i32> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(x) => x
                .as_i64()
                .and_then(|x| i32::try_from(x).ok())
                .ok_or_else(|| Error::ModelLoad(format!("config.json: {field}.{k} = {x} is not an integer"))),
        }
    };
    Ok(QuantSpec { group_size: int("group_size", dg)?, bits: int("bits", db)?, mode })
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

/// The `quantization_config` of an FP8 checkpoint (`quant_method: fp8`), None for any other.
fn fp8_config(q: &Value) -> Option<&Value> {
    (q.get("quant_method").and_then(Value::as_str) == Some("fp8")).then_some(q)
}

/// The FP8 block `(rows, cols)` of `config` (its `quantization_config`, or its `text_config`'s):
/// None when the checkpoint is not FP8; `weight_block_size` [128, 128] when it does not say (the
/// size mlx-lm assumes). Power-of-two (`ue8m0`) scales over 32×32 blocks, which mlx-lm keeps packed
/// as mxfp8, are refused.
pub fn fp8_block(config: &Value) -> Result<Option<(i32, i32)>> {
    let text = config.get("text_config").filter(|t| t.is_object());
    let Some(q) = config
        .get("quantization_config")
        .or_else(|| text.and_then(|t| t.get("quantization_config")))
        .and_then(fp8_config)
    else {
        return Ok(None);
    };
    if q.get("scale_fmt").and_then(Value::as_str) == Some("ue8m0") {
        return Err(Error::Unsupported(
            "config.json: quantization_config.scale_fmt \"ue8m0\" (an mxfp8 checkpoint) is not supported; convert it with mlx_lm.convert".into(),
        ));
    }
    let Some(b) = q.get("weight_block_size").filter(|b| !b.is_null()) else { return Ok(Some((128, 128))) };
    match b.as_array().map(|a| a.iter().map(Value::as_i64).collect::<Vec<_>>()).as_deref() {
        Some([Some(r), Some(c)]) if (1..=1 << 16).contains(r) && (1..=1 << 16).contains(c) => {
            Ok(Some((*r as i32, *c as i32)))
        }
        _ => Err(Error::ModelLoad(format!(
            "config.json: quantization_config.weight_block_size = {b} is not [rows, cols] of positive sizes"
        ))),
    }
}

/// mlx-lm's FP8 dequantization at load (the sanitize of deepseek_v3, deepseek_v32 / glm_moe_dsa,
/// mistral4, ministral3): every `{name}_scale_inv` is taken with its `{name}` (e4m3 codes, loaded as
/// uint8), which becomes `from_fp8(codes) × scale` in bfloat16 — the scale one per `block` tile of
/// the matrix (`[ceil(rows / block.0), ceil(cols / block.1)]`), or one that broadcasts over it (per
/// tensor, per expert); `activation_scale`s (static input scales) are dropped. A weight left in
/// FP8 without its scale, a scale without its weight, or a scale of another shape is refused
/// naming the tensor. Does nothing for a checkpoint whose config is not FP8.
pub fn dequantize_fp8(config: &Value, w: &mut Weights) -> Result<()> {
    let Some(block) = fp8_block(config)? else { return Ok(()) };
    w.retain(|k| !k.ends_with("activation_scale"));
    let mut scales: Vec<String> = w.keys().filter(|k| k.ends_with("_scale_inv")).cloned().collect();
    scales.sort();
    if w.streaming().is_some() && !scales.is_empty() {
        return Err(Error::Unsupported(
            "an FP8 checkpoint with streamed experts (dequantize it with mlx_lm.convert first)".into(),
        ));
    }
    for sk in scales {
        let wk = sk.replacen("_scale_inv", "", 1);
        let codes = w.remove(&wk).ok_or_else(|| {
            Error::ModelLoad(format!("weight {sk} has no {wk} to scale: the checkpoint is incomplete"))
        })?;
        let scale = w.take(&sk)?;
        if codes.dtype() != mx::Dtype::Uint8 {
            return Err(Error::ModelLoad(format!(
                "weight {wk} is {:?}, not FP8 (F8_E4M3), yet has a {sk}",
                codes.dtype()
            )));
        }
        w.insert(wk.clone(), fp8_dequantize(&wk, &codes, &scale, block)?);
    }
    if let Some(k) = w.first_fp8() {
        return Err(Error::ModelLoad(format!(
            "weight {k} is FP8 (F8_E4M3) but the checkpoint has no {k}_scale_inv for it"
        )));
    }
    Ok(())
}

impl Weights {
    /// The first (by name) tensor still holding FP8 codes (uint8) after sanitize, if any.
    pub fn first_fp8(&self) -> Option<String> {
        self.map.iter().filter(|(_, a)| a.dtype() == mx::Dtype::Uint8).map(|(k, _)| k.clone()).min()
    }
}

/// One FP8 weight `codes` (`[.., rows, cols]` uint8) times its `scale_inv` (see [`dequantize_fp8`]).
fn fp8_dequantize(name: &str, codes: &Array, scale: &Array, (br, bc): (i32, i32)) -> Result<Array> {
    let bf16 = mx::Dtype::Bfloat16;
    let x = mx::from_fp8(codes, bf16)?;
    let (ws, ss) = (codes.shape(), scale.shape());
    let broadcasts = ss.len() <= ws.len() && ss.iter().rev().zip(ws.iter().rev()).all(|(s, w)| *s == 1 || s == w);
    if broadcasts {
        return mx::astype(&mx::multiply(&x, scale)?, bf16);
    }
    let (m, n) = match ws[..] {
        [m, n] => (m, n),
        _ => return Err(Error::ModelLoad(format!("weight {name}_scale_inv has shape {ss:?}: neither blocks of the matrix nor broadcasting over {name} {ws:?}"))),
    };
    let (rb, cb) = ((m + br - 1) / br, (n + bc - 1) / bc);
    if ss != [rb, cb] {
        return Err(Error::ModelLoad(format!(
            "weight {name}_scale_inv has shape {ss:?} but {name} {ws:?} in blocks of [{br}, {bc}] (quantization_config.weight_block_size) needs [{rb}, {cb}]"
        )));
    }
    let (pm, pn) = (rb * br - m, cb * bc - n);
    let x = if pm > 0 || pn > 0 { mx::pad(&x, &[0, 1], &[0, 0], &[pm, pn], &mx::scalar_as(0.0, bf16)?)? } else { x };
    let x = mx::reshape(&x, &[rb, br, cb, bc])?;
    let s = mx::reshape(scale, &[rb, 1, cb, 1])?;
    let y = mx::reshape(&mx::multiply(&x, &s)?, &[rb * br, cb * bc])?;
    mx::astype(&mx::slice(&y, &[0, 0], &[m, n], &[1, 1])?, bf16)
}

/// A weight matrix `[out, in]` as stored: dense, or MLX-quantized (packed uint32 values, with a
/// scale per group of `q.group_size` inputs, and in affine mode a bias).
pub enum Matrix {
    Dense(Array),
    Quant { w: Array, scales: Array, biases: Option<Array>, q: QuantSpec },
}

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
        let loc = TensorLoc {
            file: file.clone(),
            path: shared_path.clone(),
            data_start: len - header.data_len,
            entry: t.clone(),
        };
        locations.insert(t.name.clone(), loc);
    }
    let (tensors, _meta) =
        mx::load_safetensors(path).map_err(|e| Error::ModelLoad(format!("{}: {e}", path.display())))?;
    let disagree = |what: String| {
        Error::ModelLoad(format!("{}: MLX read {what}: the file is corrupt; re-download the model", path.display()))
    };
    if tensors.len() != header.tensors.len() {
        return Err(disagree(format!("{} tensors where the header lists {}", tensors.len(), header.tensors.len())));
    }
    for t in &header.tensors {
        let a = tensors.get(&t.name).ok_or_else(|| disagree(format!("no tensor {}", t.name)))?;
        if a.shape() != t.shape || a.dtype() != t.mlx_dtype() {
            return Err(disagree(format!(
                "tensor {} as {:?} {:?} (the header: {} {:?})",
                t.name,
                a.dtype(),
                a.shape(),
                t.dtype,
                t.shape
            )));
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
        let mut w = Weights::from_map(map, config)?;
        w.locations = locations;
        Ok(w)
    }

    /// The tensors with config.json's quantization: `quantization` (mlx-lm's: a global entry and
    /// per-module entries, `false` for a module left dense), else `quantization_config` (Hugging
    /// Face's; `quant_method` mxfp4 / mxfp8 as mlx-lm maps them). A mode MLX does not have is
    /// refused naming the entry.
    pub fn from_map(map: HashMap<String, Array>, config: &Value) -> Result<Weights> {
        let mut default_q = None;
        let mut per_layer = HashMap::new();
        if let Some(q) = config.get("quantization").filter(|q| !q.is_null()) {
            default_q = Some(parse_spec(q, "quantization")?);
            if let Some(obj) = q.as_object() {
                for (k, v) in obj {
                    match v {
                        Value::Object(_) => {
                            per_layer.insert(k.clone(), Some(parse_spec(v, &format!("quantization[\"{k}\"]"))?));
                        }
                        Value::Bool(false) => {
                            per_layer.insert(k.clone(), None);
                        }
                        _ => {}
                    }
                }
            }
        } else if let Some(q) = config.get("quantization_config").filter(|q| !q.is_null() && fp8_config(q).is_none()) {
            // (an FP8 checkpoint's quantization_config is not MLX's quantization: its weights are
            // dequantized at load, dequantize_fp8)
            default_q = Some(match q.get("quant_method").and_then(Value::as_str) {
                Some("mxfp4") => QuantSpec { group_size: 32, bits: 4, mode: QuantMode::Mxfp4 },
                Some("mxfp8") => QuantSpec { group_size: 32, bits: 8, mode: QuantMode::Mxfp8 },
                _ => parse_spec(q, "quantization_config")?,
            });
        }
        Ok(Weights { map, default_q, per_layer, locations: HashMap::new(), streaming: None, lora: None })
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
        self.map.remove(name).ok_or_else(|| {
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
            return Err(Error::ModelLoad(format!(
                "weight {name} is {}, not a float type: re-convert the model",
                a.dtype().name()
            )));
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
    /// dtype checked (and the quantization's mode, bits and group size) before it is used.
    pub fn take_matrix(&mut self, prefix: &str, out: i32, inp: i32) -> Result<Matrix> {
        self.take_stacked(prefix, &[out], inp)
    }

    /// Take the `[experts, out, inp]` stacked expert matrices of module `prefix` (mlx-lm's
    /// `SwitchLinear`), dense or quantized, every part's shape checked as [`Weights::take_matrix`]
    /// does: a checkpoint with another expert count or width is refused naming the tensor.
    pub fn take_experts(&mut self, prefix: &str, experts: i32, out: i32, inp: i32) -> Result<Matrix> {
        self.take_stacked(prefix, &[experts, out], inp)
    }

    /// The matrices `[..lead, inp]` of module `prefix`: dense, or MLX-quantized in the mode its
    /// config entry says (packed uint32 weight; scales per group, float in affine mode, uint8 in
    /// the microscaling ones; biases in affine mode only).
    fn take_stacked(&mut self, prefix: &str, lead: &[i32], inp: i32) -> Result<Matrix> {
        let name = format!("{prefix}.weight");
        let with = |last: i32| -> Vec<i32> { lead.iter().copied().chain([last]).collect() };
        let Some(q) = self.quant_of(prefix) else {
            return Ok(Matrix::Dense(self.take_shaped(&name, &with(inp))?));
        };
        let (groups, bits) = q.mode.allowed();
        if !bits.contains(&q.bits) || !groups.contains(&q.group_size) || inp % q.group_size != 0 {
            return Err(Error::ModelLoad(format!(
                "{prefix}: quantization mode {} bits {} / group_size {} do not fit its {inp} inputs ({} takes bits {bits:?}, \
                 group_size {groups:?} dividing the inputs): config.json's quantization is wrong",
                q.mode.name(),
                q.bits,
                q.group_size,
                q.mode.name()
            )));
        }
        let gs_name = format!("{prefix}.global_scale");
        if self.contains(&gs_name) {
            return Err(Error::Unsupported(format!(
                "weight {gs_name}: {} with a per-tensor global scale is not supported; re-convert without --global-scale",
                q.mode.name()
            )));
        }
        let w = self.take(&name)?;
        let packed = with(inp / 32 * q.bits);
        if w.shape() != packed || w.dtype() != Dtype::Uint32 {
            return Err(shape_error(
                &name,
                &w.shape(),
                &format!("uint32 {packed:?} ({} {}-bit quantized {:?})", q.mode.name(), q.bits, with(inp)),
            ));
        }
        let groups = with(inp / q.group_size);
        let sname = format!("{prefix}.scales");
        let bname = format!("{prefix}.biases");
        let (scales, biases) = if q.mode.has_biases() {
            let biases = if self.contains(&bname) { Some(self.take_shaped(&bname, &groups)?) } else { None };
            (self.take_shaped(&sname, &groups)?, biases)
        } else {
            let scales = self.take(&sname)?;
            if scales.shape() != groups || scales.dtype() != Dtype::Uint8 {
                return Err(Error::ModelLoad(format!(
                    "weight {sname} is {} {:?} but {} quantization of {name} needs uint8 scales {groups:?} (one per group of {}): \
                     the checkpoint does not match config.json's quantization",
                    scales.dtype().name(),
                    scales.shape(),
                    q.mode.name(),
                    q.group_size
                )));
            }
            if self.contains(&bname) {
                return Err(Error::ModelLoad(format!(
                    "weight {bname}: {} quantization has no biases (they are affine's): the checkpoint does not match \
                     config.json's quantization",
                    q.mode.name()
                )));
            }
            (scales, None)
        };
        Ok(Matrix::Quant { w, scales, biases, q })
    }

    /// Quantization of module `prefix` (present when `{prefix}.scales` exists).
    pub fn quant_of(&self, prefix: &str) -> Option<QuantSpec> {
        if !self.map.contains_key(&format!("{prefix}.scales")) {
            return None;
        }
        match self.per_layer.get(prefix) {
            Some(spec) => *spec,
            None => self.default_q.or(Some(QuantSpec::affine(64, 4))),
        }
    }

    /// Total bytes of the tensors still held.
    pub fn nbytes(&self) -> usize {
        self.map.values().map(Array::nbytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `{prefix}.weight` / `.scales` of a `[4, 64]` matrix quantized by MLX in `mode`.
    fn quantized(prefix: &str, mode: QuantMode) -> HashMap<String, Array> {
        let w = mx::reshape(&mx::arange(0.0, 256.0, 1.0, Dtype::Float32).unwrap(), &[4, 64]).unwrap();
        let (g, b) = mode.defaults();
        let (q, s, bias) = mx::quantize_mode(&w, g, b, mode).unwrap();
        let mut m = HashMap::from([(format!("{prefix}.weight"), q), (format!("{prefix}.scales"), s)]);
        if let Some(bias) = bias {
            m.insert(format!("{prefix}.biases"), bias);
        }
        m
    }

    #[test]
    fn modes_come_from_the_global_entry_the_module_entry_or_quant_method() {
        // a per-module entry without a mode is affine with affine's defaults, whatever the global
        // entry's mode (mlx-lm passes the entry to `to_quantized`, whose mode defaults to affine)
        let mut map = quantized("a", QuantMode::Mxfp4);
        map.extend(quantized("b", QuantMode::Affine));
        let cfg = json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4", "b": {"bits": 4}}});
        let mut w = Weights::from_map(map, &cfg).unwrap();
        assert_eq!(w.quant_of("a"), Some(QuantSpec { group_size: 32, bits: 4, mode: QuantMode::Mxfp4 }));
        assert_eq!(w.quant_of("b"), Some(QuantSpec::affine(64, 4)));
        assert!(matches!(w.take_matrix("a", 4, 64).unwrap(), Matrix::Quant { biases: None, .. }));
        assert!(matches!(w.take_matrix("b", 4, 64).unwrap(), Matrix::Quant { biases: Some(_), .. }));
        // Hugging Face's quantization_config (gpt-oss's release)
        let w = Weights::from_map(
            quantized("a", QuantMode::Mxfp4),
            &json!({"quantization_config": {"quant_method": "mxfp4"}}),
        )
        .unwrap();
        assert_eq!(w.quant_of("a").map(|q| q.mode), Some(QuantMode::Mxfp4));
    }

    #[test]
    fn a_mode_mlx_does_not_have_is_refused_naming_the_entry() {
        for (cfg, needle) in [
            (json!({"quantization": {"mode": "fp3"}}), "quantization.mode = \"fp3\""),
            (json!({"quantization": {"mode": "affine", "x.y": {"mode": 4}}}), "quantization[\"x.y\"].mode = 4"),
            (json!({"quantization": {"bits": "four"}}), "quantization.bits = \"four\" is not an integer"),
        ] {
            let err = Weights::from_map(HashMap::new(), &cfg).err().expect("refused").to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}

#[cfg(test)]
mod fp8_tests {
    use super::*;
    use serde_json::json;

    fn cfg(block: Value) -> Value {
        json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": block, "fmt": "e4m3"}})
    }

    /// e4m3 codes of small integers (exact in FP8): the bytes 0x38 (1.0), 0x40 (2.0), 0x44 (3.0), 0x30 (0.5).
    fn codes(shape: &[i32]) -> Array {
        let n: i32 = shape.iter().product();
        let v: Vec<u8> = (0..n).map(|i| [0x38u8, 0x40, 0x44, 0x30][i as usize % 4]).collect();
        Array::from_slice(&v, shape).unwrap()
    }

    fn weights(entries: Vec<(&str, Array)>, config: &Value) -> Weights {
        Weights::from_map(entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect(), config).unwrap()
    }

    /// Blocks of 2×2 over a 3×5 matrix (padded at the edges): each element its code's value times its
    /// block's scale, in bfloat16; a per-tensor scale broadcasts; activation scales dropped; the
    /// config's quantization_config is not taken for MLX's own quantization.
    #[test]
    fn block_and_tensor_scales() {
        let c = cfg(json!([2, 2]));
        let scale = Array::from_slice(&[1.0f32, 2.0, 4.0, 8.0, 16.0, 32.0], &[2, 3]).unwrap();
        let mut w = weights(
            vec![
                ("a.weight", codes(&[3, 5])),
                ("a.weight_scale_inv", scale),
                ("b.weight", codes(&[2, 2])),
                ("b.weight_scale_inv", Array::scalar(0.25f32).unwrap()),
                ("b.activation_scale", Array::scalar(1.0f32).unwrap()),
            ],
            &c,
        );
        assert_eq!(w.default_q, None);
        dequantize_fp8(&c, &mut w).unwrap();
        let a = w.take("a.weight").unwrap();
        assert_eq!((a.dtype(), a.shape()), (mx::Dtype::Bfloat16, vec![3, 5]));
        let got = mx::astype(&a, mx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        let val = [1.0f32, 2.0, 3.0, 0.5];
        let scales = [[1.0f32, 2.0, 4.0], [8.0, 16.0, 32.0]];
        for r in 0..3 {
            for col in 0..5 {
                let want = val[(r * 5 + col) % 4] * scales[r / 2][col / 2];
                assert_eq!(got[r * 5 + col], want, "[{r}, {col}]");
            }
        }
        let b = mx::astype(&w.take("b.weight").unwrap(), mx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(b, [0.25, 0.5, 0.75, 0.125]);
        assert!(w.keys().next().is_none(), "scales and activation scales are gone");
    }

    #[test]
    fn bad_checkpoints_are_refused_naming_the_tensor() {
        let err = |c: &Value, entries: Vec<(&str, Array)>| {
            let mut w = weights(entries, c);
            dequantize_fp8(c, &mut w).err().map(|e| e.to_string()).unwrap_or_default()
        };
        let c = cfg(json!([128, 128]));
        let s = |shape: &[i32]| mx::ones(shape, mx::Dtype::Float32).unwrap();
        // scales for blocks of 64 under a config of 128
        let e = err(&c, vec![("l.weight", codes(&[256, 128])), ("l.weight_scale_inv", s(&[4, 2]))]);
        assert!(e.contains("weight l.weight_scale_inv has shape [4, 2]") && e.contains("needs [2, 1]"), "{e}");
        let e = err(&c, vec![("l.weight", codes(&[256, 128]))]);
        assert!(e.contains("weight l.weight is FP8") && e.contains("no l.weight_scale_inv"), "{e}");
        let e = err(&c, vec![("l.weight_scale_inv", s(&[2, 1]))]);
        assert!(e.contains("weight l.weight_scale_inv has no l.weight"), "{e}");
        let e = err(&cfg(json!([128])), vec![]);
        assert!(e.contains("quantization_config.weight_block_size = [128]"), "{e}");
        let mx8 = json!({"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}});
        assert!(err(&mx8, vec![]).contains("ue8m0"));
        // not an FP8 checkpoint: nothing done, even to a uint8 tensor
        let mut w = weights(vec![("l.weight", codes(&[2, 2]))], &json!({}));
        dequantize_fp8(&json!({}), &mut w).unwrap();
        assert_eq!(w.take("l.weight").unwrap().dtype(), mx::Dtype::Uint8);
    }
}
