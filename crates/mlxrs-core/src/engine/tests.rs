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

/// 8 prompts of mixed lengths (2 to 66 tokens).
fn mixed_prompts() -> Vec<Vec<i32>> {
    [2usize, 66, 11, 25, 5, 48, 17, 33]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|t| 2 + ((t * 5 + i * 11) % (V as usize - 2)) as i32).collect())
        .collect()
}

/// Submit `prompts` while the engine is held, so that they are admitted together.
fn submit_together(e: &Engine, prompts: &[Vec<i32>], max_tokens: usize) -> Vec<Pending> {
    let hold = e.hold().unwrap();
    let out = prompts.iter().map(|p| e.submit(request(p.clone(), max_tokens)).unwrap()).collect();
    drop(hold);
    out
}

fn batched_prefill_gives_each_its_tokens_alone(opts: LoadOptions) {
    let dir = tiny_llama_hd(32);
    let e = Engine::load(dir.path(), LoadOptions { prompt_cache_bytes: 0, ..opts }).unwrap();
    let ps = mixed_prompts();
    let alone: Vec<Vec<i32>> = ps.iter().map(|p| collect(&e.submit(request(p.clone(), 12)).unwrap()).0).collect();
    let (steps0, rows0) = (e.stats.prefill_steps.load(Ordering::Relaxed), e.stats.prefill_rows.load(Ordering::Relaxed));
    assert_eq!(steps0, rows0, "alone: one row per prefill pass");
    let got: Vec<Vec<i32>> = submit_together(&e, &ps, 12).iter().map(|p| collect(p).0).collect();
    for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g, a, "prompt {i} ({} tokens): batched prefill changed its tokens", ps[i].len());
    }
    let s = &e.stats;
    let (steps, rows) =
        (s.prefill_steps.load(Ordering::Relaxed) - steps0, s.prefill_rows.load(Ordering::Relaxed) - rows0);
    assert!(s.prefill_max_rows.load(Ordering::Relaxed) >= 2 && rows > steps, "no prefill pass ran several rows");
    assert!(steps < steps0, "batched: fewer prefill passes than one prompt at a time ({steps} vs {steps0})");
}

#[test]
fn prompts_admitted_together_prefill_in_batches_and_get_their_tokens_alone() {
    batched_prefill_gives_each_its_tokens_alone(LoadOptions::default());
    // chunks of 8, a budget of 3 chunks a pass
    batched_prefill_gives_each_its_tokens_alone(LoadOptions {
        prefill_step_size: 8,
        prefill_batch_tokens: Some(24),
        ..Default::default()
    });
    // the rotating cache that keeps its first tokens and the quantized caches: rows batch only
    // where their chunks end as they would alone (chunks of 8: the longer prompts share them)
    for (kv_bits, max_kv_size) in [(None, Some(16)), (Some(8), None), (Some(4), None)] {
        let opts = LoadOptions {
            prefill_step_size: 8,
            prefill_batch_tokens: Some(64),
            kv_bits,
            kv_group_size: 32,
            max_kv_size,
            ..Default::default()
        };
        batched_prefill_gives_each_its_tokens_alone(opts);
    }
}

