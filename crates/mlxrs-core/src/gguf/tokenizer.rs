//! A `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.ggml.*` metadata.
//!
//! A GGUF carries no tokenizer.json: the vocabulary, scores, token types, merges and special ids
//! are metadata under llama.cpp's key names. This rebuilds what transformers' GGUF conversion
//! (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`, `convert_gguf_tokenizer`) builds,
//! piece for piece, so that the `tokenizers` crate encodes exactly as transformers does:
//!
//! - `gemma`/`gemma2`/`gemma3` (a `llama`-model SentencePiece vocabulary): BPE with byte fallback;
//!   whitespace-only tokens, stored as real spaces, respelled with `▁`; merges derived from the
//!   vocabulary and ordered by the tokens' positions in the file (`gemma_tokenizer` +
//!   `generate_merges`); normalizer `" "→"▁"`, a no-op `Split(" ")` pre-tokenizer, decoder
//!   Replace/ByteFallback/Fuse.
//! - `gemma4` (Gemma 4's own tokenizer model in llama.cpp: SentencePiece-style BPE over raw UTF-8
//!   with the merges listed): the vocabulary as the file spells it, the file's merges, and the rest
//!   as for Gemma (`GemmaTokenizer(vocab, merges)`); no BOS added, whatever
//!   `tokenizer.ggml.add_bos_token` says — the chat template writes `<bos>`, and transformers
//!   follows the reference tokenizer there (llama.cpp forces the flag on).
//! - other `llama` SentencePiece vocabularies: BPE with byte fallback, merges from the scores,
//!   Metaspace (prepend on the first piece) and a decoder that strips the leading space
//!   (`LlamaTokenizer`); `phi3` prepends `▁` in a normalizer instead.
//! - `gpt2` byte-level BPE: the merges the file lists, every token spelled in the byte alphabet,
//!   and for `tokenizer.ggml.pre` values transformers knows (llama3/llama-bpe, qwen2, …) its split
//!   regex in front of a regex-free ByteLevel pre-tokenizer.
//!
//! Control tokens (token type 3) become special added tokens, user-defined ones (4) plain added
//! tokens. Unlike transformers' backend tokenizer, whose BOS is added by its Python layer, the
//! post-processor here prepends BOS (appends EOS) when `tokenizer.ggml.add_bos_token`
//! (`add_eos_token`) says so, because mlxrs encodes with the `tokenizers` crate alone.
//!
//! Two deliberate differences from transformers: a token it would add with a fresh id (one not in
//! the vocabulary: a class-default special like GPT-2's `<|endoftext|>` in a Llama 3 vocabulary,
//! or a control token whose spelling was changed) is left out, so no id past the model's embedding
//! can appear; and the BPE `unk_token` of a Gemma vocabulary is the file's unknown token when it
//! names one (transformers always uses `<unk>`; in real Gemma files they are the same).
use super::reader::{GgufHeader, MetaValue};
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};

const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const GPT4O_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// transformers' `GGUF_PRE_TOKENIZER_SPLITS`: the split regex for a `tokenizer.ggml.pre` value.
fn pre_tokenizer_split(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Gemma's SentencePiece vocabulary (`GemmaTokenizer`, merges by file position).
    Gemma,
    /// Gemma 4's (`GemmaTokenizer` with the file's merges).
    Gemma4,
    /// A SentencePiece vocabulary (`LlamaTokenizer`, merges by score).
    Llama,
    /// Phi-3: SentencePiece with the prefix space from a normalizer.
    Phi3,
    /// GPT-2 byte-level BPE.
    ByteLevel,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::ModelLoad(format!("GGUF tokenizer: {}", msg.into()))
}

