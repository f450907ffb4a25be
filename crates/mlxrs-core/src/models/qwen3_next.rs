//! Qwen3-Next (and the decoder Qwen3.5 shares with it, `qwen3_5.rs`): Gated DeltaNet linear
//! attention (a causal depthwise convolution, then the gated delta rule over a fixed-size
//! recurrent state) on every layer but each `full_attention_interval`-th, which is gated softmax
//! attention (queries and an output gate from one projection, qk-norm, partial rotary embedding);
//! a sparse MoE with a gated shared expert, or a dense SwiGLU MLP (mlx-lm's `models/qwen3_next.py`,
//! `qwen3_5.py` and `gated_delta.py`, its ops path: no fused GPU kernel here yet).
use super::arch::{Arch, AttnKind, FfnKind, LayerLayout};
use super::layers::{
    attend_fetched, Activation, Attention, Embedding, Linear, Mlp, QkNorm, Qkv, RmsNorm, Rope, SparseMoe,
};
use super::{limits, CausalLm, Cfg, DimDefaults, Dims, ModelShape};
use crate::cache::{Caches, LayerCache, LayerCaches, Mask, Masks};
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};
use crate::weights::Weights;
use serde_json::Value;

pub const ARCH: Arch = Arch {
    name: "qwen3_next",
    model_types: &["qwen3_next"],
    sanitize,
    load: |c, w| Ok(Box::new(Model::load(c, w, Flavor::Next)?)),
    layout: |c| Ok(Params::from_config(c, Flavor::Next)?.layout()),
    gguf: None,
};

/// Which config conventions apply: Qwen3-Next's (every field given, `rope_theta` and
/// `partial_rotary_factor` at the top level) or Qwen3.5's (mlx-lm's defaults for missing fields,
/// rotary parameters in `rope_parameters`, the text model possibly nested in `text_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    Next,
    Qwen35,
}

/// mlx-lm's qwen3_next sanitize: nothing unless the checkpoint has per-expert MoE weights (the
/// Hugging Face layout); then `mtp.*` dropped, a tied lm_head dropped, experts stacked into
/// `switch_mlp`, conv1d weights `[C, 1, K]` moved to `[C, K, 1]`, and the `1 + w` norms folded.
pub fn sanitize(config: &Value, w: &mut Weights) -> Result<()> {
    let moe_layers: Vec<i32> = w
        .keys()
        .filter(|k| k.starts_with("model.layers.") && k.ends_with(".mlp.experts.0.up_proj.weight"))
        .filter_map(|k| k.split('.').nth(2).and_then(|s| s.parse().ok()))
        .collect();
    if moe_layers.is_empty() {
        return Ok(());
    }
    w.retain(|k| !k.contains("mtp."));
    let c = Cfg(config);
    if c.b_or("tie_word_embeddings", false) {
        w.remove("lm_head.weight");
    }
    let n = c.size("num_experts", None, limits::EXPERTS)?;
    for l in moe_layers {
        let p = format!("model.layers.{l}.mlp");
        for proj in ["up_proj", "down_proj", "gate_proj"] {
            let parts =
                (0..n).map(|e| w.take(&format!("{p}.experts.{e}.{proj}.weight"))).collect::<Result<Vec<_>>>()?;
            if parts.windows(2).any(|a| a[0].shape() != a[1].shape()) {
                return Err(Error::ModelLoad(format!("weights {p}.experts.*.{proj}.weight differ in shape")));
            }
            let refs: Vec<&Array> = parts.iter().collect();
            w.insert(format!("{p}.switch_mlp.{proj}.weight"), mx::stack(&refs, 0)?);
        }
    }
    fix_conv_and_norms(w, true)
}

/// The norms whose stored weight is an offset from one in the Hugging Face layout.
const OFFSET_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// conv1d weights not yet in MLX's layout (last axis not 1) moved to `[C, K, 1]`; with `norms`,
/// the offset norms' 1-D weights get `+ 1`.
pub fn fix_conv_and_norms(w: &mut Weights, norms: bool) -> Result<()> {
    let keys: Vec<String> = w.keys().cloned().collect();
    for k in keys {
        let conv = k.contains("conv1d.weight");
        let norm = norms && OFFSET_NORMS.iter().any(|s| k.ends_with(s));
        if !conv && !norm {
            continue;
        }
        let v = w.take(&k)?;
        let v = if conv && v.ndim() == 3 && v.dim(-1) != 1 {
            mx::transpose_axes(&v, &[0, 2, 1])?
        } else if norm && v.ndim() == 1 {
            mx::add(&v, &mx::scalar_as(1.0, v.dtype())?)?
        } else {
            v
        };
        w.insert(k, v);
    }
    Ok(())
}

/// Everything the decoder is built from, read and checked once (the layout and the loader use it).
#[derive(Clone, Debug)]
pub struct Params {
    pub flavor: Flavor,
    pub model_type: String,
    pub d: Dims,
    pub intermediate: i32,
    pub lin_k_heads: i32,
    pub lin_v_heads: i32,
    pub lin_k_dim: i32,
    pub lin_v_dim: i32,
    pub conv_kernel: i32,
    /// Per layer: linear attention (else full attention).
    pub linear: Vec<bool>,
    pub ffn: Vec<FfnKind>,
    pub shared_intermediate: i32,
    pub rope_dims: i32,
    pub rope_theta: f32,
    pub rope_scaling: Option<Value>,
    pub eps: f32,
    pub tie: bool,
    pub attention_bias: bool,
    pub max_position_embeddings: Option<i32>,
}

/// mlx-lm's `qwen3_5.TextModelArgs` defaults.
const QWEN35_DEFAULTS: DimDefaults = DimDefaults {
    hidden: Some(4096),
    layers: Some(32),
    heads: Some(32),
    kv_heads: Some(8),
    head_dim: None,
    vocab: Some(151936),
};

impl Params {
    /// The text config of `config` (a multimodal Qwen3.5 config nests it in `text_config`).
    pub fn text(config: &Value) -> &Value {
        config.get("text_config").filter(|t| t.is_object()).unwrap_or(config)
    }

