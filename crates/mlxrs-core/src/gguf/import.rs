//! Import a GGUF model into a normal mlxrs model directory: HF tensor names and config, the
//! converter's transformations undone, a tokenizer.json built from `tokenizer.ggml.*`.
use super::reader::{GgufHeader, MetaValue};
use serde_json::{json, Value};

fn meta_to_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::U8(x) => json!(x),
        MetaValue::I8(x) => json!(x),
        MetaValue::U16(x) => json!(x),
        MetaValue::I16(x) => json!(x),
        MetaValue::U32(x) => json!(x),
        MetaValue::I32(x) => json!(x),
        MetaValue::F32(x) => json!(x),
        MetaValue::Bool(x) => json!(x),
        MetaValue::Str(x) => json!(x),
        MetaValue::Array(a) => Value::Array(a.iter().map(meta_to_json).collect()),
        MetaValue::U64(x) => json!(x),
        MetaValue::I64(x) => json!(x),
        MetaValue::F64(x) => json!(x),
    }
}

/// All metadata as a JSON object (arrays included).
pub fn metadata_json(h: &GgufHeader) -> Value {
    Value::Object(h.metadata.iter().map(|(k, v)| (k.clone(), meta_to_json(v))).collect())
}
