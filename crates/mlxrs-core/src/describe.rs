//! What `mlxrs ls` shows of a model directory, for any model — loadable or not. The planner's
//! [`crate::plan::ModelFacts`] refuses a model mlxrs cannot load; the registry must still list it
//! (with why it is unsupported), so it asks [`describe`], which reads config.json through the one
//! reader ([`crate::engine::read_config`]), the weights through [`crate::safetensors`] and the chat
//! template through [`crate::tokenizer::chat_template`].
use crate::error::{Error, Result};
use serde::Serialize;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// A model directory as the registry records it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Description {
    /// config.json's `model_type` (None when it has none).
    pub model_type: Option<String>,
    /// mlxrs can load it: a known architecture and a tokenizer.json.
    pub supported: bool,
    /// Why it is not supported ("; "-joined), None when it is.
    pub note: Option<String>,
    /// Parameters: every tensor's elements, quantized ones counted unpacked, quantization scales
    /// and biases left out.
    pub params: u64,
    /// Bytes of every tensor, from the safetensors headers.
    pub weight_bytes: u64,
    /// The float dtype: `torch_dtype` (the text config's, else the top level's, else `dtype`),
    /// else the float dtype holding the most bytes.
    pub dtype: Option<String>,
    /// The quantization as text: MLX's ("4-bit g64", "4-bit g32 mxfp4") or another method's
    /// ("fp8 8-bit").
    pub quantization: Option<String>,
    /// The first positive of `max_position_embeddings`, `n_positions`, `max_sequence_length`,
    /// `seq_length` (the text config's, else the top level's).
    pub context_length: Option<u64>,
    /// It has a chat template ([`crate::tokenizer::chat_template`]) and whether it mentions tools.
    pub chat_template: bool,
    pub tools: bool,
    /// The weight files' names ([`crate::safetensors::model_files`]).
    pub files: Vec<String>,
}

fn float_name(dtype: &str) -> Option<&'static str> {
    Some(match dtype {
        "F32" => "float32",
        "F16" => "float16",
        "BF16" => "bfloat16",
        "F64" => "float64",
        _ => return None,
    })
}