    pub fn from_config(config: &Value, flavor: Flavor) -> Result<Params> {
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("qwen3_next").to_string();
        let text = Params::text(config);
        let c = Cfg(text);
        let q35 = flavor == Flavor::Qwen35;
        let def = |v: i64| if q35 { Some(v) } else { None };
        let d = Dims::from_config(&c, if q35 { QWEN35_DEFAULTS } else { DimDefaults::default() })?;
        let intermediate = c.size("intermediate_size", def(14336), limits::INTERMEDIATE)?;
        let lin_v_heads = c.size("linear_num_value_heads", def(64), limits::HEADS)?;
        let lin_k_heads = c.size("linear_num_key_heads", def(16), limits::HEADS)?;
        let lin_k_dim = c.size("linear_key_head_dim", def(192), limits::HEAD_DIM)?;
        let lin_v_dim = c.size("linear_value_head_dim", def(128), limits::HEAD_DIM)?;
        let conv_kernel = c.size("linear_conv_kernel_dim", def(4), 64)?;
        if lin_v_heads % lin_k_heads != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: linear_num_value_heads {lin_v_heads} is not a multiple of linear_num_key_heads {lin_k_heads}"
            )));
        }
        if conv_kernel < 2 {
            return Err(Error::ModelLoad(format!(
                "config.json: linear_conv_kernel_dim = {conv_kernel}: the convolution state needs a kernel of at least 2"
            )));
        }
        let interval = c.size("full_attention_interval", Some(4), limits::LAYERS)?;
        let linear: Vec<bool> = (0..d.layers).map(|i| (i + 1) % interval != 0).collect();
        check_layer_types(&c, &linear, interval)?;

        // rotary parameters: Qwen3.5 reads them from rope_parameters (mlx-lm's defaults when absent)
        let (theta, partial, scaling) = match (q35, c.get("rope_parameters")) {
            (true, Some(rp)) if rp.as_object().is_some_and(|o| !o.is_empty()) => {
                let f = |k: &str, d: f64| rp.get(k).and_then(Value::as_f64).unwrap_or(d);
                (f("rope_theta", 100000.0), f("partial_rotary_factor", 0.25), Some(rp.clone()))
            }
            (true, None) => (100000.0, 0.25, None),
            _ => {
                let need = |k: &str, d: Option<f64>| -> Result<f64> {
                    match c.get(k) {
                        Some(v) => v
                            .as_f64()
                            .ok_or_else(|| Error::ModelLoad(format!("config.json: {k} = {v} is not a number"))),
                        None => d.ok_or_else(|| Error::ModelLoad(format!("config.json: {k} is missing"))),
                    }
                };
                let d35 = |v: f64| if q35 { Some(v) } else { None };
                (
                    need("rope_theta", d35(100000.0))?,
                    need("partial_rotary_factor", d35(0.25))?,
                    c.get("rope_scaling").cloned(),
                )
            }
        };
        let rope_dims = (d.head_dim as f64 * partial) as i32;
        if !(partial > 0.0 && partial <= 1.0) || rope_dims < 2 || rope_dims % 2 != 0 {
            return Err(Error::ModelLoad(format!(
                "config.json: partial_rotary_factor {partial} of head_dim {} gives {rope_dims} rotary dimensions (needs an even number >= 2)",
                d.head_dim
            )));
        }

        let experts = c.get("num_experts").and_then(Value::as_i64).unwrap_or(0);
        let moe = if experts > 0 {
            let experts = c.size("num_experts", None, limits::EXPERTS)?;
            let top_k = c.size("num_experts_per_tok", None, limits::EXPERTS)?;
            if top_k > experts {
                return Err(Error::ModelLoad(format!(
                    "config.json: num_experts_per_tok {top_k} exceeds num_experts {experts}"
                )));
            }
            Some(FfnKind::Moe {
                experts,
                top_k,
                intermediate: c.size("moe_intermediate_size", None, limits::INTERMEDIATE)?,
                shared: 1,
                norm_topk_prob: c.b_or("norm_topk_prob", q35),
            })
        } else {
            None
        };
        let shared_intermediate = match moe {
            Some(_) => c.size("shared_expert_intermediate_size", None, limits::INTERMEDIATE)?,
            None => 0,
        };
        let step = c.size("decoder_sparse_step", Some(1), limits::LAYERS)?;
        let mlp_only: Vec<i64> = c
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default();
        let ffn = (0..d.layers)
            .map(|i| match moe {
                // Qwen3.5: every layer; Qwen3-Next: mlx-lm's sparse-step rule
                Some(m) if q35 || (!mlp_only.contains(&(i as i64)) && (i + 1) % step == 0) => m,
                _ => FfnKind::Dense { intermediate },
            })
            .collect();
        Ok(Params {
            flavor,
            model_type,
            d,
            intermediate,
            lin_k_heads,
            lin_v_heads,
            lin_k_dim,
            lin_v_dim,
            conv_kernel,
            linear,
            ffn,
            shared_intermediate,
            rope_dims,
            rope_theta: theta as f32,
            rope_scaling: scaling,
            eps: c.f_or("rms_norm_eps", 1e-6) as f32,
            tie: c.b_or("tie_word_embeddings", false),
            attention_bias: c.b_or("attention_bias", false),
            max_position_embeddings: c.opt_i("max_position_embeddings"),
        })
    }

    /// The channels of a linear layer's causal convolution: q, k (`Hk × Dk` each) and v (`Hv × Dv`).
    pub fn conv_dim(&self) -> i32 {
        2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim
    }

    /// Linear-attention layers hold a recurrent state (no KV); the others a full KV cache.
    pub fn layout(&self) -> Vec<LayerLayout> {
        let recurrent = AttnKind::LinearRecurrent {
            conv: (self.conv_kernel - 1) * self.conv_dim(),
            state: self.lin_v_heads * self.lin_v_dim * self.lin_k_dim,
        };
        self.linear
            .iter()
            .zip(&self.ffn)
            .map(|(&lin, &ffn)| LayerLayout {
                attn: if lin { recurrent } else { AttnKind::Full },
                kv_heads: self.d.kv_heads,
                head_dim: self.d.head_dim,
                ffn,
            })
            .collect()
    }
}

/// mlx-lm places the layers by `full_attention_interval` alone; a `layer_types` list (Hugging
/// Face's) must name known kinds and agree with it, else the config is refused.
fn check_layer_types(c: &Cfg, linear: &[bool], interval: i32) -> Result<()> {
    let Some(v) = c.get("layer_types") else { return Ok(()) };
    let arr = v.as_array().ok_or_else(|| Error::ModelLoad(format!("config.json: layer_types = {v} is not a list")))?;
    if arr.len() != linear.len() {
        return Err(Error::ModelLoad(format!(
            "config.json: layer_types has {} entries but num_hidden_layers is {}",
            arr.len(),
            linear.len()
        )));
    }
    for (i, (t, &lin)) in arr.iter().zip(linear).enumerate() {
        let is_linear = match t.as_str() {
            Some("linear_attention") => true,
            Some("full_attention") => false,
            _ => {
                return Err(Error::ModelLoad(format!(
                    "config.json: layer_types[{i}] = {t} is not a known layer type (linear_attention, full_attention)"
                )))
            }
        };
        if is_linear != lin {
            return Err(Error::ModelLoad(format!(
                "config.json: layer_types[{i}] = {t} disagrees with full_attention_interval {interval} (which mlx-lm follows)"
            )));
        }
    }
    Ok(())
}

