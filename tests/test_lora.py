"""LoRA and DoRA adapters in mlx-lm's format against mlx-lm 0.32.2 (`mlx_lm.load(model,
adapter_path=...)`, its unfused LoRALinear/DoRALinear) on the same weights: 48 greedy tokens
identical and last-position logits within test_parity's tolerance, for one adapter fused into a
dense base, one adapter beside a 4-bit base (unfused), and two adapters served by one Session at
once (unfused, rows of both adapters and of the base decoded together); bad adapters refused at
load naming the tensor or field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from mlxrs.errors import InvalidArgumentError, ModelLoadError
from tinymodels import ROOT, make_model

N_TOKENS = 48
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."
TOL = 1e-4  # float32, as tests/test_parity.py
KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def _model(arch: str, quant_bits: int | None = None) -> Path:
    q = f"-q{quant_bits}" if quant_bits else ""
    return make_model(f"lora-{arch}{q}", arch, layers=4, quant_bits=quant_bits)


def _linear_shapes(arch: str) -> dict[str, tuple[int, int]]:
    """`[out, in]` of every linear of the dense tiny model (the 4-bit one has the same)."""
    import mlx.core as mx

    w = mx.load(str(_model(arch) / "model.safetensors"))
    return {k[: -len(".weight")]: tuple(v.shape) for k, v in w.items() if k.endswith(".weight") and v.ndim == 2}


def write_adapter(
    d: Path,
    arch: str,
    *,
    kind: str = "lora",
    num_layers: int = 2,
    keys: list[str] | None = None,
    rank: int = 4,
    scale: float = 4.0,
    seed: int = 0,
    config: dict | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A random adapter for the tiny `arch` model: lora_a, lora_b (and DoRA's m) of `keys` in its
    last `num_layers` layers, as mlx-lm's trainer saves them."""
    import mlx.core as mx

    keys = KEYS if keys is None else keys
    rng = np.random.default_rng(seed)
    shapes = _linear_shapes(arch)
    layers = json.loads((_model(arch) / "config.json").read_text())["num_hidden_layers"]
    w: dict[str, np.ndarray] = {}
    base = mx.load(str(_model(arch) / "model.safetensors"))
    for i in range(layers - num_layers, layers):
        for k in keys:
            name = f"model.layers.{i}.{k}"
            out, inp = shapes[name]
            w[f"{name}.lora_a"] = rng.uniform(-1, 1, (inp, rank)).astype(np.float32) / np.sqrt(inp)
            w[f"{name}.lora_b"] = rng.normal(0, 0.3, (rank, out)).astype(np.float32)
            if kind == "dora":
                norm = np.linalg.norm(np.array(base[f"{name}.weight"]), axis=1)
                w[f"{name}.m"] = (norm * (1 + 0.2 * rng.standard_normal(out))).astype(np.float32)
    if tensors is not None:
        w = tensors(w) if callable(tensors) else tensors
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "adapters.safetensors"), {k: mx.array(v) for k, v in w.items()})
    cfg = {
        "fine_tune_type": kind,
        "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys},
    }
    if config:
        cfg.update(config)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def _adapter(name: str, arch: str, **kw) -> Path:
    return write_adapter(ROOT / "adapters" / f"{arch}-{name}", arch, **kw)


def _ref(oracle, model: Path, ids: list[int], adapter: Path | None) -> dict:
    return oracle.generate(model, ids, N_TOKENS, adapter_path=adapter)


def _check_one(oracle, model: Path, adapter: Path) -> None:
    with mlxrs.Session(model, adapter=adapter) as s:
        ids = s.tokenize(TEXT)
        ours = s.generate(ids, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        logits = np.array(s.logits(ids), dtype=np.float32)
    ref = _ref(oracle, model, ids, adapter)
    base = _ref(oracle, model, ids, None)
    moved = float(np.max(np.abs(np.array(ref["logits"]) - np.array(base["logits"]))))
    assert moved > 100 * TOL, f"the test adapter moves mlx-lm's logits by only {moved}: it proves nothing"
    diff = float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32))))
    assert diff <= TOL, f"last-token logits differ from mlx-lm's with the adapter by {diff}"
    assert ours.tokens == ref["tokens"], f"greedy tokens differ:\n ours {ours.tokens}\n ref  {ref['tokens']}"


