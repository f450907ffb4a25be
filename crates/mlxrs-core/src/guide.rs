//! Constrained decoding through llguidance: a grammar (JSON schema, any JSON object, regex, Lark)
//! becomes one [`Guide`] per sequence, which gives the allowed tokens before each sampling step
//! and follows the tokens sampled. The token environment (a trie of every token's bytes) is built
//! once per engine, on its first constrained request ([`Guides`]). docs/design/constrained.md
//! explains how the masks run inside the batched scheduler.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array};
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::{Arc, OnceLock};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON schema (draft 2020-12 as llguidance reads it).
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

impl Grammar {
    /// The request parameter that carries it (error messages name it).
    pub fn param(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "json_schema",
            Grammar::JsonObject => "json_object",
            Grammar::Regex(_) => "regex",
            Grammar::Lark(_) => "grammar",
        }
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonSchema(v) => TopLevelGrammar::from_json_schema(with_compact_json(v.clone())),
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_compact_json(serde_json::json!({"type": "object"})))
            }
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// JSON without free whitespace between tokens (`{"a":1}`, what `json.dumps(separators=(",", ":"))`
/// writes): whitespace is legal JSON, but a model under a mask can spend its whole budget on it.
/// A schema's own `x-guidance` options win.
fn with_compact_json(mut v: Value) -> Value {
    if let Value::Object(m) = &mut v {
        m.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    v
}

/// The tokenizer as llguidance sees it: every token's bytes in a trie. Tokenizing (for a grammar's
/// forced strings) is greedy over the trie, which any string can be tokenized by.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// An engine's parser factory, made on first use.
#[derive(Default)]
pub struct Guides {
    factory: OnceLock<std::result::Result<Arc<ParserFactory>, String>>,
}

impl Guides {
    fn factory(&self, tok: &Tokenizer, vocab: usize) -> Result<Arc<ParserFactory>> {
        self.factory
            .get_or_init(|| {
                // llguidance asserts on some vocabularies it cannot read: an error, not a panic
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| build_factory(tok, vocab)))
                    .unwrap_or_else(|p| Err(crate::engine::panic_text(&*p)))
                    .map(Arc::new)
            })
            .clone()
            .map_err(|e| {
                Error::Invalid(format!("constrained decoding is not available for this model's tokenizer: {e}"))
            })
    }

    /// A guide for `g`, or an error naming the parameter when the grammar does not compile.
    pub fn guide(&self, g: &Grammar, tok: &Tokenizer, vocab: usize) -> Result<Guide> {
        let factory = self.factory(tok, vocab)?;
        let parser = factory.create_parser(g.top_level()).map_err(|e| Error::Invalid(format!("{}: {e}", g.param())))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(Error::Invalid(format!("{}: {e}", g.param())));
        }
        Ok(Guide { m, fed: 0, vocab, dead: false })
    }
}

fn build_factory(tok: &Tokenizer, vocab: usize) -> std::result::Result<ParserFactory, String> {
    let json: Value = serde_json::from_str(&tok.to_json()?).map_err(|e| e.to_string())?;
    let mut bytes = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
    if bytes.len() > vocab {
        return Err(format!("the tokenizer has {} tokens, more than the model's {vocab}", bytes.len()));
    }
    // ids the model has and the tokenizer does not: special (never allowed by a grammar)
    for (i, b) in bytes.iter_mut().enumerate() {
        if b.is_empty() {
            *b = special_name(i);
        }
    }
    while bytes.len() < vocab {
        bytes.push(special_name(bytes.len()));
    }
    let eos: Vec<TokenId> =
        tok.eos_ids.iter().filter(|&&e| e >= 0 && (e as usize) < vocab).map(|&e| e as TokenId).collect();
    let info = TokRxInfo::new(vocab as u32, eos.first().copied().unwrap_or(0));
    let mut trie = TokTrie::from(&info, &bytes);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(&eos);
    }
    let env: TokEnv = Arc::new(Env { trie });
    let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    f.quiet();
    Ok(f)
}

fn special_name(id: usize) -> Vec<u8> {
    let mut name = format!(".<[{id}]>").into_bytes();
    name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    name
}