/// Softmax attention with an output gate: `q_proj` gives each head's query and gate.
struct GatedAttention {
    /// q_proj is the joint `[2 * heads * head_dim, hidden]` projection.
    attn: Attention,
}

/// Qwen3.5's multimodal rotary embedding (mlx-vlm's interleaved M-RoPE, `rope_utils.py`): rotated
/// frequency i turns by the t, h or w position as `selector[i]` says (h on every third from 1, w
/// on every third from 2, within 3 × their `mrope_section`; t elsewhere), cos and sin computed in
/// float32 and cast, the first `dims` channels rotated by halves.
pub struct MRope {
    inv_freq: Array,
    selector: Array,
    dims: i32,
}

impl MRope {
    pub fn new(dims: i32, base: f32, section: &[i32]) -> Result<MRope> {
        let f = dims / 2;
        let mut sel = vec![0i32; f as usize];
        for (dim, start) in [(1usize, 1i32), (2, 2)] {
            let mut i = start;
            while i < (section[dim] * 3).min(f) {
                sel[i as usize] = dim as i32;
                i += 3;
            }
        }
        let exps = mx::divide(&mx::arange(0.0, dims as f64, 2.0, Dtype::Float32)?, &Array::f32(dims as f32)?)?;
        let inv_freq = mx::divide(&Array::f32(1.0)?, &mx::power(&Array::f32(base)?, &exps)?)?;
        Ok(MRope { inv_freq, selector: Array::from_slice(&sel, &[f])?, dims })
    }

    /// cos and sin `[B, 1, L, dims]` in `dtype` of positions `[3, B, L]` (int32).
    fn cos_sin(&self, pos: &Array, dtype: Dtype) -> Result<(Array, Array)> {
        let p = mx::transpose_axes(&mx::take(pos, &self.selector, 0)?, &[1, 2, 0])?;
        let freqs = mx::multiply(&mx::astype(&p, Dtype::Float32)?, &self.inv_freq)?;
        let emb = mx::concatenate(&[&freqs, &freqs], -1)?;
        let c = mx::expand_dims(&mx::astype(&mx::cos(&emb)?, dtype)?, 1)?;
        let s = mx::expand_dims(&mx::astype(&mx::sin(&emb)?, dtype)?, 1)?;
        Ok((c, s))
    }

    /// `x` `[B, heads, L, head_dim]` rotated by `cs` (from [`MRope::cos_sin`]).
    fn apply(&self, x: &Array, cs: &(Array, Array)) -> Result<Array> {
        let d = x.dim(-1);
        let rot = mx::slice_axis(x, -1, 0, self.dims)?;
        let half = self.dims / 2;
        let rh = mx::concatenate(
            &[&mx::negative(&mx::slice_axis(&rot, -1, half, self.dims)?)?, &mx::slice_axis(&rot, -1, 0, half)?],
            -1,
        )?;
        let e = mx::astype(&mx::add(&mx::multiply(&rot, &cs.0)?, &mx::multiply(&rh, &cs.1)?)?, x.dtype())?;
        if self.dims == d {
            return Ok(e);
        }
        mx::concatenate(&[&e, &mx::slice_axis(x, -1, self.dims, d)?], -1)
    }
}

/// Per batch row, the M-RoPE cos and sin of this forward pass's positions (None: the row's
/// positions are its cache offsets, the ordinary rotary embedding).
type RowRopes = Vec<Option<(Array, Array)>>;

impl GatedAttention {
    /// Per row: the M-RoPE rotation where `ropes` gives one, the ordinary one at the cache's offset
    /// otherwise; then the cache update and attention.
    fn attend_rows(
        &self,
        q: Array,
        k: Array,
        v: Array,
        masks: &Masks,
        caches: LayerCaches,
        (mrope, ropes): (&MRope, &RowRopes),
    ) -> Result<Array> {
        let a = &self.attn;
        let (LayerCaches::Rows(mut rows), Masks::Rows(ms)) = (caches, masks) else {
            return Err(Error::Invalid("M-RoPE attention runs over per-row caches".into()));
        };
        let n = rows.len() as i32;
        let (qs, ks, vs) = if n == 1 {
            (vec![q], vec![k], vec![v])
        } else {
            (mx::split(&q, n, 0)?, mx::split(&k, n, 0)?, mx::split(&v, n, 0)?)
        };
        let mut outs = Vec::with_capacity(rows.len());
        for (r, ((q, k), v)) in qs.into_iter().zip(ks).zip(vs).enumerate() {
            let c = &mut *rows[r];
            let (q, k) = match &ropes[r] {
                Some(cs) => (mrope.apply(&q, cs)?, mrope.apply(&k, cs)?),
                None => (a.rope.forward(&q, c.offset())?, a.rope.forward(&k, c.offset())?),
            };
            let mask: &Mask = &ms[r];
            outs.push(attend_fetched(&q, &c.update_and_fetch(k, v)?, a.scale, mask, None)?);
        }
        if outs.len() == 1 {
            return Ok(outs.pop().expect("one row"));
        }
        let refs: Vec<&Array> = outs.iter().collect();
        mx::concatenate(&refs, 0)
    }

    fn forward(
        &self,
        x: &Array,
        masks: &Masks,
        caches: LayerCaches,
        mrope: Option<(&MRope, &RowRopes)>,
    ) -> Result<Array> {
        let a = &self.attn;
        let (b, l) = (x.dim(0), x.dim(1));
        let hd = a.head_dim;
        let (q_proj, k_proj, v_proj) =
            a.qkv.separate().ok_or_else(|| Error::Invalid("qwen3_next attention with fused q/k/v".into()))?;
        let qg = mx::reshape(&q_proj.forward(x)?, &[b, l, a.n_heads, 2 * hd])?;
        let q = mx::slice_axis(&qg, -1, 0, hd)?;
        let gate = mx::reshape(&mx::slice_axis(&qg, -1, hd, 2 * hd)?, &[b, l, a.n_heads * hd])?;
        let k = mx::reshape(&k_proj.forward(x)?, &[b, l, a.n_kv_heads, hd])?;
        let v = mx::reshape(&v_proj.forward(x)?, &[b, l, a.n_kv_heads, hd])?;
        let n = a.qk_norm.as_ref().ok_or_else(|| Error::Invalid("qwen3_next attention without qk-norm".into()))?;
        let perm = [0, 2, 1, 3];
        let q = mx::transpose_axes(&n.q.forward(&q)?, &perm)?;
        let k = mx::transpose_axes(&n.k.forward(&k)?, &perm)?;
        let v = mx::transpose_axes(&v, &perm)?;
        let out = match mrope {
            Some(mr) => self.attend_rows(q, k, v, masks, caches, mr)?,
            None => a.attend_many(q, k, v, masks, caches, None)?,
        };
        let out = mx::reshape(&mx::transpose_axes(&out, &perm)?, &[b, l, -1])?;
        a.o_proj.forward(&mx::multiply(&out, &mx::sigmoid(&gate)?)?)
    }
}