@pytest.mark.parametrize("arch,kind", [("llama", "lora"), ("llama", "dora"), ("qwen3", "lora"), ("qwen3", "dora")])
def test_one_adapter_fused(oracle, arch, kind):
    """One adapter on a float32 base: fused into the weights at load (LoRALinear/DoRALinear.fuse)."""
    _check_one(oracle, _model(arch), _adapter(kind, arch, kind=kind))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_one_adapter_4bit_base_unfused(oracle, kind):
    """A 4-bit base keeps its packed weights: the adapter runs beside them (mlx-lm's path)."""
    _check_one(oracle, _model("llama", 4), _adapter(kind, "llama", kind=kind))


@pytest.mark.parametrize("stack", [False, True], ids=["per-row-kv", "stacked-kv"])
@pytest.mark.parametrize("bits", [None, 4])
def test_two_adapters_in_one_batch(oracle, bits, stack, monkeypatch):
    """Two adapters (a LoRA and a DoRA of different ranks and layers) and the base, requested
    concurrently of one Session (float32 and 4-bit bases): each row decodes with its own adapter's
    update. (llama: the tiny qwen3 model's greedy tokens are one token repeated, whatever the
    adapter; its adapters are checked by their logits above.) Over per-row KV caches and over the
    stacked KV (MLXRS_BATCH_KV=1, the GPU default), whose rows are slots with holes."""
    monkeypatch.setenv("MLXRS_BATCH_KV", "1" if stack else "0")
    arch = "llama"
    model = _model(arch, bits)
    a = _adapter("multi-a", arch, kind="lora", rank=4, seed=1)
    b = _adapter("multi-b", arch, kind="dora", rank=8, num_layers=3, keys=["self_attn.k_proj", "mlp.up_proj"], seed=2)
    with mlxrs.Session(model, adapters={"a": a, "b": b}) as s:
        ids = s.tokenize(TEXT)
        prompts = [(ids, "a"), (ids[:-3], "b"), (ids, None), (ids[:-5], "a"), (ids, "b")]
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(
                pool.map(
                    lambda p: (
                        s.generate(p[0], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0, adapter=p[1]).tokens
                    ),
                    prompts,
                )
            )
        steps = s.info["decode_steps"]
        stacked = s.info["stacked_decode_steps"]
    paths = {"a": a, "b": b, None: None}
    refs = {}
    for (p, name), got in zip(prompts, outs):
        key = (len(p), name)
        if key not in refs:
            refs[key] = _ref(oracle, model, p, paths[name])["tokens"]
        assert got == refs[key], f"adapter {name}, {len(p)}-token prompt: tokens differ from mlx-lm's"
    assert refs[(len(ids), "a")] != refs[(len(ids), "b")] != refs[(len(ids), None)], "adapters do not differ"
    # decoded together: one at a time would take 5 × 48 steps
    assert steps <= 3 * N_TOKENS, f"{steps} decode steps for 5 concurrent requests: they were not batched"
    assert (stacked > 0) == stack, f"{stacked} stacked decode steps"


def test_adapter_requests_do_not_reuse_the_base_prefix_cache(oracle):
    """The prompt-prefix cache holds the base model's KV: a request with an (unfused) adapter after
    a base request of the same prompt must not reuse it (it would decode the base's KV), nor may a
    base request reuse an adapter's."""
    model = _model("llama")
    a = _adapter("multi-a", "llama", kind="lora", rank=4, seed=1)
    b = _adapter(
        "multi-b", "llama", kind="dora", rank=8, num_layers=3, keys=["self_attn.k_proj", "mlp.up_proj"], seed=2
    )
    with mlxrs.Session(model, adapters={"a": a, "b": b}) as s:
        ids = s.tokenize(TEXT)
        runs = [
            (name, s.generate(ids, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0, adapter=name).tokens)
            for name in (None, "a", None, "b")
        ]
        hits = s.info["prompt_cache"]["hits"]
    assert hits >= 1, "the base requests did not use the prefix cache: the test proves nothing"
    paths = {"a": a, "b": b, None: None}
    for name, got in runs:
        assert got == _ref(oracle, model, ids, paths[name])["tokens"], f"adapter {name}: tokens differ from mlx-lm's"


def test_unknown_adapter_name_is_refused():
    model = _model("llama")
    a = _adapter("lora", "llama")
    with mlxrs.Session(model, adapters={"a": a, "b": a}) as s:
        with pytest.raises(InvalidArgumentError, match=r'adapter "c" is not loaded \(loaded: a, b\)'):
            s.generate("hi", max_tokens=2, adapter="c")