/// The quantization of a config as text (None when it is not quantized).
pub fn quantization(config: &Value) -> Option<String> {
    if let Some(q) = config.get("quantization").filter(|q| q.is_object()) {
        if let Some(bits) = q.get("bits").filter(|b| truthy(b)) {
            let mut s = format!("{}-bit", scalar(bits));
            if let Some(g) = q.get("group_size").filter(|g| truthy(g)) {
                s += &format!(" g{}", scalar(g));
            }
            match q.get("mode").and_then(Value::as_str) {
                None | Some("affine") => {}
                Some(m) => s += &format!(" {m}"),
            }
            return Some(s);
        }
    }
    let qc = config.get("quantization_config").filter(|q| q.is_object())?;
    let method = ["quant_method", "quant_type"].iter().find_map(|k| qc.get(*k).filter(|v| truthy(v)));
    let method = method.map_or_else(|| "quantized".to_string(), scalar);
    Some(match ["bits", "weight_bits"].iter().find_map(|k| qc.get(*k).filter(|v| truthy(v))) {
        Some(b) => format!("{method} {}-bit", scalar(b)),
        None => method,
    })
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => false,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        _ => true,
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Describe the model directory `dir`. Errors (config.json missing or not a JSON object, weight
/// files missing, a header that does not validate) say why it is not a model directory at all;
/// a model mlxrs cannot load is described with `supported: false` and a note.
pub fn describe(dir: &Path) -> Result<Description> {
    let cfg = crate::engine::read_config(dir)?;
    if !cfg.is_object() {
        return Err(Error::ModelLoad(format!("{}: not a JSON object", dir.join("config.json").display())));
    }
    let files = crate::safetensors::model_files(dir)?;
    // name → (dtype, elements, bytes), in file order
    let mut tensors: Vec<(String, String, u64, u64)> = Vec::new();
    for f in &files {
        let h = crate::safetensors::read_header(f)?;
        tensors.extend(h.tensors.into_iter().map(|t| {
            let n = t.shape.iter().map(|&d| d.max(0) as u64).product::<u64>();
            let nb = t.nbytes();
            (t.name, t.dtype, n, nb)
        }));
    }
    let names: HashSet<&str> = tensors.iter().map(|t| t.0.as_str()).collect();
    let quant = cfg.get("quantization").filter(|q| q.is_object());
    let bits_of = |q: &Value| q.get("bits").and_then(Value::as_u64).unwrap_or(4).max(1);
    let mut params = 0u64;
    for (k, dt, n, _) in &tensors {
        let base = k.rsplit_once('.').map_or(k.as_str(), |(b, _)| b);
        let scaled = names.contains(format!("{base}.scales").as_str());
        if (k.ends_with(".scales") || k.ends_with(".biases"))
            && scaled
            && names.contains(format!("{base}.weight").as_str())
        {
            continue; // quantization parameters, not model parameters
        }
        let packed = crate::safetensors::dtype_of(dt).map(|d| d.1 * 8);
        params += match (quant, packed) {
            (Some(q), Some(elem_bits)) if scaled && matches!(dt.as_str(), "U32" | "U8" | "I32") => {
                let q = q.get(base).filter(|o| o.is_object()).unwrap_or(q);
                n * elem_bits / bits_of(q)
            }
            _ => *n,
        };
    }
    let tcfg = crate::plan::text_config(&cfg);
    let declared = [tcfg.get("torch_dtype"), cfg.get("torch_dtype"), cfg.get("dtype")];
    let dtype = declared.into_iter().flatten().find_map(Value::as_str).map(str::to_string).or_else(|| {
        let mut by: HashMap<&str, u64> = HashMap::new();
        let mut order: Vec<&str> = Vec::new();
        for (_, dt, _, nb) in &tensors {
            if let Some(name) = float_name(dt) {
                if !by.contains_key(name) {
                    order.push(name);
                }
                *by.entry(name).or_default() += nb;
            }
        }
        // the first of the largest, as Python's max() over insertion order
        order
            .iter()
            .copied()
            .fold(None, |best: Option<&str>, n| match best {
                Some(b) if by[b] >= by[n] => Some(b),
                _ => Some(n),
            })
            .map(str::to_string)
    });
    let model_type = cfg.get("model_type").and_then(Value::as_str).map(str::to_string);
    let mut notes = Vec::new();
    match (&cfg.get("model_type"), &model_type) {
        (_, Some(t)) if crate::models::arch::find(t).is_some() => {}
        (None, _) => notes.push("config.json has no model_type".to_string()),
        (Some(v), _) => notes.push(format!("model_type {} is not supported", py_repr(v))),
    }
    if !dir.join("tokenizer.json").is_file() {
        notes.push("no tokenizer.json".to_string());
    }
    let template = crate::tokenizer::chat_template(dir).ok().flatten();
    let ctx = ["max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"]
        .iter()
        .find_map(|k| tcfg.get(*k).or_else(|| cfg.get(*k)).and_then(Value::as_u64).filter(|&v| v > 0));
    Ok(Description {
        model_type,
        supported: notes.is_empty(),
        note: (!notes.is_empty()).then(|| notes.join("; ")),
        params,
        weight_bytes: tensors.iter().map(|t| t.3).sum(),
        dtype,
        quantization: quantization(&cfg),
        context_length: ctx,
        chat_template: template.is_some(),
        tools: template.as_deref().is_some_and(|t| t.contains("tools")),
        files: files.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect(),
    })
}

/// A JSON value as Python's repr would quote it in a note (`'mamba'`, `None`).
fn py_repr(v: &Value) -> String {
    match v {
        Value::String(s) => format!("'{s}'"),
        Value::Null => "None".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn quantization_text() {
        assert_eq!(quantization(&json!({})), None);
        assert_eq!(quantization(&json!({"quantization": {"bits": 4, "group_size": 64}})).unwrap(), "4-bit g64");
        let mx = json!({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}});
        assert_eq!(quantization(&mx).unwrap(), "4-bit g32 mxfp4");
        let fp8 = json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}});
        assert_eq!(quantization(&fp8).unwrap(), "fp8");
        assert_eq!(quantization(&json!({"quantization_config": {"bits": 8}})).unwrap(), "quantized 8-bit");
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let e = describe(Path::new("/nonexistent/mlxrs-describe")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/mlxrs-describe"), "{e}");
    }
}