/// The input projections of a Gated DeltaNet layer: Qwen3-Next's two interleaved ones (per key
/// head: q, k, v, z and b, a) or Qwen3.5's four separate ones.
enum DeltaProj {
    Joint { qkvz: Linear, ba: Linear },
    Split { qkv: Linear, z: Linear, b: Linear, a: Linear },
}

/// Gated DeltaNet linear attention (mlx-lm's `Qwen3NextGatedDeltaNet` / `qwen3_5.GatedDeltaNet`).
struct GatedDeltaNet {
    proj: DeltaProj,
    /// `[conv_dim, kernel, 1]` (depthwise).
    conv_w: Array,
    dt_bias: Array,
    a_log: Array,
    norm: RmsNorm,
    out_proj: Linear,
    nk: i32,
    nv: i32,
    dk: i32,
    dv: i32,
    kernel: i32,
}

/// `x * sigmoid(x)` (mlx.nn.silu).
fn silu(x: &Array) -> Result<Array> {
    mx::multiply(x, &mx::sigmoid(x)?)
}

impl GatedDeltaNet {
    fn load(w: &mut Weights, p: &str, prm: &Params) -> Result<GatedDeltaNet> {
        let (nk, nv, dk, dv, hidden) = (prm.lin_k_heads, prm.lin_v_heads, prm.lin_k_dim, prm.lin_v_dim, prm.d.hidden);
        let (key_dim, value_dim) = (nk * dk, nv * dv);
        let conv_dim = prm.conv_dim();
        let proj = match prm.flavor {
            Flavor::Next => DeltaProj::Joint {
                qkvz: Linear::load(w, &format!("{p}.in_proj_qkvz"), false, 2 * key_dim + 2 * value_dim, hidden)?,
                ba: Linear::load(w, &format!("{p}.in_proj_ba"), false, 2 * nv, hidden)?,
            },
            Flavor::Qwen35 => DeltaProj::Split {
                qkv: Linear::load(w, &format!("{p}.in_proj_qkv"), false, conv_dim, hidden)?,
                z: Linear::load(w, &format!("{p}.in_proj_z"), false, value_dim, hidden)?,
                b: Linear::load(w, &format!("{p}.in_proj_b"), false, nv, hidden)?,
                a: Linear::load(w, &format!("{p}.in_proj_a"), false, nv, hidden)?,
            },
        };
        Ok(GatedDeltaNet {
            proj,
            conv_w: w.take_shaped(&format!("{p}.conv1d.weight"), &[conv_dim, prm.conv_kernel, 1])?,
            dt_bias: w.take_shaped(&format!("{p}.dt_bias"), &[nv])?,
            a_log: w.take_shaped(&format!("{p}.A_log"), &[nv])?,
            norm: RmsNorm::load(w, &format!("{p}.norm"), prm.eps, dv)?,
            out_proj: Linear::load(w, &format!("{p}.out_proj"), false, hidden, value_dim)?,
            nk,
            nv,
            dk,
            dv,
            kernel: prm.conv_kernel,
        })
    }

    /// `(qkv [B, S, conv_dim], z [B, S, Hv, Dv], b [B, S, Hv], a [B, S, Hv])`.
    fn project(&self, x: &Array) -> Result<(Array, Array, Array, Array)> {
        let (bsz, s) = (x.dim(0), x.dim(1));
        let (nk, nv, dk, dv) = (self.nk, self.nv, self.dk, self.dv);
        match &self.proj {
            DeltaProj::Joint { qkvz, ba } => {
                // mlx-lm's fix_query_key_value_ordering: per key head [q | k | v | z] and [b | a]
                let m = mx::reshape(&qkvz.forward(x)?, &[bsz, s, nk, -1])?;
                let r = nv / nk * dv;
                let q = mx::slice_axis(&m, -1, 0, dk)?;
                let k = mx::slice_axis(&m, -1, dk, 2 * dk)?;
                let v = mx::slice_axis(&m, -1, 2 * dk, 2 * dk + r)?;
                let z = mx::slice_axis(&m, -1, 2 * dk + r, 2 * dk + 2 * r)?;
                let mba = mx::reshape(&ba.forward(x)?, &[bsz, s, nk, -1])?;
                let b = mx::reshape(&mx::slice_axis(&mba, -1, 0, nv / nk)?, &[bsz, s, nv])?;
                let a = mx::reshape(&mx::slice_axis(&mba, -1, nv / nk, 2 * (nv / nk))?, &[bsz, s, nv])?;
                let flat = |t: &Array| mx::reshape(t, &[bsz, s, -1]);
                let qkv = mx::concatenate(&[&flat(&q)?, &flat(&k)?, &flat(&v)?], -1)?;
                Ok((qkv, mx::reshape(&z, &[bsz, s, -1, dv])?, b, a))
            }
            DeltaProj::Split { qkv, z, b, a } => {
                Ok((qkv.forward(x)?, mx::reshape(&z.forward(x)?, &[bsz, s, nv, dv])?, b.forward(x)?, a.forward(x)?))
            }
        }
    }