fn str_array<'a>(h: &'a GgufHeader, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(v) = h.get(key) else { return Ok(None) };
    let a = v.as_array().ok_or_else(|| bad(format!("{key} is not an array")))?;
    a.iter()
        .enumerate()
        .map(|(i, x)| x.as_str().ok_or_else(|| bad(format!("{key}[{i}] is not a string"))))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn num_array<T>(h: &GgufHeader, key: &str, f: impl Fn(&MetaValue) -> Option<T>) -> Result<Option<Vec<T>>> {
    let Some(v) = h.get(key) else { return Ok(None) };
    let a = v.as_array().ok_or_else(|| bad(format!("{key} is not an array")))?;
    a.iter()
        .enumerate()
        .map(|(i, x)| f(x).ok_or_else(|| bad(format!("{key}[{i}] is not a number"))))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn as_i64(v: &MetaValue) -> Option<i64> {
    match *v {
        MetaValue::I8(x) => Some(x as i64),
        MetaValue::I16(x) => Some(x as i64),
        MetaValue::I32(x) => Some(x as i64),
        MetaValue::I64(x) => Some(x),
        _ => v.as_u64().and_then(|x| i64::try_from(x).ok()),
    }
}

/// Python's `str.isspace` (Unicode White_Space plus the separators U+001C..U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// GPT-2's `bytes_to_unicode`: byte → the character that spells it.
fn bytes_to_unicode() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

/// transformers' `generate_merges(vocab, vocab_scores)`: every split of every token into two
/// tokens of the vocabulary, ordered by the token's score (high first when `reverse`), then the
/// longer left piece, then the longer right piece; ties keep the order of first appearance, and a
/// token's own splits are ordered by the ids of their pieces.
fn generate_merges<'v>(
    vocab: &HashMap<&'v str, u32>,
    order: &[(&'v str, f64)],
    reverse: bool,
) -> Vec<(&'v str, &'v str)> {
    struct M<'v> {
        l: &'v str,
        r: &'v str,
        score: f64,
        ll: u32,
        lr: u32,
    }
    let mut merges: Vec<M<'v>> = Vec::new();
    let mut local: Vec<(u32, u32, M<'v>)> = Vec::new();
    for &(tok, score) in order {
        local.clear();
        let n = tok.chars().count() as u32;
        for (k, (b, _)) in tok.char_indices().enumerate().skip(1) {
            let (l, r) = tok.split_at(b);
            if let (Some(&il), Some(&ir)) = (vocab.get(l), vocab.get(r)) {
                local.push((il, ir, M { l, r, score, ll: k as u32, lr: n - k as u32 }));
            }
        }
        local.sort_by_key(|&(il, ir, _)| (il, ir));
        merges.extend(local.drain(..).map(|(_, _, m)| m));
    }
    let key = |a: &M, b: &M| {
        a.score.partial_cmp(&b.score).unwrap_or(std::cmp::Ordering::Equal).then(a.ll.cmp(&b.ll)).then(a.lr.cmp(&b.lr))
    };
    // Python's sorted(..., reverse=True) is stable: equal keys keep their order
    if reverse {
        merges.sort_by(|a, b| key(b, a));
    } else {
        merges.sort_by(key);
    }
    merges.into_iter().map(|m| (m.l, m.r)).collect()
}

fn added_token(id: u32, content: &str, special: bool) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": special,
    })
}

