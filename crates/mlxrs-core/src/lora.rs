//! LoRA and DoRA adapters in mlx-lm's format (`adapter_config.json` + `adapters.safetensors`, as
//! mlx-lm 0.32.2's `tuner/utils.py` `load_adapters` reads them): validated against the model as it
//! loads, then either fused into the base weights (one adapter on a dense base: mlx-lm's
//! `LoRALinear.fuse` / `DoRALinear.fuse`) or kept beside them and added at run time
//! (`y = base(x) + scale·((x·A)·B)`, DoRA's magnitude `m / ‖W + scale·Bᵀ·Aᵀ‖` applied after), one
//! adapter per batch row ([`with_rows`]). `docs/design/lora.md` says why.
//!
//! How it plugs in: [`crate::weights::Weights`] carries the [`Registry`]; every
//! [`crate::models::layers::Linear::load`] asks it for its module ([`Registry::apply`]), so every
//! architecture's linears are adaptable without a line of their own; after the model is built,
//! [`Registry::check_consumed`] refuses adapter tensors no linear of the model took.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};
use crate::models::layers::Linear;
use serde_json::Value;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// LoRA, or DoRA (a learned magnitude per output row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Lora,
    Dora,
}

/// One module's tensors: `lora_a` `[in, r]`, `lora_b` `[r, out]`, DoRA's `m` `[out]`.
struct Tensors {
    a: Option<Array>,
    b: Option<Array>,
    m: Option<Array>,
}

/// One adapter, as read from its directory.
pub struct Adapter {
    pub name: String,
    pub path: PathBuf,
    pub kind: Kind,
    pub rank: i32,
    pub scale: f32,
    /// Bytes of its tensors.
    pub nbytes: usize,
    /// Module prefix (the model's tensor names, e.g. `model.layers.3.self_attn.q_proj`) → tensors.
    modules: BTreeMap<String, Tensors>,
}

fn bad(path: &Path, what: String) -> Error {
    Error::ModelLoad(format!("adapter {}: {what}", path.display()))
}

/// The number of decoder layers of the model `config` describes (`num_layers` counts from its end).
fn model_layers(config: &Value) -> Option<i64> {
    config
        .get("num_hidden_layers")
        .or_else(|| config.get("text_config").and_then(|t| t.get("num_hidden_layers")))
        .and_then(Value::as_i64)
}

