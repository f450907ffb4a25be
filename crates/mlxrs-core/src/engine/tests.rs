//! The scheduler without Python: a tiny random-weight llama written to a temporary directory, driven
//! through `Engine::submit` like the bindings do. Each sequence of a batch (rows joining and leaving
//! at different steps) gets exactly its greedy tokens alone; a cancelled row leaves the others
//! unchanged; the queue refuses past its bound; the stacked KV is what ran.
use super::*;
use crate::handle::{self as mx, Array, Dtype};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

const V: i32 = 64;
const H: i32 = 64;

/// A directory removed when dropped.
pub(super) struct TempDir(std::path::PathBuf);

impl TempDir {
    pub(super) fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(super) fn tiny_llama() -> TempDir {
    tiny_llama_hd(16)
}

/// [`tiny_llama`] with heads of `hd` dimensions (a quantized KV cache needs 32 or more).
pub(super) fn tiny_llama_hd(hd: i32) -> TempDir {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = TempDir(std::env::temp_dir().join(format!("mlxrs-engine-test-{}-{n}", std::process::id())));
    std::fs::create_dir_all(dir.path()).unwrap();
    let d = dir.path();
    let cfg = serde_json::json!({
        "model_type": "llama", "hidden_size": H, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hd, "rms_norm_eps": 1e-6,
        "vocab_size": V, "rope_theta": 10000.0, "max_position_embeddings": 1024, "eos_token_id": 0,
        "tie_word_embeddings": false,
    });
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let mut seed = 0u64;
    let mut rand = |shape: &[i32]| -> Array {
        seed += 1;
        let a = mx::random_normal(shape, Dtype::Float32, &mx::random_key(seed).unwrap()).unwrap();
        mx::multiply(&a, &Array::scalar(0.3f32).unwrap()).unwrap()
    };
    let mut w = BTreeMap::new();
    w.insert("model.embed_tokens.weight".to_string(), rand(&[V, H]));
    w.insert("lm_head.weight".to_string(), rand(&[V, H]));
    w.insert("model.norm.weight".to_string(), mx::ones(&[H], Dtype::Float32).unwrap());
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("self_attn.q_proj", [4 * hd, H]),
            ("self_attn.k_proj", [2 * hd, H]),
            ("self_attn.v_proj", [2 * hd, H]),
            ("self_attn.o_proj", [H, 4 * hd]),
            ("mlp.gate_proj", [128, H]),
            ("mlp.up_proj", [128, H]),
            ("mlp.down_proj", [H, 128]),
        ] {
            w.insert(format!("{p}.{n}.weight"), rand(&shape));
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(format!("{p}.{n}.weight"), mx::ones(&[H], Dtype::Float32).unwrap());
        }
    }
    mx::save_safetensors(&d.join("model.safetensors"), &w, &BTreeMap::new()).unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..V).map(|i| (format!("t{i}"), serde_json::json!(i))).collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t1"},
    });
    std::fs::write(d.join("tokenizer.json"), tok.to_string()).unwrap();
    dir
}

fn request(prompt: Vec<i32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        sampling: Default::default(),
        max_tokens,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        logprobs: false,
        top_logprobs: 0,
        grammar: None,
        images: Vec::new(),
        audio: Vec::new(),
        adapter: None,
    }
}

/// The generated ids and the finish reason.
fn collect(p: &Pending) -> (Vec<i32>, FinishReason) {
    let mut ids = Vec::new();
    loop {
        match p.events.recv().unwrap().1 {
            Event::Token { id, .. } if id >= 0 => ids.push(id),
            Event::Done { reason, .. } => return (ids, reason),
            Event::Error(e) => panic!("engine error: {e}"),
            _ => {}
        }
    }
}

fn prompts() -> Vec<(Vec<i32>, usize)> {
    (0..7)
        .map(|i| ((0..3 + 9 * i).map(|t| 2 + (t * 7 + i) % (V - 2)).collect(), [5, 30, 12, 3, 22, 17, 9][i as usize]))
        .collect()
}

#[test]
fn each_row_of_a_changing_batch_gets_its_tokens_alone() {
    let dir = tiny_llama();
    let e =
        Engine::load(dir.path(), LoadOptions { prompt_cache_bytes: 0, stacked_kv: Some(true), ..Default::default() })
            .unwrap();
    let alone: Vec<Vec<i32>> =
        prompts().into_iter().map(|(p, n)| collect(&e.submit(request(p, n)).unwrap()).0).collect();
    assert!(alone.iter().zip(prompts()).all(|(a, (_, n))| a.len() == n));
    // the first four together; the rest join while they run (rows leave at 3, 5, 12, 30 tokens)
    let ps = prompts();
    let first: Vec<Pending> = ps[..4].iter().map(|(p, n)| e.submit(request(p.clone(), *n)).unwrap()).collect();
    let (t3, _) = collect(&first[3]);
    let late: Vec<Pending> = ps[4..].iter().map(|(p, n)| e.submit(request(p.clone(), *n)).unwrap()).collect();
    let mut got: Vec<Vec<i32>> = first[..3].iter().map(|p| collect(p).0).collect();
    got.push(t3);
    got.extend(late.iter().map(|p| collect(p).0));
    for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g, a, "sequence {i}");
    }
    assert!(e.stats.stacked_steps.load(Ordering::Relaxed) > 0, "the stacked KV never ran");
    let s = &e.stats;
    assert_eq!(s.requests.load(Ordering::Relaxed), s.served.load(Ordering::Relaxed));
}

#[test]
fn a_cancelled_row_leaves_the_others_unchanged_and_the_queue_is_bounded() {
    let dir = tiny_llama();
    let e = Engine::load(
        dir.path(),
        LoadOptions {
            prompt_cache_bytes: 0,
            max_concurrency: 2,
            max_queue: 1,
            stacked_kv: Some(true),
            ..Default::default()
        },
    )
    .unwrap();
    let ps = prompts();
    let want = collect(&e.submit(request(ps[1].0.clone(), 30)).unwrap()).0;
    let a = e.submit(request(ps[1].0.clone(), 30)).unwrap();
    let b = e.submit(request(ps[2].0.clone(), 1000)).unwrap();
    let c = e.submit(request(ps[3].0.clone(), 4)).unwrap(); // waits: max_concurrency 2
    assert!(matches!(e.submit(request(vec![2, 3], 4)), Err(crate::error::Error::Busy(_))), "queue bound");
    // cancel b once it is decoding beside a
    let mut n = 0;
    while n < 3 {
        if let Event::Token { id, .. } = b.events.recv().unwrap().1 {
            n += usize::from(id >= 0);
        }
    }
    b.cancel.store(true, Ordering::Relaxed);
    assert_eq!(collect(&a).0, want);
    assert_eq!(collect(&b).1, FinishReason::Cancelled);
    assert_eq!(collect(&c).0.len(), 4);
    let s = &e.stats;
    assert_eq!((s.cancelled.load(Ordering::Relaxed), s.rejected.load(Ordering::Relaxed)), (1, 1));
}
