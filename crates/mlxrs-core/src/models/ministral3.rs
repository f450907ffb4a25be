//! Ministral 3 (mlx-lm's `models/ministral3.py`, also the text model of `mistral3` checkpoints
//! whose `text_config.model_type` is `ministral3`): the Llama decoder ([`super::llama`]) with, where
//! mlx-lm's file differs:
//! - the rotary parameters in `rope_parameters` (required, as mlx-lm indexes it): its `rope_theta`
//!   (required) and itself as the rope scaling (`yarn` in the released checkpoints);
//! - Llama 4's position-dependent query scale `1 + beta · log(1 + floor(position /
//!   original_max_position_embeddings))` from `rope_parameters.llama_4_scaling_beta` and
//!   `.original_max_position_embeddings` (both required), at the first layer's offsets
//!   ([`super::deepseek_v3::llama4_scale`], shared with mistral4);
//! - `layer_types` may mark `sliding_attention` layers (a rotating cache of `sliding_window`);
//! - `tie_word_embeddings` defaults to true (false inside `mistral3`, whose wrapper sets it);
//! - FP8 checkpoints dequantized at load (see [`sanitize`]).
use super::arch::{Arch, LayerLayout};
use super::llama::{self, Variant};
use super::CausalLm;
use crate::error::{Error, Result};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch { name: "ministral3", model_types: &["ministral3"], sanitize, load, layout, gguf: None };

/// A Mistral 3-era config's `rope_parameters` (ministral3, mistral4): the object, its numbers checked
/// where read, and the Llama 4 query scale's `(beta, original_max_position_embeddings)`.
pub(crate) struct RopeParameters<'a> {
    pub params: &'a Value,
    pub llama4: (f64, f64),
}

impl<'a> RopeParameters<'a> {
    pub fn of(config: &'a Value, arch: &str) -> Result<RopeParameters<'a>> {
        let params = config.get("rope_parameters").filter(|p| p.is_object()).ok_or_else(|| {
            Error::ModelLoad(format!("config.json: rope_parameters is missing or not an object ({arch})"))
        })?;
        let mut r = RopeParameters { params, llama4: (0.0, 0.0) };
        r.llama4 = (r.num("llama_4_scaling_beta", false)?, r.num("original_max_position_embeddings", true)?);
        Ok(r)
    }

    /// `rope_parameters.{k}`: a finite number (`positive`: above 0).
    pub fn num(&self, k: &str, positive: bool) -> Result<f64> {
        self.params.get(k).and_then(Value::as_f64).filter(|v| v.is_finite() && (!positive || *v > 0.0)).ok_or_else(
            || {
                Error::ModelLoad(format!(
                    "config.json: rope_parameters.{k} is missing or not a {}number",
                    if positive { "positive " } else { "" }
                ))
            },
        )
    }
}

/// The config as the llama loader reads it (`rope_theta` and `rope_scaling` from
/// `rope_parameters`), and the query scale's `(beta, original_max_position_embeddings)`.
fn remap(config: &Value) -> Result<(Value, (f64, f64))> {
    let rp = RopeParameters::of(config, "ministral3")?;
    let mut c = config.clone();
    c["rope_theta"] = rp.num("rope_theta", true)?.into();
    c["rope_scaling"] = rp.params.clone();
    Ok((c, rp.llama4))
}

/// mlx-lm's sanitize: rotary buffers and a tied `lm_head` dropped (llama's); an FP8 checkpoint's
/// weights times their `weight_scale_inv` (per tensor in Mistral's releases) and its
/// `activation_scale`s dropped ([`crate::weights::dequantize_fp8`]). mlx-lm 0.32.2's ministral3
/// multiplies the e4m3 codes as MLX loads them (uint8) without decoding them (`mx.from_fp8`, which
/// its deepseek_v3 and mistral4 use): its FP8 Ministral weights are wrong; here they are decoded.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    llama::sanitize(config, w)?;
    crate::weights::dequantize_fp8(config, w)
}

/// Llama's: full attention, sliding where `layer_types` says so; dense FFNs.
pub fn layout(config: &Value) -> Result<Vec<LayerLayout>> {
    llama::layout(config)
}

pub fn load(config: &Value, w: Weights) -> Result<Box<dyn CausalLm>> {
    let (c, llama4) = remap(config)?;
    let v = Variant { qkv_bias: false, o_bias: false, qk_norm: false, rope_scaling: true };
    let mut m = llama::Model::load_variant(&c, w, v, false, layout(&c)?)?;
    m.llama4_scale = Some(llama4);
    Ok(Box::new(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rope_parameters_are_required_and_remapped() {
        let c = json!({"model_type": "ministral3", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e9, "factor": 16.0,
                       "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 16384}});
        let (r, l4) = remap(&c).unwrap();
        assert_eq!(l4, (0.1, 16384.0));
        assert_eq!(r["rope_theta"].as_f64(), Some(1e9));
        assert_eq!(r["rope_scaling"]["rope_type"], "yarn");
        let err = |c: &Value| remap(c).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(&json!({"model_type": "ministral3"})).contains("rope_parameters is missing"));
        for (k, want) in [
            ("llama_4_scaling_beta", "rope_parameters.llama_4_scaling_beta is missing"),
            ("original_max_position_embeddings", "rope_parameters.original_max_position_embeddings is missing"),
            ("rope_theta", "rope_parameters.rope_theta is missing"),
        ] {
            let mut b = c.clone();
            b["rope_parameters"].as_object_mut().unwrap().remove(k);
            assert!(err(&b).contains(want), "{k}: {}", err(&b));
        }
        let mut b = c.clone();
        b["rope_parameters"]["original_max_position_embeddings"] = json!(0);
        assert!(err(&b).contains("not a positive number"));
    }
}
