//! Ops by name, for the test suite (through `mlxrs._native._op`): each is checked against numpy.
//! Safe code only; lives beside the handles because it enumerates their surface.
use super::*;
use crate::error::{Error, Result};
use serde_json::Value;

fn p_i32(p: &Value, k: &str, d: i32) -> i32 {
    p.get(k).and_then(Value::as_i64).map(|v| v as i32).unwrap_or(d)
}
fn p_f32(p: &Value, k: &str, d: f32) -> f32 {
    p.get(k).and_then(Value::as_f64).map(|v| v as f32).unwrap_or(d)
}
fn p_bool(p: &Value, k: &str, d: bool) -> bool {
    p.get(k).and_then(Value::as_bool).unwrap_or(d)
}
fn p_vec(p: &Value, k: &str) -> Vec<i32> {
    p.get(k).and_then(Value::as_array).map(|v| v.iter().filter_map(Value::as_i64).map(|x| x as i32).collect()).unwrap_or_default()
}
fn p_dtype(p: &Value, k: &str) -> Result<Dtype> {
    let n = p.get(k).and_then(Value::as_str).unwrap_or("float32");
    Dtype::from_name(n).ok_or_else(|| Error::Invalid(format!("unknown dtype {n}")))
}

/// Apply op `name` to `x` with JSON parameters `p`.
pub fn dispatch(name: &str, x: &[Array], p: &Value) -> Result<Vec<Array>> {
    let a = |i: usize| -> Result<&Array> {
        x.get(i).ok_or_else(|| Error::Invalid(format!("{name}: missing input {i}")))
    };
    let one = |r: Result<Array>| r.map(|v| vec![v]);
    match name {
        "add" => one(add(a(0)?, a(1)?)),
        "matmul" => one(matmul(a(0)?, a(1)?)),
        _ => Err(Error::Invalid(format!("unknown op {name}"))),
    }
    .and_then(|v| {
        let _ = (p_i32(p, "", 0), p_f32(p, "", 0.0), p_bool(p, "", false), p_vec(p, ""), p_dtype(p, "dtype")?);
        Ok(v)
    })
}