/// `(layer, key)` of a module name `...layers.{i}.{key}`.
fn split_layer(module: &str) -> Option<(i64, &str)> {
    let mut rest = module;
    while let Some(at) = rest.find("layers.") {
        let after = &rest[at + "layers.".len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && after.as_bytes().get(digits) == Some(&b'.') && (at == 0 || rest.as_bytes()[at - 1] == b'.') {
            return Some((after[..digits].parse().ok()?, &after[digits + 1..]));
        }
        rest = after;
    }
    None
}

impl Adapter {
    /// Read and check the adapter in `dir` against the model `config` describes (its layer count):
    /// every field of `adapter_config.json` and every tensor's name (shapes are checked against the
    /// model's linears as they load).
    pub fn load(name: &str, dir: &Path, config: &Value) -> Result<Adapter> {
        let cpath = dir.join("adapter_config.json");
        if !dir.is_dir() {
            return Err(bad(
                dir,
                "no such directory (an adapter is a directory with adapter_config.json and adapters.safetensors)"
                    .into(),
            ));
        }
        let text = std::fs::read_to_string(&cpath).map_err(|e| bad(dir, format!("adapter_config.json: {e}")))?;
        let c: Value =
            serde_json::from_str(&text).map_err(|e| bad(dir, format!("adapter_config.json: invalid JSON: {e}")))?;
        let kind = match c.get("fine_tune_type").and_then(Value::as_str).unwrap_or("lora") {
            "lora" => Kind::Lora,
            "dora" => Kind::Dora,
            "full" => {
                return Err(bad(
                    dir,
                    "adapter_config.json: fine_tune_type \"full\" is a fully fine-tuned model, not an adapter: \
                                      fuse it into a model directory (mlx_lm.fuse) and serve that"
                        .into(),
                ))
            }
            t => return Err(bad(dir, format!("adapter_config.json: fine_tune_type {t:?} is not one of lora, dora"))),
        };
        let layers =
            model_layers(config).ok_or_else(|| bad(dir, "the model's config.json has no num_hidden_layers".into()))?;
        let num_layers = c
            .get("num_layers")
            .and_then(Value::as_i64)
            .ok_or_else(|| bad(dir, "adapter_config.json: num_layers is missing or not an integer".into()))?;
        let p = c
            .get("lora_parameters")
            .filter(|v| v.is_object())
            .ok_or_else(|| bad(dir, "adapter_config.json: lora_parameters is missing or not an object".into()))?;
        let rank = p.get("rank").and_then(Value::as_i64).filter(|r| (1..=1 << 16).contains(r)).ok_or_else(|| {
            bad(
                dir,
                format!(
                    "adapter_config.json: lora_parameters.rank = {} is not a positive integer",
                    p.get("rank").unwrap_or(&Value::Null)
                ),
            )
        })? as i32;
        let scale = match p.get("scale") {
            Some(v) => v
                .as_f64()
                .filter(|s| s.is_finite())
                .ok_or_else(|| bad(dir, format!("adapter_config.json: lora_parameters.scale = {v} is not a number")))?,
            None => {
                let hint = if p.get("alpha").is_some() {
                    " (it has alpha: mlx-lm's LoRA config uses scale, not alpha)"
                } else {
                    ""
                };
                return Err(bad(dir, format!("adapter_config.json: lora_parameters.scale is missing{hint}")));
            }
        } as f32;
        let keys: Option<BTreeSet<String>> = match p.get("keys") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .map(|k| {
                        k.as_str().map(str::to_string).ok_or_else(|| {
                            bad(dir, format!("adapter_config.json: lora_parameters.keys entry {k} is not a string"))
                        })
                    })
                    .collect::<Result<_>>()?,
            ),
            Some(v) => {
                return Err(bad(
                    dir,
                    format!("adapter_config.json: lora_parameters.keys = {v} is not a list of module names"),
                ))
            }
        };
        let first = (layers - num_layers.max(0)).max(0);
        let wpath = dir.join("adapters.safetensors");
        if !wpath.is_file() {
            return Err(bad(dir, "adapters.safetensors is missing".into()));
        }
        crate::safetensors::read_header(&wpath)?; // a corrupt file: refused with the header's reason
        let (tensors, _) = mx::load_safetensors(&wpath).map_err(|e| bad(dir, format!("adapters.safetensors: {e}")))?;
        let mut modules: BTreeMap<String, Tensors> = BTreeMap::new();
        let mut nbytes = 0;
        for (tname, arr) in tensors {
            let not_param =
                |why: &str| bad(dir, format!("tensor {tname}: not an adapter parameter of this model ({why})"));
            let name = tname.strip_prefix("language_model.").unwrap_or(&tname);
            let Some((module, leaf)) = name.rsplit_once('.') else { return Err(not_param("no module name")) };
            match (leaf, kind) {
                ("lora_a" | "lora_b", _) | ("m", Kind::Dora) => {}
                _ => {
                    return Err(not_param(&format!(
                        "{leaf:?} is not one of lora_a, lora_b{}",
                        if kind == Kind::Dora { ", m" } else { "" }
                    )))
                }
            }
            let Some((layer, key)) = split_layer(module) else {
                return Err(not_param("mlxrs adapts the linear layers inside the decoder layers only"));
            };
            if layer >= layers {
                return Err(not_param(&format!("the model has {layers} layers")));
            }
            if layer < first {
                return Err(not_param(&format!(
                    "num_layers = {num_layers} adapts layers {first}..{} only",
                    layers - 1
                )));
            }
            if let Some(k) = &keys {
                if !k.contains(key) {
                    return Err(not_param(&format!("{key:?} is not in lora_parameters.keys")));
                }
            }
            if !arr.dtype().is_float() {
                return Err(bad(dir, format!("tensor {tname} is {}, not a float type", arr.dtype().name())));
            }
            nbytes += arr.nbytes();
            let t = modules.entry(module.to_string()).or_insert(Tensors { a: None, b: None, m: None });
            match leaf {
                "lora_a" => t.a = Some(arr),
                "lora_b" => t.b = Some(arr),
                _ => t.m = Some(arr),
            }
        }
        for (module, t) in &modules {
            // mlx-lm leaves a missing tensor at its initial value: lora_b zeros (no delta), m the
            // base row norms (a factor of one); a missing lora_a is random there: refused here
            if t.a.is_none() && t.b.is_some() {
                return Err(bad(dir, format!("tensor {module}.lora_a is missing (its lora_b is there)")));
            }
        }
        Ok(Adapter { name: name.to_string(), path: dir.to_path_buf(), kind, rank, scale, nbytes, modules })
    }
}