/// One sequence's constraint: the matcher and how many of its generated tokens it has followed.
pub struct Guide {
    m: Matcher,
    /// Generated tokens consumed so far.
    pub fed: usize,
    vocab: usize,
    /// A mask allowed no token.
    dead: bool,
}

impl Guide {
    /// Follow one sampled token (a token the mask did not allow puts the matcher in its error state,
    /// which [`Guide::done`] reports).
    pub fn consume(&mut self, token: i32) {
        self.fed += 1;
        let _ = self.m.consume_token(token as TokenId);
    }

    /// Nothing more can follow (the grammar is complete), or the matcher failed.
    pub fn done(&self) -> bool {
        self.dead || self.m.is_stopped()
    }

    /// Why the matcher failed, if it did.
    pub fn error(&self) -> Option<String> {
        self.m.get_error()
    }

    /// The allowed tokens, one flag per model token; None when no token is allowed (the matcher
    /// stopped or failed).
    pub fn mask(&mut self) -> Option<Vec<bool>> {
        let v = match self.m.compute_mask() {
            Ok(v) if !v.is_zero() => v,
            _ => {
                self.dead = true;
                return None;
            }
        };
        let mut out = vec![false; self.vocab];
        v.iter_set_entries(|i| {
            if i < out.len() {
                out[i] = true;
            }
        });
        Some(out)
    }
}

/// Logits `[1, V]` with every token outside `allowed` at -inf.
pub fn apply_mask(logits: &Array, allowed: &[bool]) -> Result<Array> {
    let n = allowed.len() as i32;
    if logits.dim(-1) != n {
        return Err(Error::Invalid(format!("a mask of {n} tokens for logits of {}", logits.dim(-1))));
    }
    let mask = Array::from_slice(allowed, &[1, n])?;
    let neg = mx::scalar_as(f64::NEG_INFINITY, logits.dtype())?;
    mx::where_(&mask, logits, &neg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::Dtype;

    #[test]
    fn masked_tokens_get_no_probability_and_allowed_keep_their_logits() {
        let logits = Array::from_slice(&[3.0f32, 1.0, 2.0, 5.0, -1.0], &[1, 5]).unwrap();
        let allowed = [false, true, true, false, true];
        let out = apply_mask(&logits, &allowed).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(out[1], 1.0);
        assert_eq!(out[2], 2.0);
        assert_eq!(out[4], -1.0);
        assert!(out[0] == f32::NEG_INFINITY && out[3] == f32::NEG_INFINITY, "{out:?}");
        // argmax picks the best allowed token (2), not the best overall (3)
        let y = mx::argmax(&apply_mask(&logits, &allowed).unwrap(), -1, false).unwrap();
        assert_eq!(mx::astype(&y, Dtype::Int32).unwrap().to_vec::<i32>().unwrap(), vec![2]);
        // softmax mass is all on allowed tokens
        let lse = mx::logsumexp(&apply_mask(&logits, &allowed).unwrap(), &[-1], true).unwrap();
        let lp = mx::subtract(&apply_mask(&logits, &allowed).unwrap(), &lse).unwrap().to_vec::<f32>().unwrap();
        assert!(lp[0] == f32::NEG_INFINITY && lp[3] == f32::NEG_INFINITY);
        let mass: f32 = [1, 2, 4].iter().map(|&i| lp[i].exp()).sum();
        assert!((mass - 1.0).abs() < 1e-5, "{lp:?}");
    }

    #[test]
    fn a_mask_of_the_wrong_length_is_an_error() {
        let logits = Array::from_slice(&[0.0f32; 4], &[1, 4]).unwrap();
        assert!(apply_mask(&logits, &[true; 3]).is_err());
    }

    #[test]
    fn bfloat16_logits_keep_their_dtype() {
        let logits = mx::astype(&Array::from_slice(&[1.0f32, 2.0], &[1, 2]).unwrap(), Dtype::Bfloat16).unwrap();
        let out = apply_mask(&logits, &[true, false]).unwrap();
        assert_eq!(out.dtype(), Dtype::Bfloat16);
        let v = mx::astype(&out, Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], f32::NEG_INFINITY);
    }
}