def _refused(tmp_path: Path, match: str, **kw) -> None:
    d = write_adapter(tmp_path / "bad", "llama", **kw)
    with pytest.raises(ModelLoadError, match=match):
        mlxrs.Session(_model("llama"), adapter=d)


def test_bad_shape_is_refused_naming_the_tensor(tmp_path):
    def bad(w):
        w["model.layers.3.self_attn.v_proj.lora_b"] = w["model.layers.3.self_attn.v_proj.lora_b"][:, :-1]
        return w

    _refused(tmp_path, r"tensor model\.layers\.3\.self_attn\.v_proj\.lora_b has shape \[4, \d+\] but", tensors=bad)


def test_layer_outside_num_layers_is_refused(tmp_path):
    def extra(w):
        w["model.layers.0.self_attn.q_proj.lora_a"] = w["model.layers.3.self_attn.q_proj.lora_a"]
        return w

    _refused(
        tmp_path,
        r"tensor model\.layers\.0\.self_attn\.q_proj\.lora_a: not an adapter parameter.*num_layers = 2",
        tensors=extra,
    )


def test_layer_the_model_lacks_is_refused(tmp_path):
    def extra(w):
        w["model.layers.9.self_attn.q_proj.lora_a"] = w["model.layers.3.self_attn.q_proj.lora_a"]
        return w

    _refused(tmp_path, r"tensor model\.layers\.9\.self_attn\.q_proj\.lora_a.*the model has 4 layers", tensors=extra)


def test_module_the_model_lacks_is_refused(tmp_path):
    d = tmp_path / "lacks"
    write_adapter(d, "llama")
    import mlx.core as mx

    w = mx.load(str(d / "adapters.safetensors"))
    w = {k.replace("q_proj", "qkv_proj"): v for k, v in w.items()}
    mx.save_safetensors(str(d / "adapters.safetensors"), w)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["lora_parameters"]["keys"] = ["self_attn.qkv_proj", "self_attn.v_proj", "mlp.down_proj"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"tensor model\.layers\.\d\.self_attn\.qkv_proj\.lora_a: the model has no linear"
    ):
        mlxrs.Session(_model("llama"), adapter=d)


def test_key_not_in_keys_is_refused(tmp_path):
    _refused(
        tmp_path,
        r'tensor model\.layers\.\d\.mlp\.down_proj\.lora_a: .*"mlp\.down_proj" is not in lora_parameters\.keys',
        config={"lora_parameters": {"rank": 4, "scale": 4.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}},
    )


@pytest.mark.parametrize(
    "config,match",
    [
        ({"fine_tune_type": "full"}, r'fine_tune_type "full" is a fully fine-tuned model'),
        ({"fine_tune_type": "qlora"}, r'fine_tune_type "qlora" is not one of lora, dora'),
        (
            {"lora_parameters": {"rank": 4, "alpha": 16, "keys": KEYS}},
            r"lora_parameters\.scale is missing \(it has alpha",
        ),
        ({"lora_parameters": {"rank": 0, "scale": 1.0, "keys": KEYS}}, r"lora_parameters\.rank = 0 is not a positive"),
        ({"num_layers": "2"}, r"num_layers is missing or not an integer"),
    ],
)
def test_bad_config_is_refused_naming_the_field(tmp_path, config, match):
    _refused(tmp_path, match, config=config)


def test_m_on_a_lora_adapter_is_refused(tmp_path):
    def extra(w):
        w["model.layers.3.self_attn.q_proj.m"] = np.ones(256, np.float32)
        return w

    _refused(
        tmp_path,
        r'tensor model\.layers\.3\.self_attn\.q_proj\.m: not an adapter parameter.*"m" is not one of',
        tensors=extra,
    )


def test_session_arguments_are_checked(tmp_path):
    a = _adapter("lora", "llama")
    with pytest.raises(InvalidArgumentError, match="not both"):
        mlxrs.Session(_model("llama"), adapter=a, adapters={"x": a})
    with pytest.raises(InvalidArgumentError, match="without ':'"):
        mlxrs.Session(_model("llama"), adapters={"x:y": a})
    with pytest.raises(ModelLoadError, match="no such directory"):
        mlxrs.Session(_model("llama"), adapter=tmp_path / "nowhere")