/// The adapters a model loads with, shared by its linears while they load.
pub struct Registry {
    pub adapters: Vec<Adapter>,
    /// Fuse into dense bases (one adapter); quantized bases always run unfused.
    pub fuse: bool,
    used: Mutex<BTreeSet<(usize, String)>>,
}

/// One adapter's low-rank update of one linear, ready to run.
struct Delta {
    a: Array,
    b: Array,
    scale: Array,
    /// DoRA: `m / ‖W + scale·Bᵀ·Aᵀ‖` per output row (float32).
    factor: Option<Array>,
    /// DoRA: the magnitude `m` (for the fused form).
    m: Option<Array>,
}

/// A linear with adapters beside it ([`Linear::Lora`]).
pub struct LoraLinear {
    /// The base, without its bias (DoRA scales before the bias).
    pub base: Linear,
    pub bias: Option<Array>,
    /// Per adapter (index into [`Registry::adapters`]): its update of this linear, if any.
    deltas: Vec<Option<Delta>>,
    /// For a decode step whose rows use different adapters: the updates stacked, ranks padded
    /// with zeros, one more entry (zeros, factor one) for rows with none.
    stacked: Option<Stacked>,
}

struct Stacked {
    a: Array,
    b: Array,
    scale: Array,
    factor: Option<Array>,
}

thread_local! {
    /// The adapter of each batch row of the forward pass being built on this thread (None: the
    /// base model for every row).
    static ROWS: RefCell<Option<Vec<Option<usize>>>> = const { RefCell::new(None) };
}

/// Build `f`'s forward pass with batch row `i` using adapter `rows[i]` (None: no adapter). The
/// engine wraps every forward pass of a model loaded with unfused adapters in it.
pub fn with_rows<T>(rows: &[Option<usize>], f: impl FnOnce() -> T) -> T {
    let prev = ROWS.with(|r| r.replace(if rows.iter().all(Option::is_none) { None } else { Some(rows.to_vec()) }));
    let out = f();
    ROWS.with(|r| *r.borrow_mut() = prev);
    out
}

fn shape_err(a: &Adapter, module: &str, leaf: &str, got: &[i32], want: &[i32]) -> Error {
    bad(
        &a.path,
        format!("tensor {module}.{leaf} has shape {got:?} but the model's {module} needs {want:?} (rank {})", a.rank),
    )
}

impl Registry {
    /// Adapters by name and directory, checked against the model `config` describes.
    pub fn load(specs: &[(String, PathBuf)], config: &Value) -> Result<Registry> {
        let adapters = specs.iter().map(|(n, p)| Adapter::load(n, p, config)).collect::<Result<Vec<_>>>()?;
        Ok(Registry { fuse: adapters.len() == 1, adapters, used: Mutex::new(BTreeSet::new()) })
    }

