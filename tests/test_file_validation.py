"""Every file is validated before it is trusted (issue #13): a safetensors header whose offsets,
dtypes and shapes disagree, a config.json or GGUF metadata with sizes out of range or inconsistent
with the weights, GGUF tensors misaligned or overlapping, and options that reach a division in the
engine are each a clean `ModelLoadError`/`InvalidArgumentError` naming the file, tensor and field,
never a signal, a panic or a hang. Loads that used to crash run in a subprocess, so that a
regression fails one test instead of killing pytest.

The engine thread's death (a panic inside its step loop, injected through the test-only hook) is an
`EngineError` for every caller: the stream in flight, the next request (at once), and `info`."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import mlxrs
from mlxrs.errors import EngineError, InvalidArgumentError, MlxrsError, ModelLoadError
from tinymodels import make_model

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def good() -> Path:
    return make_model("llama-float32", "llama")


# ---- helpers ----------------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, sys
    import mlxrs
    from mlxrs import models
    for case in json.loads(sys.stdin.read()):
        print("start", case["name"], flush=True)
        try:
            path = case["path"]
            if path.endswith(".gguf"):
                path = str(models.convert_gguf(path, case["out"], dtype="f32", progress=False))
            with mlxrs.Session(path, **case.get("kw", {})) as s:
                s.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
            out = {"cls": None, "msg": ""}
        except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
            out = {"cls": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
        print("result", json.dumps({"name": case["name"], **out}), flush=True)
""")


def load_in_subprocess(cases: list[dict[str, Any]], timeout: float = 300) -> dict[str, dict[str, Any]]:
    """Load each case in one child process; fails naming the case that killed or hung it."""
    p = subprocess.run(
        [sys.executable, "-c", WORKER], input=json.dumps(cases), capture_output=True, text=True, timeout=timeout
    )
    results = {}
    last = None
    for line in p.stdout.splitlines():
        if line.startswith("start "):
            last = line[6:]
        elif line.startswith("result "):
            r = json.loads(line[7:])
            results[r["name"]] = r
    assert p.returncode == 0, f"the loader died (exit {p.returncode}) loading {last!r}:\n{p.stderr[-3000:]}"
    assert set(results) == {c["name"] for c in cases}
    return results