def test_server_serves_two_adapters_by_model_name(oracle):
    """`serve --adapter a=PATH --adapter b=PATH`: /v1/models lists MODEL:a and MODEL:b; concurrent
    completions naming MODEL:a, b (a bare adapter name) and the base model each decode with their
    own adapter (mlx-lm's tokens with that adapter, up to the first EOS the server stops at)."""
    from server_util import Server

    model = _model("llama")
    a = _adapter("multi-a", "llama", kind="lora", rank=4, seed=1)
    b = _adapter(
        "multi-b", "llama", kind="dora", rank=8, num_layers=3, keys=["self_attn.k_proj", "mlp.up_proj"], seed=2
    )
    with mlxrs.Session(model) as plain:
        ids = plain.tokenize(TEXT)
        eos = set(json.loads((model / "config.json").read_text()).get("eos_token_id") or [])
        eos = eos if isinstance(eos, set) else {eos}

        def expected(adapter: Path | None) -> str:
            toks = _ref(oracle, model, ids, adapter)["tokens"]
            cut = next((i for i, t in enumerate(toks) if t in eos), len(toks))
            return plain.detokenize(toks[:cut])

        want = {"a": expected(a), "b": expected(b), None: expected(None)}
    assert len(set(want.values())) == 3, "the adapters do not change the text: the test proves nothing"
    with Server(model, "--adapter", f"a={a}", "--adapter", f"b={b}") as srv:
        st, listed = srv.get("/v1/models")
        assert st == 200
        names = [m["id"] for m in listed["data"]]
        mid = names[0]
        assert f"{mid}:a" in names and f"{mid}:b" in names, names
        asks = [(f"{mid}:a", "a"), ("b", "b"), (mid, None), (f"{mid}:b", "b"), ("a", "a")]

        def ask(p):
            return srv.post("/v1/completions", {"model": p[0], "prompt": ids, "max_tokens": N_TOKENS, "temperature": 0})

        with ThreadPoolExecutor(len(asks)) as pool:
            replies = list(pool.map(ask, asks))
        for (name, ad), (st, body) in zip(asks, replies):
            assert st == 200, body
            assert body["choices"][0]["text"] == want[ad], f"model {name!r}: text differs from mlx-lm's with {ad}"


def test_fit_counts_the_adapter_tensors():
    """`fit --adapter` / `serve --adapter` plan the adapters' tensors as weights: the plan's
    weightsBytes grows by exactly their bytes (numpy's count of what the file holds)."""
    import mlx.core as mx
    from mlxrs import fit

    model = _model("llama")
    a = _adapter("multi-a", "llama", kind="lora", rank=4, seed=1)
    b = _adapter(
        "multi-b", "llama", kind="dora", rank=8, num_layers=3, keys=["self_attn.k_proj", "mlp.up_proj"], seed=2
    )
    tensor_bytes = sum(np.array(v).nbytes for d in (a, b) for v in mx.load(str(d / "adapters.safetensors")).values())
    base = fit.plan(model, 1024)
    with_adapters = fit.plan(model, 1024, adapters=[a, b])
    assert with_adapters["weightsBytes"] - base["weightsBytes"] == tensor_bytes


def test_server_strict_names_and_bad_adapter(tmp_path):
    """With --strict-model-names, MODEL:UNKNOWN is a 404 naming the loaded adapters while MODEL:a is
    served; a bad adapter stops serve at load with the tensor named."""
    from server_util import Server

    model = _model("llama")
    a = _adapter("multi-a", "llama", kind="lora", rank=4, seed=1)
    b = _adapter(
        "multi-b", "llama", kind="dora", rank=8, num_layers=3, keys=["self_attn.k_proj", "mlp.up_proj"], seed=2
    )
    with Server(model, "--adapter", f"a={a}", "--adapter", f"b={b}", "--strict-model-names") as srv:
        mid = srv.get("/v1/models")[1]["data"][0]["id"]
        st, body = srv.post("/v1/completions", {"model": f"{mid}:zzz", "prompt": "hi", "max_tokens": 2})
        assert st == 404 and "a, b" in body["error"]["message"], body
        st, body = srv.post("/v1/completions", {"model": f"{mid}:a", "prompt": "hi", "max_tokens": 2})
        assert st == 200, body

    def bad(w):
        w["model.layers.3.self_attn.v_proj.lora_b"] = w["model.layers.3.self_attn.v_proj.lora_b"][:, :-1]
        return w

    d = write_adapter(tmp_path / "bad", "llama", tensors=bad)
    with pytest.raises(AssertionError, match=r"model\.layers\.3\.self_attn\.v_proj\.lora_b has shape"):
        Server(model, "--adapter", str(d))