/// Build `(tokenizer.json, tokenizer_config.json)` from a GGUF header's tokenizer metadata.
pub fn build_tokenizer_json(h: &GgufHeader) -> Result<(Value, Value)> {
    let meta_str = |k: &str| h.get(k).and_then(MetaValue::as_str);
    let arch = meta_str("general.architecture").unwrap_or("");
    let model = meta_str("tokenizer.ggml.model").ok_or_else(|| bad("the file has no tokenizer.ggml.model"))?;
    let kind = match (model, arch) {
        ("llama", "gemma" | "gemma2" | "gemma3") => Kind::Gemma,
        ("gemma4", _) => Kind::Gemma4,
        ("llama", "phi3") => Kind::Phi3,
        ("llama", _) => Kind::Llama,
        ("gpt2", _) => Kind::ByteLevel,
        (other, _) => {
            return Err(Error::Unsupported(format!(
                "GGUF tokenizer model {other:?} (architecture {arch:?}) is not supported; mlxrs reads \"llama\" (SentencePiece), \"gemma4\" and \"gpt2\" (byte-level BPE)"
            )))
        }
    };
    let raw = str_array(h, "tokenizer.ggml.tokens")?.ok_or_else(|| bad("the file has no tokenizer.ggml.tokens"))?;
    if raw.is_empty() || raw.len() > u32::MAX as usize / 2 {
        return Err(bad(format!("tokenizer.ggml.tokens has {} entries", raw.len())));
    }
    let types = num_array(h, "tokenizer.ggml.token_type", as_i64)?.unwrap_or_default();
    let scores = num_array(h, "tokenizer.ggml.scores", MetaValue::as_f64)?;
    let file_merges = str_array(h, "tokenizer.ggml.merges")?;
    let special_id = |k: &str| h.get(k).and_then(MetaValue::as_u64).and_then(|i| usize::try_from(i).ok());
    let special_tok = |k: &str| -> Result<Option<&str>> {
        match special_id(k) {
            None => Ok(None),
            Some(i) => raw
                .get(i)
                .copied()
                .map(Some)
                .ok_or_else(|| bad(format!("{k} {i} is past the vocabulary ({} tokens)", raw.len()))),
        }
    };
    let bos = special_tok("tokenizer.ggml.bos_token_id")?;
    let eos = special_tok("tokenizer.ggml.eos_token_id")?;
    let unk = special_tok("tokenizer.ggml.unknown_token_id")?;
    let pad = special_tok("tokenizer.ggml.padding_token_id")?;

    // the vocabulary as the BPE model spells it
    let alphabet = bytes_to_unicode();
    let in_alphabet: HashSet<char> = alphabet.iter().copied().collect();
    let toks: Vec<std::borrow::Cow<'_, str>> = match kind {
        Kind::Gemma => raw
            .iter()
            .map(|&t| {
                if t.contains(' ') && t.chars().all(py_isspace) {
                    "\u{2581}".repeat(t.chars().count()).into()
                } else {
                    t.into()
                }
            })
            .collect(),
        Kind::Llama | Kind::Phi3 | Kind::Gemma4 => raw.iter().map(|&t| t.into()).collect(),
        Kind::ByteLevel => raw
            .iter()
            .map(|&t| {
                if t.chars().all(|c| in_alphabet.contains(&c)) {
                    t.into()
                } else {
                    t.bytes().map(|b| alphabet[b as usize]).collect::<String>().into()
                }
            })
            .collect(),
    };
    // {token: index}: a token that appears twice keeps its last index (a Python dict)
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(toks.len());
    for (i, t) in toks.iter().enumerate() {
        ids.insert(t.as_ref(), i as u32);
    }

    // merges: the file's, else derived from the vocabulary
    let merges: Vec<(&str, &str)> = match &file_merges {
        Some(ms) => ms
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut it = m.split(' ');
                match (it.next(), it.next(), it.next()) {
                    (Some(a), Some(b), None) => Ok((a, b)),
                    _ => Err(bad(format!("tokenizer.ggml.merges[{i}] {m:?} is not two tokens separated by a space"))),
                }
            })
            .collect::<Result<_>>()?,
        None if kind == Kind::ByteLevel => {
            return Err(bad("a gpt2 (byte-level) vocabulary without tokenizer.ggml.merges"))
        }
        None if kind == Kind::Gemma4 => return Err(bad("a gemma4 vocabulary without tokenizer.ggml.merges")),
        None => {
            // the scores as a Python dict {token: score} holds them: first-appearance order, last value.
            // Gemma's key is the position in the file (`gemma_tokenizer`), the others' the file's score
            let n = match kind {
                Kind::Gemma => toks.len(),
                _ => {
                    let s = scores.as_ref().ok_or_else(|| {
                        bad("no tokenizer.ggml.merges and no tokenizer.ggml.scores to derive them from")
                    })?;
                    s.len().min(toks.len())
                }
            };
            let mut order: Vec<(&str, f64)> = Vec::with_capacity(n);
            let mut slot: HashMap<&str, usize> = HashMap::with_capacity(n);
            for (i, t) in toks.iter().take(n).enumerate() {
                let score = match (&scores, kind) {
                    (Some(s), Kind::Llama | Kind::Phi3) => s[i],
                    _ => -(i as f64),
                };
                match slot.get(t.as_ref()) {
                    Some(&k) => order[k].1 = score,
                    None => {
                        slot.insert(t.as_ref(), order.len());
                        order.push((t.as_ref(), score));
                    }
                }
            }
            generate_merges(&ids, &order, true)
        }
    };
    if file_merges.is_some() {
        // derived merges hold by construction; the file's must name tokens of the vocabulary
        let mut joined = String::new();
        for (i, (a, b)) in merges.iter().enumerate() {
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            if !ids.contains_key(a) || !ids.contains_key(b) || !ids.contains_key(joined.as_str()) {
                return Err(bad(format!("merge {i} ({a:?}, {b:?}) names a token that is not in the vocabulary")));
            }
        }
    }

    // added tokens: the tokenizer class's named specials, control tokens, user-defined tokens
    let mut added: Vec<(u32, &str, bool)> = Vec::new();
    let mut added_set: HashSet<&str> = HashSet::new();
    let class_specials: &[&str] = match kind {
        Kind::Gemma | Kind::Gemma4 => &["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
        Kind::Llama | Kind::Phi3 => &["<unk>", "<s>", "</s>"],
        Kind::ByteLevel => &["<|endoftext|>"],
    };
    for &t in class_specials {
        if let Some(&id) = ids.get(t) {
            if added_set.insert(t) {
                added.push((id, t, true));
            }
        }
    }
    let is_spelled = |t: &str| kind != Kind::ByteLevel || t.chars().all(|c| in_alphabet.contains(&c));
    for (&t, &ty) in raw.iter().zip(types.iter()) {
        if ty == CONTROL && is_spelled(t) {
            if let Some(&id) = ids.get(t) {
                if added_set.insert(t) {
                    added.push((id, t, true));
                }
            }
        }
    }
    for (&t, &ty) in raw.iter().zip(types.iter()) {
        if ty == USER_DEFINED {
            if let Some(&id) = ids.get(t) {
                if added_set.insert(t) {
                    added.push((id, t, false));
                }
            }
        }
    }
    added.sort_by_key(|a| a.0);

    // BOS/EOS post-processor, as transformers' `update_post_processor` writes it
    let flag = |k: &str| h.get(k).and_then(MetaValue::as_bool);
    let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(model == "llama") && kind != Kind::Gemma4;
    let add_eos = flag("tokenizer.ggml.add_eos_token").unwrap_or(false);
    let bos_entry = bos.and_then(|t| ids.get(t).map(|&id| (t, id)));
    let eos_entry = eos.and_then(|t| ids.get(t).map(|&id| (t, id)));
    let (add_bos, add_eos) = (add_bos && bos_entry.is_some(), add_eos && eos_entry.is_some());
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let sp = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Map::new();
    for (type_id, part) in [(0u32, "A"), (1u32, "B")] {
        let mut items = Vec::new();
        if let (true, Some((t, _))) = (add_bos, bos_entry) {
            items.push(sp(t, type_id));
        }
        items.push(seq(part, type_id));
        if let (true, Some((t, _))) = (add_eos, eos_entry) {
            items.push(sp(t, type_id));
        }
        if type_id == 0 {
            single.extend(items.iter().cloned());
        }
        pair.extend(items);
    }
    for (on, entry) in [(add_bos, bos_entry), (add_eos, eos_entry)] {
        if let (true, Some((t, id))) = (on, entry) {
            specials.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
        }
    }
    let post_processor =
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials});

    let sp_decoder = |strip: bool| {
        let mut d = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if strip {
            d.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        json!({"type": "Sequence", "decoders": d})
    };
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let (normalizer, pre_tokenizer, decoder) = match kind {
        Kind::Gemma | Kind::Gemma4 => (
            json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            sp_decoder(false),
        ),
        Kind::Llama => (
            Value::Null,
            json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false}),
            sp_decoder(true),
        ),
        Kind::Phi3 => (
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u{2581}"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
            ]}),
            Value::Null,
            sp_decoder(true),
        ),
        Kind::ByteLevel => (
            Value::Null,
            match meta_str("tokenizer.ggml.pre").and_then(pre_tokenizer_split) {
                Some(re) => json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
                    byte_level(false),
                ]}),
                None => byte_level(true),
            },
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        ),
    };

    let bpe_unk = match kind {
        Kind::Gemma | Kind::Gemma4 => {
            unk.filter(|t| ids.contains_key(t)).or(ids.get_key_value("<unk>").map(|(k, _)| *k))
        }
        _ => None,
    };
    let mut vocab_json = Map::with_capacity(ids.len());
    for (i, t) in toks.iter().enumerate() {
        if ids[t.as_ref()] as usize == i {
            vocab_json.insert(t.to_string(), json!(i));
        }
    }
    let merges_json: Vec<Value> = merges.iter().map(|(a, b)| json!([a, b])).collect();
    let sentencepiece = kind != Kind::ByteLevel;
    let model_json = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": bpe_unk,
        "continuing_subword_prefix": if sentencepiece { Value::Null } else { json!("") },
        "end_of_word_suffix": if sentencepiece { Value::Null } else { json!("") },
        "fuse_unk": sentencepiece,
        "byte_fallback": sentencepiece,
        "ignore_merges": false,
        "vocab": vocab_json,
        "merges": merges_json,
    });
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added.iter().map(|&(id, t, s)| added_token(id, t, s)).collect::<Vec<_>>(),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model_json,
    });

    let mut cfg = Map::new();
    cfg.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    cfg.insert("bos_token".into(), json!(bos));
    cfg.insert("eos_token".into(), json!(eos));
    cfg.insert("unk_token".into(), json!(unk));
    cfg.insert("pad_token".into(), json!(pad));
    cfg.insert("add_bos_token".into(), json!(add_bos));
    cfg.insert("add_eos_token".into(), json!(add_eos));
    cfg.insert("clean_up_tokenization_spaces".into(), json!(false));
    if let Some(n) = h.get(&format!("{arch}.context_length")).and_then(MetaValue::as_u64) {
        cfg.insert("model_max_length".into(), json!(n));
    }
    if let Some(t) = meta_str("tokenizer.chat_template") {
        cfg.insert("chat_template".into(), json!(t));
    }
    Ok((tokenizer, Value::Object(cfg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn merges(toks: &[&'static str], scores: &[f64]) -> Vec<(&'static str, &'static str)> {
        let ids: HashMap<&str, u32> = toks.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect();
        let order: Vec<(&str, f64)> = toks.iter().copied().zip(scores.iter().copied()).collect();
        generate_merges(&ids, &order, true)
    }

    #[test]
    fn merges_match_transformers_generate_merges() {
        // expected lists printed by transformers' generate_merges on the same input
        let toks = ["a", "b", "ab", "ba", "aba", "abab", "bab"];
        let by_position: Vec<f64> = (0..toks.len()).map(|i| -(i as f64)).collect();
        assert_eq!(
            merges(&toks, &by_position),
            [
                ("a", "b"),
                ("b", "a"),
                ("ab", "a"),
                ("a", "ba"),
                ("aba", "b"),
                ("ab", "ab"),
                ("a", "bab"),
                ("ba", "b"),
                ("b", "ab")
            ]
        );
        // tied scores: longer left piece first, then first appearance
        assert_eq!(
            merges(&toks, &[0.0, 0.0, -1.0, -1.0, -2.0, -2.0, -1.0]),
            [
                ("ba", "b"),
                ("b", "ab"),
                ("a", "b"),
                ("b", "a"),
                ("aba", "b"),
                ("ab", "ab"),
                ("ab", "a"),
                ("a", "bab"),
                ("a", "ba")
            ]
        );
    }

    #[test]
    fn byte_alphabet_and_python_whitespace() {
        let a = bytes_to_unicode();
        assert_eq!(
            (a[b' ' as usize], a[b'\n' as usize], a[b'a' as usize], a[0xAD]),
            ('\u{120}', '\u{10A}', 'a', '\u{143}')
        );
        assert_eq!(a.iter().collect::<HashSet<_>>().len(), 256);
        assert!(py_isspace('\u{1c}') && py_isspace('\u{85}') && py_isspace('\u{3000}') && !py_isspace('\u{200b}'));
    }
}