    fn wants(&self, prefix: &str) -> bool {
        self.adapters.iter().any(|a| a.modules.contains_key(prefix))
    }

    /// The linear `prefix` `[out, inp]` with the adapters' updates: fused into a dense base when
    /// [`Registry::fuse`], else beside it. `base` is returned as it is when no adapter names it.
    pub fn apply(&self, prefix: &str, base: Linear, out: i32, inp: i32) -> Result<Linear> {
        // adapter names are read without a multimodal wrapper's `language_model.` (as mlx-lm's text
        // model names its parameters): the model's linear likewise
        let prefix = prefix.strip_prefix("language_model.").unwrap_or(prefix);
        if !self.wants(prefix) {
            return Ok(base);
        }
        let mut deltas = Vec::with_capacity(self.adapters.len());
        for (i, a) in self.adapters.iter().enumerate() {
            let Some(t) = a.modules.get(prefix) else {
                deltas.push(None);
                continue;
            };
            self.used.lock().unwrap_or_else(|e| e.into_inner()).insert((i, prefix.to_string()));
            let r = a.rank;
            let check = |leaf: &str, x: &Option<Array>, want: &[i32]| -> Result<()> {
                match x {
                    Some(x) if x.shape() != want => Err(shape_err(a, prefix, leaf, &x.shape(), want)),
                    _ => Ok(()),
                }
            };
            check("lora_a", &t.a, &[inp, r])?;
            check("lora_b", &t.b, &[r, out])?;
            check("m", &t.m, &[out])?;
            let scale = mx::scalar_as(a.scale as f64, Dtype::Float32)?;
            let (a_t, b_t) = match (&t.a, &t.b) {
                (Some(x), Some(y)) => (x.clone(), y.clone()),
                // no lora_b: mlx-lm's zeros, no update (DoRA's factor may still apply)
                (Some(x), None) => (x.clone(), mx::zeros(&[r, out], x.dtype())?),
                _ => (mx::zeros(&[inp, r], Dtype::Float32)?, mx::zeros(&[r, out], Dtype::Float32)?),
            };
            let (factor, mag) = match a.kind {
                Kind::Lora => (None, None),
                Kind::Dora => {
                    let w = base_weight(&base)?;
                    let m = match &t.m {
                        Some(m) => m.clone(),
                        None => row_norm(&mx::astype(&w, Dtype::Float32)?)?,
                    };
                    // mlx-lm: adapted = w + (scale * lora_b.T) @ lora_a.T; m / ‖adapted‖ per row
                    let adapted = mx::add(
                        &w,
                        &mx::matmul(&mx::multiply(&scale, &mx::transpose(&b_t)?)?, &mx::transpose(&a_t)?)?,
                    )?;
                    (Some(mx::divide(&m, &row_norm(&adapted)?)?), Some(m))
                }
            };
            deltas.push(Some(Delta { a: a_t, b: b_t, scale, factor, m: mag }));
        }
        if self.fuse {
            if let Linear::Dense { w, b, .. } = &base {
                let d = deltas.iter().flatten().next().expect("one adapter names this module");
                // mlx-lm's fuse: W + (scale·Bᵀ)·Aᵀ in W's dtype; DoRA: rows rescaled to m
                let delta = mx::matmul(&mx::multiply(&d.scale, &mx::transpose(&d.b)?)?, &mx::transpose(&d.a)?)?;
                let mut fused = mx::add(w, &mx::astype(&delta, w.dtype())?)?;
                if let Some(m) = &d.m {
                    let k = mx::divide(m, &row_norm(&fused)?)?;
                    fused = mx::astype(&mx::multiply(&mx::expand_dims(&k, 1)?, &fused)?, w.dtype())?;
                }
                fused.eval()?;
                // the weights changed: no blocks of the old ones
                return Ok(Linear::Dense { wt: mx::transpose(&fused)?, w: fused, b: b.clone(), host: None });
            }
        }
        let (base, bias) = base.without_bias();
        let stacked = if self.adapters.len() > 1 { Some(stack(&deltas, inp, out)?) } else { None };
        Ok(Linear::Lora(Box::new(LoraLinear { base, bias, deltas, stacked })))
    }