    /// `x` `[B, S, hidden]`, row b continuing the recurrent state of `caches[b]`.
    fn forward(&self, x: &Array, caches: LayerCaches) -> Result<Array> {
        let LayerCaches::Rows(mut rows) = caches else {
            return Err(Error::Invalid("a linear-attention layer cannot run over the stacked KV".into()));
        };
        let (bsz, s) = (x.dim(0), x.dim(1));
        if rows.len() != bsz as usize {
            return Err(Error::Invalid(format!("linear attention: {} caches for a batch of {bsz}", rows.len())));
        }
        let (qkv, z, b, a) = self.project(x)?;
        let conv_dim = qkv.dim(-1);
        let keep = self.kernel - 1;
        // the rows' convolution and recurrent states (zeros where a row has none yet)
        let mut convs = Vec::with_capacity(rows.len());
        let mut states = Vec::with_capacity(rows.len());
        for c in rows.iter() {
            let LayerCache::Recurrent(rc) = &**c else {
                return Err(Error::Invalid("a linear-attention layer needs a recurrent cache".into()));
            };
            convs.push(match &rc.conv {
                Some(a) => a.clone(),
                None => mx::zeros(&[1, keep, conv_dim], x.dtype())?,
            });
            states.push(match &rc.state {
                Some(a) => a.clone(),
                None => mx::zeros(&[1, self.nv, self.dv, self.dk], Dtype::Float32)?,
            });
        }
        let cat = |v: &[Array]| -> Result<Array> {
            if v.len() == 1 {
                return Ok(v[0].clone());
            }
            let refs: Vec<&Array> = v.iter().collect();
            mx::concatenate(&refs, 0)
        };
        let conv_input = mx::concatenate(&[&cat(&convs)?, &qkv], 1)?;
        let new_conv = mx::contiguous(&mx::slice_axis(&conv_input, 1, s, s + keep)?)?;
        let conv_out = silu(&mx::conv1d(&conv_input, &self.conv_w, 1, 0, 1, conv_dim)?)?;
        let (kd, vd) = (self.nk * self.dk, self.nv * self.dv);
        let q = mx::reshape(&mx::slice_axis(&conv_out, -1, 0, kd)?, &[bsz, s, self.nk, self.dk])?;
        let k = mx::reshape(&mx::slice_axis(&conv_out, -1, kd, 2 * kd)?, &[bsz, s, self.nk, self.dk])?;
        let v = mx::reshape(&mx::slice_axis(&conv_out, -1, 2 * kd, 2 * kd + vd)?, &[bsz, s, self.nv, self.dv])?;
        let (q, k) = normalize_qk(&q, &k, (self.dk as f64).powf(-0.5), 1e-6)?;
        let (out, state) = gated_delta_update(&q, &k, &v, &a, &b, &self.a_log, &self.dt_bias, cat(&states)?)?;
        // back into each row's cache
        let split = |t: &Array| -> Result<Vec<Array>> {
            if bsz == 1 {
                Ok(vec![t.clone()])
            } else {
                mx::split(t, bsz, 0)
            }
        };
        for ((c, conv), st) in rows.iter_mut().zip(split(&new_conv)?).zip(split(&state)?) {
            if let LayerCache::Recurrent(rc) = &mut **c {
                rc.conv = Some(conv);
                rc.state = Some(st);
                rc.offset += s;
            }
        }
        // RMSNormGated with a gate: precise_swiglu(out, z, rms_norm(out))
        let normed = self.norm.forward(&out)?;
        let g = silu(&mx::astype(&z, Dtype::Float32)?)?;
        let y = mx::astype(&mx::multiply(&g, &mx::astype(&normed, Dtype::Float32)?)?, out.dtype())?;
        self.out_proj.forward(&mx::reshape(&y, &[bsz, s, -1])?)
    }
}

/// mlx-lm's `normalize_qk`: L2-normalised q and k (through rms_norm), the `Dk^-0.5` readout scale
/// folded into q.
pub fn normalize_qk(q: &Array, k: &Array, inv_scale: f64, eps: f64) -> Result<(Array, Array)> {
    let rms_eps = (eps * inv_scale * inv_scale) as f32;
    let q = mx::multiply(&mx::scalar_as(inv_scale * inv_scale, q.dtype())?, &mx::rms_norm(q, None, rms_eps)?)?;
    let k = mx::multiply(&mx::scalar_as(inv_scale, k.dtype())?, &mx::rms_norm(k, None, rms_eps)?)?;
    Ok((q, k))
}

/// mlx-lm's `gated_delta_update`: `beta = sigmoid(b)`,
/// `g = exp(-exp(A_log) * softplus(a + dt_bias))` (float32), then the recurrence: the CUDA kernel
/// where [`super::gated_delta::path`] picks it, else [`gated_delta_ops`].
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_update(
    q: &Array,
    k: &Array,
    v: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    state: Array,
) -> Result<(Array, Array)> {
    let beta = mx::sigmoid(b)?;
    let x = mx::add(a, dt_bias)?;
    let softplus = mx::logaddexp(&x, &mx::scalar_as(0.0, x.dtype())?)?;
    let decay = mx::negative(&mx::exp(&mx::astype(a_log, Dtype::Float32)?)?)?;
    let g = mx::exp(&mx::multiply(&decay, &softplus)?)?;
    match super::gated_delta::path(k.dim(-1)) {
        super::gated_delta::Path::CudaKernel => super::gated_delta::kernel(q, k, v, &g, &beta, &state),
        super::gated_delta::Path::MetalKernel => super::gated_delta::metal_kernel(q, k, v, &g, &beta, &state),
        super::gated_delta::Path::Reference => gated_delta_ops(q, k, v, &g, &beta, state),
    }
}

/// mlx-lm's `gated_delta_ops`, the sequential reference recurrence: q, k `[B, T, Hk, Dk]`, v
/// `[B, T, Hv, Dv]`, g and beta `[B, T, Hv]`, state `[B, Hv, Dv, Dk]`; returns y `[B, T, Hv, Dv]`
/// (q's dtype) and the new state. Each token is one call of [`delta_step`], compiled as mlx-lm
/// compiles its `_gated_delta_step_ops` (traced once per shape).
pub fn gated_delta_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: Array,
) -> Result<(Array, Array)> {
    static STEP: std::sync::OnceLock<Option<std::sync::Mutex<mx::Compiled>>> = std::sync::OnceLock::new();
    let compiled = STEP.get_or_init(|| mx::Compiled::new(delta_step, false).ok().map(std::sync::Mutex::new));
    let (hk, hv) = (q.dim(2), v.dim(2));
    let (q, k) =
        if hv / hk > 1 { (mx::repeat(q, hv / hk, -2)?, mx::repeat(k, hv / hk, -2)?) } else { (q.clone(), k.clone()) };
    let t_len = q.dim(1);
    let at = |x: &Array, t: i32| -> Result<Array> { mx::squeeze(&mx::slice_axis(x, 1, t, t + 1)?, &[1]) };
    let mut state = state;
    let mut ys = Vec::with_capacity(t_len as usize);
    for t in 0..t_len {
        let args = [at(&q, t)?, at(&k, t)?, at(v, t)?, at(g, t)?, at(beta, t)?, state];
        let mut out = match compiled {
            Some(c) => c.lock().unwrap_or_else(|e| e.into_inner()).call(&args.iter().collect::<Vec<_>>())?,
            None => delta_step(&args)?,
        };
        state = out.pop().ok_or_else(|| Error::Mlx("delta step returned nothing".into()))?;
        ys.push(out.pop().ok_or_else(|| Error::Mlx("delta step returned no output".into()))?);
    }
    let refs: Vec<&Array> = ys.iter().collect();
    Ok((mx::stack(&refs, 1)?, state))
}

/// One token of the gated delta rule (mlx-lm's `_gated_delta_step_ops`, scalar gating, no mask):
/// `[q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dv, Dk]]` → `[y (q's dtype), state]`:
/// `S = g S; S += k (beta (v - S k))^T; y = S q`.
fn delta_step(a: &[Array]) -> Result<Vec<Array>> {
    let [qt, kt, vt, gt, bt, state] = a else {
        return Err(Error::Invalid(format!("delta step: {} inputs, not 6", a.len())));
    };
    let decay = mx::expand_dims(&mx::expand_dims(gt, -1)?, -1)?;
    let state = mx::multiply(state, &decay)?;
    let kx = mx::expand_dims(kt, -2)?; // [B, H, 1, Dk]
    let kv_mem = mx::sum(&mx::multiply(&state, &kx)?, &[-1], false)?; // [B, H, Dv]
    let delta = mx::multiply(&mx::subtract(vt, &kv_mem)?, &mx::expand_dims(bt, -1)?)?;
    let state = mx::add(&state, &mx::multiply(&kx, &mx::expand_dims(&delta, -1)?)?)?;
    let y = mx::sum(&mx::multiply(&state, &mx::expand_dims(qt, -2)?)?, &[-1], false)?;
    Ok(vec![mx::astype(&y, qt.dtype())?, state])
}

