//! Tokenizer (Hugging Face `tokenizer.json` through the `tokenizers` crate), special tokens, EOS
//! ids from every place models keep them, and an incremental detokenizer that never splits a
//! UTF-8 character.
use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Every id that ends a generation (config.json, generation_config.json, tokenizer).
    pub eos_ids: Vec<i32>,
    /// The chat template (chat_template.jinja, else tokenizer_config.json's chat_template).
    pub chat_template: Option<String>,
    /// tokenizer_config.json (Null without one): its named special tokens ([`Tokenizer::special_token`]).
    config: Value,
}

/// A JSON file (None when it is not there); invalid JSON is an error naming the file. The reader of
/// the tokenizer's files and the processors' configs (`vision::json_file`).
pub(crate) fn read_json(p: &Path) -> Result<Option<Value>> {
    if !p.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(p).map_err(|e| Error::Io { path: p.to_path_buf(), source: e })?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::ModelLoad(format!("{}: invalid JSON: {e}", p.display())))
}

fn token_str(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn ids_of(v: Option<&Value>) -> Vec<i32> {
    match v {
        Some(Value::Number(n)) => n.as_i64().map(|i| vec![i as i32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).map(|i| i as i32).collect(),
        _ => Vec::new(),
    }
}

/// A model directory's generation_config.json (Null when it has none): the one reader of it (the
/// EOS ids here; the server's sampling defaults through `mlxrs._native.generation_config`).
pub fn generation_config(dir: &Path) -> Result<Value> {
    Ok(read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null))
}

/// The chat template of a model directory, with the one precedence everything in mlxrs uses (the
/// tokenizer here, the registry through `describe::describe`): chat_template.jinja, else
/// tokenizer_config.json's `chat_template` (a string, or the "default" of a list of named ones).
pub fn chat_template(dir: &Path) -> Result<Option<String>> {
    let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    template_of(dir, &tc)
}

fn template_of(dir: &Path, tokenizer_config: &Value) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja).map(Some).map_err(|e| Error::Io { path: jinja, source: e });
    }
    Ok(match tokenizer_config.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        // a list of named templates: take "default"
        Some(Value::Array(a)) => a
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_string),
        _ => None,
    })
}

impl Tokenizer {
    /// Load from a model directory.
    pub fn load(dir: &Path, config: &Value) -> Result<Tokenizer> {
        let tj = dir.join("tokenizer.json");
        if !tj.is_file() {
            return Err(Error::ModelLoad(format!(
                "{} has no tokenizer.json (mlxrs reads Hugging Face fast tokenizers): add it to the model directory",
                dir.display()
            )));
        }
        let inner =
            tokenizers::Tokenizer::from_file(&tj).map_err(|e| Error::ModelLoad(format!("{}: {e}", tj.display())))?;
        let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let gc = generation_config(dir)?;
        let bos_token = token_str(tc.get("bos_token"));
        let eos_token = token_str(tc.get("eos_token"));
        let mut eos_ids = ids_of(config.get("eos_token_id"));
        eos_ids.extend(ids_of(gc.get("eos_token_id")));
        if let Some(t) = &eos_token {
            if let Some(id) = inner.token_to_id(t) {
                eos_ids.push(id as i32);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let chat_template = template_of(dir, &tc)?;
        Ok(Tokenizer { inner, bos_token, eos_token, eos_ids, chat_template, config: tc })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Invalid(format!("tokenization failed: {e}")))?;
        Ok(enc.get_ids().iter().map(|&i| i as i32).collect())
    }

    pub fn decode(&self, ids: &[i32], skip_special_tokens: bool) -> Result<String> {
        let v: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner.decode(&v, skip_special_tokens).map_err(|e| Error::Invalid(format!("decoding failed: {e}")))
    }

    /// A named special token of tokenizer_config.json (`boi_token`, `audio_token`, ...): the top-level
    /// entry, else `extra_special_tokens`' (a string, or an added token's `content`).
    pub fn special_token(&self, name: &str) -> Option<String> {
        token_str(self.config.get(name)).or_else(|| token_str(self.config.get("extra_special_tokens")?.get(name)))
    }

    pub fn token_to_id(&self, t: &str) -> Option<i32> {
        self.inner.token_to_id(t).map(|i| i as i32)
    }

    /// The tokenizer as tokenizer.json (constrained decoding reads every token's bytes from it).
    pub fn to_json(&self) -> std::result::Result<String, String> {
        self.inner.to_string(false).map_err(|e| e.to_string())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Streams text out of a growing token sequence. Each emitted piece is the difference between
/// decoding a short window with and without the newest tokens; a window that ends inside a
/// multi-byte character (U+FFFD at the end) waits for the next token.
pub struct Detokenizer {
    tokens: Vec<i32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// `context`: the last few prompt tokens, so the first piece keeps its leading space.
    pub fn new(context: &[i32]) -> Detokenizer {
        let ctx = &context[context.len().saturating_sub(4)..];
        Detokenizer { tokens: ctx.to_vec(), prefix: 0, read: ctx.len() }
    }

    /// Add one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: i32) -> Result<String> {
        self.tokens.push(id);
        let before = tok.decode(&self.tokens[self.prefix..self.read], false)?;
        let after = tok.decode(&self.tokens[self.prefix..], false)?;
        if after.ends_with('\u{FFFD}') || after.len() <= before.len() && after.starts_with(&before) {
            return Ok(String::new());
        }
        let delta = match after.strip_prefix(before.as_str()) {
            Some(d) => d.to_string(),
            None => {
                let common = before.char_indices().zip(after.chars()).take_while(|((_, a), b)| a == b).count();
                after.chars().skip(common).collect()
            }
        };
        self.prefix = self.read;
        self.read = self.tokens.len();
        Ok(delta)
    }

    /// Whatever is still held back (an incomplete character at the very end).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.read >= self.tokens.len() {
            return Ok(String::new());
        }
        let before = tok.decode(&self.tokens[self.prefix..self.read], false)?;
        let after = tok.decode(&self.tokens[self.prefix..], false)?;
        self.prefix = self.read;
        self.read = self.tokens.len();
        Ok(after.strip_prefix(before.as_str()).unwrap_or(&after).to_string())
    }
}

/// Holds back text that could be the start of a stop string; reports the first full match.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Feed new text: (text safe to emit, the stop string that was hit, if any).
    pub fn feed(&mut self, text: &str) -> (String, Option<String>) {
        if self.stops.is_empty() {
            return (text.to_string(), None);
        }
        self.held.push_str(text);
        if let Some((pos, s)) =
            self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s))).min_by_key(|x| x.0)
        {
            let out = self.held[..pos].to_string();
            let s = s.clone();
            self.held.clear();
            return (out, Some(s));
        }
        // keep the longest suffix that is a proper prefix of some stop string
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, None)
    }

    /// The held text at the end of a generation that did not stop on a string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}