    /// Every adapter tensor went to a linear of the model; else refused naming the first that did not.
    pub fn check_consumed(&self) -> Result<()> {
        let used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        for (i, a) in self.adapters.iter().enumerate() {
            if let Some(m) = a.modules.keys().find(|m| !used.contains(&(i, (*m).clone()))) {
                let leaf = if a.modules[m].a.is_some() { "lora_a" } else { "m" };
                return Err(bad(
                    &a.path,
                    format!("tensor {m}.{leaf}: the model has no linear layer {m} that mlxrs can adapt (a module the model lacks, or not a plain linear)"),
                ));
            }
        }
        Ok(())
    }

    /// Bytes of all adapters' tensors.
    pub fn nbytes(&self) -> usize {
        self.adapters.iter().map(|a| a.nbytes).sum()
    }
}

/// `‖w‖` per row (mlx's `linalg.norm(w, axis=1)`).
fn row_norm(w: &Array) -> Result<Array> {
    mx::sqrt(&mx::sum(&mx::square(w)?, &[1], false)?)
}

/// The base's weight as a dense matrix (dequantized as mlx-lm's DoRA does).
fn base_weight(base: &Linear) -> Result<Array> {
    match base {
        Linear::Dense { w, .. } => Ok(w.clone()),
        Linear::Quant { w, scales, biases, q, .. } => {
            mx::dequantize(w, scales, biases.as_ref(), q.group_size, q.bits, q.mode)
        }
        Linear::Lora(_) => Err(Error::ModelLoad("an adapted linear adapted twice (a bug in mlxrs)".into())),
    }
}

fn stack(deltas: &[Option<Delta>], inp: i32, out: i32) -> Result<Stacked> {
    let rmax = deltas.iter().flatten().map(|d| d.a.dim(1)).max().unwrap_or(1);
    let (mut a, mut b, mut s, mut f) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let any_dora = deltas.iter().flatten().any(|d| d.factor.is_some());
    let zero = mx::scalar_as(0.0, Dtype::Float32)?;
    for d in deltas.iter().map(Some).chain(std::iter::once(None)) {
        match d.and_then(Option::as_ref) {
            Some(d) => {
                let pad = rmax - d.a.dim(1);
                a.push(mx::pad(&mx::astype(&d.a, Dtype::Float32)?, &[1], &[0], &[pad], &zero)?);
                b.push(mx::pad(&mx::astype(&d.b, Dtype::Float32)?, &[0], &[0], &[pad], &zero)?);
                s.push(d.scale.clone());
                f.push(match &d.factor {
                    Some(x) => mx::astype(x, Dtype::Float32)?,
                    None => mx::ones(&[out], Dtype::Float32)?,
                });
            }
            None => {
                a.push(mx::zeros(&[inp, rmax], Dtype::Float32)?);
                b.push(mx::zeros(&[rmax, out], Dtype::Float32)?);
                s.push(zero.clone());
                f.push(mx::ones(&[out], Dtype::Float32)?);
            }
        }
    }
    let st = |v: &[Array]| -> Result<Array> {
        let r: Vec<&Array> = v.iter().collect();
        let x = mx::stack(&r, 0)?;
        x.eval()?;
        Ok(x)
    };
    Ok(Stacked { a: st(&a)?, b: st(&b)?, scale: st(&s)?, factor: if any_dora { Some(st(&f)?) } else { None } })
}