/// A sparse MoE plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`
/// (mlx-lm's `Qwen3NextSparseMoeBlock`).
struct SharedMoe {
    moe: SparseMoe,
    shared: Mlp,
    shared_gate: Linear,
}

enum Ffn {
    Dense(Mlp),
    Moe(Box<SharedMoe>),
}

impl Ffn {
    fn load(w: &mut Weights, p: &str, kind: FfnKind, prm: &Params) -> Result<Ffn> {
        let hidden = prm.d.hidden;
        Ok(match kind {
            FfnKind::Dense { intermediate } => {
                Ffn::Dense(Mlp::load(w, p, false, Activation::Silu, hidden, intermediate)?)
            }
            FfnKind::Moe { experts, top_k, intermediate, norm_topk_prob, .. } => {
                let mut moe = SparseMoe::load(w, p, experts, top_k, intermediate, hidden)?;
                moe.norm_topk_prob = norm_topk_prob;
                Ffn::Moe(Box::new(SharedMoe {
                    moe,
                    shared: Mlp::load(
                        w,
                        &format!("{p}.shared_expert"),
                        false,
                        Activation::Silu,
                        hidden,
                        prm.shared_intermediate,
                    )?,
                    shared_gate: Linear::load(w, &format!("{p}.shared_expert_gate"), false, 1, hidden)?,
                }))
            }
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => {
                let y = m.moe.forward(x)?;
                let s = mx::multiply(&mx::sigmoid(&m.shared_gate.forward(x)?)?, &m.shared.forward(x)?)?;
                mx::add(&y, &s)
            }
        }
    }
}

enum Mixer {
    Linear(GatedDeltaNet),
    Attn(GatedAttention),
}

struct Block {
    mixer: Mixer,
    mlp: Ffn,
    in_norm: RmsNorm,
    post_norm: RmsNorm,
}

pub struct Model {
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// The first linear-attention layer (its cache keeps a sequence's M-RoPE delta).
    lin_idx: Option<usize>,
    /// Qwen3.5's multimodal rotary embedding (rope_parameters.mrope_section), for prompts with images.
    mrope: Option<MRope>,
    shape: ModelShape,
}

impl Model {
    /// The decoder of a sanitized checkpoint (`model.*`, `lm_head.*` names).
    pub fn load(config: &Value, mut w: Weights, flavor: Flavor) -> Result<Model> {
        let prm = Params::from_config(config, flavor)?;
        let d = prm.d;
        let (hidden, hd) = (d.hidden, d.head_dim);
        let mut layers = Vec::with_capacity(d.layers as usize);
        for (i, (&lin, &ffn)) in prm.linear.iter().zip(&prm.ffn).enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = if lin {
                Mixer::Linear(GatedDeltaNet::load(&mut w, &format!("{p}.linear_attn"), &prm)?)
            } else {
                let a = format!("{p}.self_attn");
                let bias = prm.attention_bias;
                Mixer::Attn(GatedAttention {
                    attn: Attention {
                        // the queries with their gate (twice the width): never fused
                        qkv: Qkv::load(&mut w, &a, bias, 2 * d.heads * hd, d.kv_heads * hd, hidden)?,
                        o_proj: Linear::load(&mut w, &format!("{a}.o_proj"), bias, hidden, d.heads * hd)?,
                        qk_norm: Some(QkNorm {
                            q: RmsNorm::load(&mut w, &format!("{a}.q_norm"), prm.eps, hd)?,
                            k: RmsNorm::load(&mut w, &format!("{a}.k_norm"), prm.eps, hd)?,
                        }),
                        n_heads: d.heads,
                        n_kv_heads: d.kv_heads,
                        head_dim: hd,
                        scale: (hd as f32).powf(-0.5),
                        rope: Rope::from_config(prm.rope_dims, prm.rope_theta, false, prm.rope_scaling.as_ref())?,
                    },
                })
            };
            layers.push(Block {
                mixer,
                mlp: Ffn::load(&mut w, &format!("{p}.mlp"), ffn, &prm)?,
                in_norm: RmsNorm::load(&mut w, &format!("{p}.input_layernorm"), prm.eps, hidden)?,
                post_norm: RmsNorm::load(&mut w, &format!("{p}.post_attention_layernorm"), prm.eps, hidden)?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", d.vocab, hidden)?;
        let norm = RmsNorm::load(&mut w, "model.norm", prm.eps, hidden)?;
        let lm_head = if prm.tie { None } else { Some(Linear::load(&mut w, "lm_head", false, embed.rows(), hidden)?) };
        let dtype_bytes = embed.dtype().size();
        let mrope = match prm.rope_scaling.as_ref().and_then(|r| r.get("mrope_section")) {
            Some(sec) if prm.flavor == Flavor::Qwen35 => {
                let s: Vec<i32> = sec
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_i64)
                            .filter(|&v| (0..=1 << 16).contains(&v))
                            .map(|v| v as i32)
                            .collect()
                    })
                    .unwrap_or_default();
                if s.len() != 3 || sec.as_array().map_or(0, Vec::len) != 3 {
                    return Err(Error::ModelLoad(format!(
                        "config.json: rope_parameters.mrope_section = {sec} is not three sizes (t, h, w)"
                    )));
                }
                Some(MRope::new(prm.rope_dims, prm.rope_theta, &s)?)
            }
            _ => None,
        };
        Ok(Model {
            lin_idx: prm.linear.iter().position(|&l| l),
            mrope,
            shape: ModelShape::new(
                &prm.model_type,
                prm.layout(),
                hidden,
                d.vocab,
                prm.max_position_embeddings,
                dtype_bytes,
            ),
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

impl CausalLm for Model {
    fn forward_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.hidden_caches(tokens, caches, staging)?;
        self.embed.logits(self.lm_head.as_ref(), &h)
    }

    fn hidden_caches(&self, tokens: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let h = self.embed.forward(tokens)?;
        let ropes = self.delta_ropes(caches, tokens.dim(1), h.dtype())?;
        self.run(h, ropes, caches, staging)
    }

    fn embed_tokens(&self, tokens: &Array) -> Result<Array> {
        self.embed.forward(tokens)
    }

    /// Plain input embeddings `[B, L, hidden]`, or a prompt with images as Qwen3.5's vision tower
    /// merges it (`vision::qwen3_5`): `[B, L, hidden + 4]` (float32), each token's (t, h, w) M-RoPE
    /// positions and the sequence's position delta in the trailing columns; the delta is kept in
    /// the row's cache for the tokens that follow.
    fn forward_embeds(&self, embeds: &Array, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let hidden = self.shape.hidden_size;
        let w = embeds.dim(-1);
        let h = if w == hidden {
            let ropes = self.delta_ropes(caches, embeds.dim(1), embeds.dtype())?;
            self.run(embeds.clone(), ropes, caches, staging)?
        } else {
            let Some(m) = self.mrope.as_ref().filter(|_| w == hidden + 4) else {
                return Err(Error::Invalid(format!(
                    "input embeddings of width {w}: this model takes {hidden} (or {} with M-RoPE positions)",
                    hidden + 4
                )));
            };
            let x = mx::astype(&mx::slice_axis(embeds, -1, 0, hidden)?, self.embed.dtype())?;
            let cols = mx::slice_axis(embeds, -1, hidden, hidden + 4)?;
            let pos = mx::astype(&mx::transpose_axes(&mx::slice_axis(&cols, -1, 0, 3)?, &[2, 0, 1])?, Dtype::Int32)?;
            let deltas = mx::astype(&mx::slice_axis(&mx::slice_axis(&cols, 1, 0, 1)?, -1, 3, 4)?, Dtype::Int32)?
                .to_vec::<i32>()?;
            let lin = self.lin_idx.ok_or_else(|| {
                Error::Unsupported("M-RoPE positions need a linear-attention layer to keep their delta".into())
            })?;
            let LayerCaches::Rows(mut rows) = caches.layer_mut(lin) else {
                return Err(Error::Invalid("a linear-attention layer cannot run over the stacked KV".into()));
            };
            for (c, &d) in rows.iter_mut().zip(&deltas) {
                if let LayerCache::Recurrent(rc) = &mut **c {
                    rc.rope_delta = Some(d);
                }
            }
            let b = x.dim(0);
            let ropes = (0..b)
                .map(|r| Ok(Some(m.cos_sin(&mx::slice_axis(&pos, 1, r, r + 1)?, x.dtype())?)))
                .collect::<Result<RowRopes>>()?;
            self.run(x, Some(ropes), caches, staging)?
        };
        self.embed.logits(self.lm_head.as_ref(), &h)
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }
}

impl Model {
    /// The M-RoPE rotations of `n` new tokens for rows whose sequence had images (their positions
    /// run `rope_delta` behind their offsets, all three equal); None when no row had any.
    fn delta_ropes(&self, caches: &mut Caches, n: i32, dtype: Dtype) -> Result<Option<RowRopes>> {
        let (Some(m), Some(lin)) = (&self.mrope, self.lin_idx) else { return Ok(None) };
        let LayerCaches::Rows(rows) = caches.layer_mut(lin) else { return Ok(None) };
        let rows: Vec<(Option<i32>, i32)> = rows
            .iter()
            .map(|c| match &**c {
                LayerCache::Recurrent(rc) => (rc.rope_delta, rc.offset),
                other => (None, other.offset()),
            })
            .collect();
        if rows.iter().all(|(d, _)| d.is_none()) {
            return Ok(None);
        }
        let ropes = rows
            .into_iter()
            .map(|(d, off)| {
                d.map(|d| {
                    let p: Vec<i32> = (0..n).map(|i| off + d + i).collect();
                    let p = mx::broadcast_to(&Array::from_slice(&p, &[1, 1, n])?, &[3, 1, n])?;
                    m.cos_sin(&p, dtype)
                })
                .transpose()
            })
            .collect::<Result<RowRopes>>()?;
        Ok(Some(ropes))
    }

    /// The decoder over embeddings `h` (M-RoPE rotations per row where `ropes` gives them).
    fn run(&self, h: Array, ropes: Option<RowRopes>, caches: &mut Caches, staging: super::Staging) -> Result<Array> {
        let kinds = self.layers.iter().map(|l| matches!(l.mixer, Mixer::Attn(_)).then_some(false));
        let masks = super::LayerMasks::new(caches, h.dim(1), kinds, None)?;
        let h = super::run_layers(self.layers.len(), h, caches, staging, |i, h, caches| {
            let layer = &self.layers[i];
            let mixer = |x: &Array| match &layer.mixer {
                Mixer::Linear(m) => m.forward(x, caches.layer_mut(i)),
                Mixer::Attn(m) => {
                    let mr = match (&self.mrope, &ropes) {
                        (Some(mr), Some(r)) => Some((mr, r)),
                        _ => None,
                    };
                    m.forward(x, masks.get(false)?, caches.layer_mut(i), mr)
                }
            };
            super::pre_norm_residual(h, &layer.in_norm, mixer, &layer.post_norm, |x| layer.mlp.forward(x))
        })?;
        self.norm.forward(&h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::arch::layout_of;
    use serde_json::json;

    fn cfg(mt: &str) -> Value {
        json!({"model_type": mt, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "intermediate_size": 512,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
               "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
               "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6})
    }

    fn err(c: &Value) -> String {
        layout_of(c).unwrap().unwrap_err().to_string()
    }

    #[test]
    fn linear_layers_hold_no_kv() {
        let l = layout_of(&cfg("qwen3_next")).unwrap().unwrap();
        let attn: Vec<_> = l.iter().map(|l| l.attn).collect();
        // conv: (kernel 4 - 1) × (2 × 2 × 32 + 4 × 32) elements; state: 4 value heads × 32 × 32
        let lin = AttnKind::LinearRecurrent { conv: 3 * 256, state: 4 * 32 * 32 };
        assert_eq!(attn, [lin, AttnKind::Full, lin, AttnKind::Full]);
        let shape = ModelShape::new("qwen3_next", l.clone(), 256, 512, None, 4);
        // two full layers of 2 KV heads × 64 × K,V, 256 slots, 4 bytes; the linear layers no KV but
        // their fixed state: conv (4 - 1) × (2 × 2 × 32 + 4 × 32) float32 + state 4 × 32 × 32 float32
        let state = 2 * (3 * 256 * 4 + 4 * 32 * 32 * 4);
        assert_eq!(shape.state_bytes(), state);
        assert_eq!(shape.kv_bytes(10, None, 64), 2 * 256 * (2 * 64 * 2) * 4 + state);
        // quantized KV leaves the state as it is
        assert_eq!(shape.kv_bytes(10, Some(8), 64), (2.0 * 256.0 * 256.0 * (1.0 + 8.0 / 64.0)) as usize + state);
        let caches = crate::models::arch::make_cache(&l, &Default::default());
        assert!(matches!(caches[0], LayerCache::Recurrent(_)) && matches!(caches[1], LayerCache::Full(_)));
        // a multimodal Qwen3.5 config: the text model in text_config
        let wrapped = json!({"model_type": "qwen3_5", "text_config": cfg("qwen3_5")});
        assert_eq!(layout_of(&wrapped).unwrap().unwrap(), layout_of(&cfg("qwen3_5")).unwrap().unwrap());
    }

    #[test]
    fn bad_configs_are_refused_naming_the_field() {
        let mut c = cfg("qwen3_next");
        c["layer_types"] = json!(["linear_attention", "sliding_attention", "linear_attention", "full_attention"]);
        assert!(err(&c).contains("layer_types[1] = \"sliding_attention\" is not a known layer type"), "{}", err(&c));
        c["layer_types"] = json!(["linear_attention", "linear_attention", "linear_attention", "full_attention"]);
        assert!(err(&c).contains("layer_types[1]") && err(&c).contains("full_attention_interval"));
        c["layer_types"] = json!(["linear_attention"]);
        assert!(err(&c).contains("layer_types has 1 entries"));
        let mut c = cfg("qwen3_next");
        c["linear_num_value_heads"] = json!(3);
        assert!(err(&c).contains("linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"));
        let mut c = cfg("qwen3_next");
        c["partial_rotary_factor"] = json!(0.01);
        assert!(err(&c).contains("partial_rotary_factor"));
        let mut c = cfg("qwen3_next");
        c.as_object_mut().unwrap().remove("linear_key_head_dim");
        assert!(err(&c).contains("linear_key_head_dim is missing"));
        let mut c = cfg("qwen3_next");
        c["linear_conv_kernel_dim"] = json!(1);
        assert!(err(&c).contains("linear_conv_kernel_dim"));
        let mut c = cfg("qwen3_5");
        c["num_attention_heads"] = json!(3);
        assert!(err(&c).contains("num_attention_heads 3 is not a multiple"));
    }

    /// The layout's state bytes are what a linear layer's cache holds after a prefill (alone and
    /// for each row of a batch), in float32 and bfloat16: the planner and the admission count the
    /// arrays the engine keeps.
    #[test]
    fn the_layout_state_bytes_are_the_cache_arrays() {
        let mut c = cfg("qwen3_5");
        c["linear_value_head_dim"] = json!(16);
        c["linear_conv_kernel_dim"] = json!(3);
        let prm = Params::from_config(&c, Flavor::Qwen35).unwrap();
        let layer = prm.layout()[0];
        assert!(matches!(layer.attn, AttnKind::LinearRecurrent { .. }));
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let (h, conv_dim, nv, vd) = (256, prm.conv_dim(), 4, 4 * 16);
            let r = |seed: u64, shape: &[i32]| {
                mx::astype(&mx::multiply(&randn(seed, shape), &Array::scalar(0.1f32).unwrap()).unwrap(), dtype).unwrap()
            };
            let mut map = std::collections::HashMap::new();
            for (n, shape) in [
                ("in_proj_qkv.weight", vec![conv_dim, h]),
                ("in_proj_z.weight", vec![vd, h]),
                ("in_proj_b.weight", vec![nv, h]),
                ("in_proj_a.weight", vec![nv, h]),
                ("conv1d.weight", vec![conv_dim, 3, 1]),
                ("dt_bias", vec![nv]),
                ("A_log", vec![nv]),
                ("norm.weight", vec![16]),
                ("out_proj.weight", vec![h, vd]),
            ] {
                map.insert(format!("l.{n}"), r(map.len() as u64 + 10, &shape));
            }
            let mut w = crate::weights::Weights::from_map(map, &c).unwrap();
            let net = GatedDeltaNet::load(&mut w, "l", &prm).unwrap();
            let act = if dtype == Dtype::Float32 { 4 } else { 2 };
            let mut caches = crate::models::arch::make_cache(&[layer, layer], &Default::default());
            let (a, b) = caches.split_at_mut(1);
            // one row of 7 tokens, then a batch of two rows (one new, one continuing) of 3
            net.forward(&r(1, &[1, 7, h]), LayerCaches::Rows(vec![&mut a[0]])).unwrap();
            net.forward(&r(2, &[2, 3, h]), LayerCaches::Rows(vec![&mut a[0], &mut b[0]])).unwrap();
            for c in &caches {
                let LayerCache::Recurrent(rc) = c else { panic!("not a recurrent cache") };
                assert_eq!(rc.conv.as_ref().unwrap().dtype(), dtype);
                assert_eq!(c.nbytes(), layer.state_bytes(act), "{dtype:?}");
            }
        }
    }

    fn randn(seed: u64, shape: &[i32]) -> Array {
        mx::random_normal(shape, Dtype::Float32, &mx::random_key(seed).unwrap()).unwrap()
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        let d = mx::abs(&mx::subtract(a, b).unwrap()).unwrap();
        d.to_vec::<f32>().unwrap().into_iter().fold(0.0, f32::max)
    }

    /// The recurrence over a prompt in chunks, the state carried between them, gives exactly the
    /// outputs and final state of one pass (the engine prefills in chunks).
    #[test]
    fn chunked_recurrence_equals_one_pass() {
        let (b, t, hk, hv, dk, dv) = (2, 7, 1, 2, 8, 4);
        let q = randn(1, &[b, t, hk, dk]);
        let k = randn(2, &[b, t, hk, dk]);
        let v = randn(3, &[b, t, hv, dv]);
        let g = mx::sigmoid(&randn(4, &[b, t, hv])).unwrap();
        let beta = mx::sigmoid(&randn(5, &[b, t, hv])).unwrap();
        let s0 = mx::zeros(&[b, hv, dv, dk], Dtype::Float32).unwrap();
        let (y, s) = gated_delta_ops(&q, &k, &v, &g, &beta, s0.clone()).unwrap();
        let cut = |x: &Array, lo: i32, hi: i32| mx::slice_axis(x, 1, lo, hi).unwrap();
        let (y1, s1) =
            gated_delta_ops(&cut(&q, 0, 3), &cut(&k, 0, 3), &cut(&v, 0, 3), &cut(&g, 0, 3), &cut(&beta, 0, 3), s0)
                .unwrap();
        let (y2, s2) =
            gated_delta_ops(&cut(&q, 3, t), &cut(&k, 3, t), &cut(&v, 3, t), &cut(&g, 3, t), &cut(&beta, 3, t), s1)
                .unwrap();
        assert_eq!(max_abs_diff(&mx::concatenate(&[&y1, &y2], 1).unwrap(), &y), 0.0);
        assert_eq!(max_abs_diff(&s2, &s), 0.0);
        // and the recurrence does something: a zero state and a nonzero one differ
        assert!(max_abs_diff(&s, &mx::zeros(&[b, hv, dv, dk], Dtype::Float32).unwrap()) > 1e-3);
    }
}