#[test]
fn a_prefix_cache_hit_inside_a_prefill_batch_prefills_only_the_rest() {
    let dir = tiny_llama_hd(32);
    let opts = LoadOptions { prefill_step_size: 16, prefill_batch_tokens: Some(2048), ..Default::default() };
    let e = Engine::load(dir.path(), opts.clone()).unwrap();
    let ps = mixed_prompts();
    let cold: Vec<Vec<i32>> = {
        let cold = Engine::load(dir.path(), LoadOptions { prompt_cache_bytes: 0, ..opts }).unwrap();
        ps.iter().map(|p| collect(&cold.submit(request(p.clone(), 10)).unwrap()).0).collect()
    };
    // the longest prompt's first 40 tokens are cached; it then runs beside the others
    collect(&e.submit(request(ps[1][..40].to_vec(), 1)).unwrap());
    let got: Vec<(Vec<i32>, usize)> = submit_together(&e, &ps, 10)
        .iter()
        .map(|p| {
            let mut ids = Vec::new();
            loop {
                match p.events.recv().unwrap().1 {
                    Event::Token { id, .. } if id >= 0 => ids.push(id),
                    Event::Done { timings, .. } => return (ids, timings.cached_tokens),
                    Event::Error(err) => panic!("{err}"),
                    _ => {}
                }
            }
        })
        .collect();
    for (i, ((g, _), c)) in got.iter().zip(&cold).enumerate() {
        assert_eq!(g, c, "prompt {i}: differs from its cold run");
    }
    assert_eq!(got[1].1, 39, "the longest prompt's cached tokens (the snapshot holds all but its last)");
    assert!(e.stats.prefill_max_rows.load(Ordering::Relaxed) >= 2);
}

#[test]
fn a_cancel_during_a_batched_prefill_leaves_the_others_unchanged() {
    let dir = tiny_llama_hd(32);
    let opts = LoadOptions {
        prompt_cache_bytes: 0,
        prefill_step_size: 4,
        prefill_batch_tokens: Some(2048),
        ..Default::default()
    };
    let e = Engine::load(dir.path(), opts).unwrap();
    // long prompts in chunks of 4: many batched passes
    let ps: Vec<Vec<i32>> = (0..6).map(|i| (0..240 + 8 * i).map(|t| 2 + (t * 3 + i * 7) % 62).collect()).collect();
    let alone: Vec<Vec<i32>> = ps.iter().map(|p| collect(&e.submit(request(p.clone(), 8)).unwrap()).0).collect();
    let pend = submit_together(&e, &ps, 8);
    // cancel row 2 once its prefill has started and is far from done
    loop {
        if let Event::Progress { done, total } = pend[2].events.recv().unwrap().1 {
            if done > 0 {
                assert!(done < total / 2, "prefill went too far before the cancel: {done} of {total}");
                pend[2].cancel.store(true, Ordering::Relaxed);
                break;
            }
        }
    }
    let (ids, reason) = collect(&pend[2]);
    assert_eq!((ids.len(), reason), (0, FinishReason::Cancelled), "cancelled during its prefill");
    for (i, p) in pend.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert_eq!(collect(p).0, alone[i], "prompt {i}: a cancelled neighbour changed its tokens");
    }
    assert!(e.stats.prefill_max_rows.load(Ordering::Relaxed) >= 2);
    assert_eq!(e.stats.cancelled.load(Ordering::Relaxed), 1);
}

#[test]
fn a_first_token_is_not_held_back_by_the_next_prefill_pass() {
    let dir = tiny_llama_hd(32);
    let opts = LoadOptions {
        prompt_cache_bytes: 0,
        prefill_step_size: 64,
        prefill_batch_tokens: Some(2048),
        ..Default::default()
    };
    let e = Engine::load(dir.path(), opts).unwrap();
    let long: Vec<i32> = (0..600).map(|t| 2 + (t * 3) % 62).collect();
    // one channel for both: their events in the order the engine sent them
    let (tx, rx) = std::sync::mpsc::channel();
    let hold = e.hold().unwrap();
    e.submit_to(request(vec![5, 9, 11, 3], 4), EventSink::new(tx.clone(), 1)).unwrap();
    e.submit_to(request(long, 4), EventSink::new(tx, 2)).unwrap();
    drop(hold);
    let mut long_done = 0;
    loop {
        match rx.recv().unwrap() {
            (2, Event::Progress { done, .. }) => long_done = done,
            (1, Event::Token { .. }) => break,
            (_, Event::Error(err)) => panic!("{err}"),
            _ => {}
        }
    }
    // pass 1 ran the short prompt's 3 tokens and as many of the long one's; the short one's first
    // token came before pass 2 (64 more of the long one), not after it
    assert_eq!(long_done, 3);
}