impl LoraLinear {
    fn plus_bias(&self, y: Array) -> Result<Array> {
        match &self.bias {
            Some(b) => mx::add(&y, b),
            None => Ok(y),
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let rows = ROWS.with(|r| r.borrow().clone());
        let Some(rows) = rows else { return self.plus_bias(self.base.forward(x)?) };
        let first = rows[0];
        if rows.iter().all(|r| *r == first) {
            let Some(d) = first.and_then(|i| self.deltas.get(i)).and_then(Option::as_ref) else {
                return self.plus_bias(self.base.forward(x)?);
            };
            // mlx-lm: y + (scale * ((x @ A) @ B)).astype(x.dtype); DoRA: (m / ‖·‖).astype(x.dtype) * that
            let y = match &d.factor {
                Some(_) => mx::matmul(x, &mx::transpose(&base_weight(&self.base)?)?)?,
                None => self.base.forward(x)?,
            };
            let z = mx::matmul(&mx::matmul(x, &d.a)?, &d.b)?;
            let y = mx::add(&y, &mx::astype(&mx::multiply(&d.scale, &z)?, x.dtype())?)?;
            let y = match &d.factor {
                Some(f) => mx::multiply(&mx::astype(f, x.dtype())?, &y)?,
                None => y,
            };
            return self.plus_bias(y);
        }
        // rows with different adapters: each row's own update, gathered from the stack
        let s = self
            .stacked
            .as_ref()
            .ok_or_else(|| Error::Invalid("rows with different adapters on a model with one".into()))?;
        if x.ndim() != 3 || x.dim(0) as usize != rows.len() {
            return Err(Error::Invalid(format!(
                "an adapted linear got input {:?} for a batch of {} rows with different adapters",
                x.shape(),
                rows.len()
            )));
        }
        let none = self.deltas.len() as i32;
        let ids: Vec<i32> = rows
            .iter()
            .map(|r| r.map_or(none, |i| if self.deltas.get(i).is_some_and(Option::is_some) { i as i32 } else { none }))
            .collect();
        let idx = Array::from_slice(&ids, &[ids.len() as i32])?;
        let a = mx::take(&s.a, &idx, 0)?; // [B, in, r]
        let b = mx::take(&s.b, &idx, 0)?; // [B, r, out]
        let sc = mx::reshape(&mx::take(&s.scale, &idx, 0)?, &[ids.len() as i32, 1, 1])?;
        let z = mx::matmul(&mx::matmul(x, &a)?, &b)?;
        let delta = mx::astype(&mx::multiply(&sc, &z)?, x.dtype())?;
        let y = match &s.factor {
            Some(f) => {
                let y = mx::add(&mx::matmul(x, &mx::transpose(&base_weight(&self.base)?)?)?, &delta)?;
                let f = mx::expand_dims(&mx::take(f, &idx, 0)?, 1)?; // [B, 1, out]
                mx::multiply(&mx::astype(&f, x.dtype())?, &y)?
            }
            None => mx::add(&self.base.forward(x)?, &delta)?,
        };
        self.plus_bias(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_and_key_of_a_module_name() {
        assert_eq!(split_layer("model.layers.3.self_attn.q_proj"), Some((3, "self_attn.q_proj")));
        assert_eq!(split_layer("model.language_model.layers.12.mlp.down_proj"), Some((12, "mlp.down_proj")));
        // "layers." must start a path component and be followed by an index and a dot
        assert_eq!(split_layer("model.sublayers.3.x"), None);
        assert_eq!(split_layer("model.layers.x.q_proj"), None);
        assert_eq!(split_layer("lm_head"), None);
        assert_eq!(split_layer("layers.0.q"), Some((0, "q")));
    }

    #[test]
    fn row_selection_is_scoped() {
        with_rows(&[Some(1), None], || {
            assert_eq!(ROWS.with(|r| r.borrow().clone()), Some(vec![Some(1), None]));
            with_rows(&[None], || assert_eq!(ROWS.with(|r| r.borrow().clone()), None));
            assert_eq!(ROWS.with(|r| r.borrow().clone()), Some(vec![Some(1), None]));
        });
        assert_eq!(ROWS.with(|r| r.borrow().clone()), None);
    }
}