def copy_model(tmp_path: Path, good: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(good, d)
    return d


def edit_config(d: Path, **changes: Any) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def read_st(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: Path, header: dict[str, Any] | bytes, data: bytes) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def edit_header(d: Path, fn: Callable[[dict[str, Any]], Any]) -> Path:
    p = d / "model.safetensors"
    header, data = read_st(p)
    fn(header)
    write_st(p, header, data)
    return d


def assert_refused(r: dict[str, Any], *needles: str, cls: str = "ModelLoadError") -> None:
    assert r["cls"] == cls, r
    assert "MlxrsError" in r["mro"], r
    for n in needles:
        assert n in r["msg"], (n, r["msg"])


# ---- safetensors --------------------------------------------------------------------------------

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
UP = "model.layers.0.mlp.up_proj.weight"


def test_safetensors_disagreements_are_refused(tmp_path, good):
    def begin_past_end(h):  # begin > end (the old check looked only at the largest end)
        b, e = h[NORM]["data_offsets"]
        h[NORM]["data_offsets"] = [e + 4096, e]

    def shape_vs_bytes(h):
        h[UP]["shape"] = [h[UP]["shape"][0] * 2, h[UP]["shape"][1]]

    def dtype_vs_bytes(h):
        h[NORM]["dtype"] = "F64"

    def overlap(h):
        h[NORM]["data_offsets"] = h["model.layers.0.input_layernorm.weight"]["data_offsets"]

    def unknown_dtype(h):
        h[NORM]["dtype"] = "Q4"

    cases = {
        "begin_past_end": (begin_past_end, [NORM, "data_offsets", "begin after"]),
        "shape_vs_bytes": (shape_vs_bytes, [UP, "need"]),
        "dtype_vs_bytes": (dtype_vs_bytes, [NORM, "F64", "need"]),
        "overlap": (overlap, [NORM, "overlap"]),
        "unknown_dtype": (unknown_dtype, [NORM, '"Q4"']),
    }
    jobs = [{"name": k, "path": str(edit_header(copy_model(tmp_path, good, k), fn))} for k, (fn, _) in cases.items()]
    # a repeated tensor name (JSON readers disagree on which entry wins)
    dup = copy_model(tmp_path, good, "duplicate")
    header, data = read_st(dup / "model.safetensors")
    text = json.dumps(header)
    extra = json.dumps({NORM: header[NORM]})[1:-1]
    write_st(dup / "model.safetensors", (text[:-1] + ", " + extra + "}").encode(), data)
    jobs.append({"name": "duplicate", "path": str(dup)})
    res = load_in_subprocess(jobs)
    for name, (_, needles) in cases.items():
        assert_refused(res[name], "model.safetensors", "re-download", *needles)
    assert_refused(res["duplicate"], NORM, "twice")


def test_embedding_smaller_than_the_vocabulary_is_refused(tmp_path, good):
    """Token ids past the table's rows used to read out of bounds (SIGSEGV at times)."""
    d = copy_model(tmp_path, good, "short-embed")
    p = d / "model.safetensors"
    header, data = read_st(p)
    rows, cols = header[EMBED]["shape"]
    b, _ = header[EMBED]["data_offsets"]
    header[EMBED]["shape"] = [rows // 4, cols]  # a consistent header: the rest of its bytes unused
    header[EMBED]["data_offsets"] = [b, b + rows // 4 * cols * 4]
    write_st(p, header, data)
    r = load_in_subprocess([{"name": "e", "path": str(d)}])["e"]
    assert_refused(r, EMBED, f"{rows // 4} rows", f"vocab_size is {rows}")


def test_weights_must_have_the_shapes_the_config_implies(tmp_path, good):
    d = edit_config(copy_model(tmp_path, good, "hd"), head_dim=32)  # in range, but not the weights' 64
    msg = pytest.raises(ModelLoadError, mlxrs.Session, d).value.args[0]
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "[128, 256]" in msg and "config.json" in msg
    assert msg.startswith(f"{d}: "), msg  # which model


# ---- config.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("num_hidden_layers", 10**9, "num_hidden_layers = 1000000000 is out of range"),  # aborted: allocation failed
        ("num_hidden_layers", 0, "num_hidden_layers = 0 is out of range"),  # panicked the engine thread
        ("head_dim", 10**6, "head_dim = 1000000 is out of range"),  # 10 GB, then SIGSEGV in MLX
        ("num_attention_heads", 0, "num_attention_heads = 0 is out of range"),
        ("num_attention_heads", 3, "not a multiple of num_key_value_heads 2"),
        ("vocab_size", 2**40, "vocab_size = 1099511627776 is out of range"),
        ("hidden_size", 1e9, "hidden_size = 1000000000.0 is not an integer"),
        ("head_dim", 63, "head_dim 63 is odd"),
    ],
)
def test_config_sizes_are_bounded(tmp_path, good, field, value, needle):
    d = edit_config(copy_model(tmp_path, good, "cfg"), **{field: value})
    r = load_in_subprocess([{"name": "c", "path": str(d)}])["c"]
    assert_refused(r, str(d), "config.json", needle)


def test_gemma_window_pattern_is_bounded(tmp_path):
    g = make_model("gemma3_text-float32", "gemma3_text")
    for pattern, ok in [(0, False), (3, False), (2, True)]:  # 2 layers: at least one must be global
        d = edit_config(copy_model(tmp_path, g, f"p{pattern}"), sliding_window_pattern=pattern)
        if ok:
            with mlxrs.Session(d) as s:
                assert len(s.generate([1, 2], max_tokens=2, ignore_eos=True).tokens) == 2
        else:
            with pytest.raises(ModelLoadError, match=f"sliding_window_pattern = {pattern} is out of range"):
                mlxrs.Session(d)


# ---- options that reach a division ---------------------------------------------------------------


def test_kv_group_size_is_validated_in_rust(tmp_path, good):
    """`kv_bits=4, kv_group_size=0` died with SIGFPE; the native Session (no Python-side check)
    must refuse it itself."""
    jobs = [{"name": f"g{g}", "path": str(good), "kw": {"kv_bits": 4, "kv_group_size": g}} for g in (0, -1, 48)]
    res = load_in_subprocess(jobs)
    for g in (0, -1, 48):
        assert_refused(res[f"g{g}"], "kv_group_size", cls="InvalidArgumentError")
    from mlxrs import _native

    for g in (0, 48):
        with pytest.raises(InvalidArgumentError, match=rf"kv_group_size must be one of 32, 64, 128 \(got {g}\)"):
            _native.Session(str(good), kv_bits=4, kv_group_size=g)
    # a group size that does not divide head_dim (32 here): refused, not an MLX failure mid-generation
    with pytest.raises(InvalidArgumentError, match="kv_group_size 64 does not divide the model's head_dim 32"):
        _native.Session(
            str(make_model("qwen3-hd32", "qwen3", head_dim=32, heads=8, kv_heads=4)), kv_bits=4, kv_group_size=64
        )
    with mlxrs.Session(good, kv_bits=4, kv_group_size=32) as s:  # the valid ones still work
        assert len(s.generate([1, 2, 3], max_tokens=3, ignore_eos=True).tokens) == 3


# ---- GGUF ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, good) -> Path:
    pytest.importorskip("gguf")
    from test_gguf_import_arch import write_gguf

    p = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_gguf(good, p)
    return p


def gguf_fields(data: bytes) -> list[tuple[int, int, str]]:
    from test_gguf import header_fields

    return header_fields(data)[0]


def set_field(data: bytes, off: int, width: int, value: int) -> bytes:
    return data[:off] + value.to_bytes(width, "little") + data[off + width :]


def test_gguf_metadata_sizes_are_bounded(tmp_path, good_gguf):
    data = good_gguf.read_bytes()
    fields = {what: (off, width) for off, width, what in gguf_fields(data)}
    cases = {
        "block_count": ("llama.block_count", 2**31 - 1),  # aborted: memory allocation of 51539607528 bytes failed
        "block_count0": ("llama.block_count", 0),  # panicked the engine thread (index out of bounds)
        "key_length": ("llama.attention.key_length", 2**31 - 1),  # 8.4 GB RSS, then SIGSEGV
        "head_count0": ("llama.attention.head_count", 0),  # a Rust panic as pyo3_runtime.PanicException
        "head_count3": ("llama.attention.head_count", 3),  # not a multiple of the 2 KV heads
    }
    jobs = []
    for name, (key, value) in cases.items():
        off, width = next(v for k, v in fields.items() if k.startswith(key + ": value of type"))
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(set_field(data, off, width, value))
        jobs.append({"name": name, "path": str(p), "out": str(tmp_path / f"{name}-out")})
    res = load_in_subprocess(jobs)
    for name, (key, value) in cases.items():
        needle = f"{key} = " if name != "head_count3" else "is not a multiple of"
        assert_refused(res[name], "GGUF metadata", needle)
        if name != "head_count3":
            assert "out of range" in res[name]["msg"], res[name]


def test_gguf_tensor_offsets_are_checked(tmp_path, good_gguf):
    from mlxrs import _native

    data = good_gguf.read_bytes()
    offsets = [(off, width) for off, width, what in gguf_fields(data) if what == "tensor offset"]
    values = [int.from_bytes(data[o : o + w], "little") for o, w in offsets]
    assert values[1] > values[0]
    misaligned = set_field(data, *offsets[1], values[1] + 4)
    overlapping = set_field(data, *offsets[1], values[0])
    with pytest.raises(ModelLoadError, match="not a multiple of the alignment 32"):
        _native._gguf_header(data=misaligned, path=None)
    with pytest.raises(ModelLoadError, match="overlaps tensor"):
        _native._gguf_header(data=overlapping, path=None)
    # and through the import a Session runs
    for name, bad in [("misaligned", misaligned), ("overlapping", overlapping)]:
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(bad)
        with pytest.raises(ModelLoadError, match=str(p.name)):
            mlxrs.models.convert_gguf(p, tmp_path / f"{name}-out", dtype="f32", progress=False)
    _native._gguf_header(data=data, path=None)  # the unmutated file parses


# ---- the engine thread's death ------------------------------------------------------------------


def test_engine_panic_is_an_error_every_caller_sees(good):
    with mlxrs.Session(good) as s:
        assert s.info["engine"] == {"state": "running", "error": None}
        stream = s.stream([1, 2, 3], max_tokens=100_000, ignore_eos=True)
        next(stream)
        failed_before = s.info["failed"]
        s._inject_engine_panic()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="injected engine panic"):
            for _ in stream:
                assert time.monotonic() - t0 < 30, "the stream went on after the engine died"
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="injected engine panic"):
            s.generate("next", max_tokens=4)
        with pytest.raises(EngineError):
            s.logits([1, 2])
        assert time.monotonic() - t0 < 5, "requests after the death must fail at once"
        info = s.info
        assert info["engine"]["state"] == "dead"
        assert "injected engine panic (test hook)" in info["engine"]["error"]
        assert info["failed"] == failed_before + 2  # the stream in flight and the generate after it
        assert (
            info["requests"]
            == info["served"] + info["cancelled"] + info["rejected"] + info["failed"] + info["inflight"]
            and info["inflight"] == 0
        )
        assert issubclass(EngineError, MlxrsError)
    assert s.info["engine"] == {"state": "closed", "error": None}


def test_engine_panic_while_idle_fails_the_next_request(good):
    with mlxrs.Session(good) as s:
        s._inject_engine_panic()
        with pytest.raises(EngineError, match="injected engine panic"):
            s.generate("hello", max_tokens=2)
        assert s.info["engine"]["state"] == "dead"


def test_engine_error_is_exported():
    import mlxrs.errors as errors

    assert "EngineError" in errors.__all__ and errors.EngineError is EngineError


def test_the_fuzz_script_runs_clean():
    """scripts/fuzz_files.py on a few cases of each kind (docs/fuzzing.md has the long run)."""
    pytest.importorskip("gguf")
    p = subprocess.run(
        [sys.executable, str(HERE.parent / "scripts" / "fuzz_files.py"), "--n", "25", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    for kind in ("safetensors", "gguf", "config"):
        line = next(x for x in p.stdout.splitlines() if x.startswith(kind + ":"))
        assert "crashed 0, hung 0, accepted-inconsistent 0" in line, line
        assert "accepted-consistent 0," not in line, line  # at least the unmutated file loads
