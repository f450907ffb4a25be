"""The model registry: `scan`, `ls` and name resolution (for `serve`, `fit` and Session) on a
synthetic Hugging Face hub cache (blobs/, snapshots/<rev>/ symlinks, refs/main) with several
models, two revisions of one, a broken one, an unsupported one, one deleted after the scan (stale),
and MLXRS_MODEL_DIRS holding a plain model directory and a GGUF file. Every path is under a
temporary directory: HF_HUB_CACHE and MLXRS_HOME never point at the real home."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import mlxrs._native
from cli_util import run_cli
from server_util import Server, free_port
from tinymodels import make_model

REV_ALPHA = "a1" * 20
REV_BETA_OLD = "b0" * 20
REV_BETA_MAIN = "b1" * 20
REV_GONE = "c1" * 20

GGUF_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
)


def hub_model(hub: Path, repo_id: str, rev: str, src: Path, *, main: bool = True, config: str | None = None) -> Path:
    """Put the files of `src` into the hub layout: blobs/<sha256>, snapshots/<rev>/<file> -> blob."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    blobs, snap = repo / "blobs", repo / "snapshots" / rev
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name.startswith("."):
            continue
        data = config.encode() if (config is not None and f.name == "config.json") else f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blobs / digest, snap))
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return snap


def write_gguf(path: Path) -> int:
    """A small llama GGUF (header and a few tensors); returns its parameter count."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_file_type(1)  # MOSTLY_F16
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_token_types([1] * 32)
    w.add_chat_template(GGUF_TEMPLATE)
    tensors = {
        "token_embd.weight": np.zeros((32, 64), np.float16),
        "blk.0.attn_q.weight": np.zeros((64, 64), np.float16),
        "output_norm.weight": np.ones(64, np.float32),
    }
    for k, v in tensors.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sum(v.size for v in tensors.values())


def st_facts(d: Path) -> tuple[int, int]:
    """(parameters, tensor bytes) of a model directory, from the safetensors headers."""
    import struct

    params = nbytes = 0
    for f in d.glob("*.safetensors"):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            head = json.loads(fh.read(n))
        for k, t in head.items():
            if k != "__metadata__":
                params += int(np.prod(t["shape"])) if t["shape"] else 1
                nbytes += t["data_offsets"][1] - t["data_offsets"][0]
    return params, nbytes


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("registry")
    hub, home, extra = root / "hub", root / "mlxrs-home", root / "extra"
    qwen3 = make_model("qwen3-float32", "qwen3")
    llama = make_model("llama-float32", "llama")
    gemma = make_model("gemma3_text-float32", "gemma3_text")
    qwen2 = make_model("qwen2-float32", "qwen2")
    paths = {
        "alpha": hub_model(hub, "Org/Alpha-Qwen3", REV_ALPHA, qwen3),
        "beta_old": hub_model(hub, "Org/Beta-Llama", REV_BETA_OLD, llama, main=False),
        "beta": hub_model(hub, "Org/Beta-Llama", REV_BETA_MAIN, llama),
        "gemma": hub_model(hub, "Other/Gemma-Tiny", "d1" * 20, gemma),
        "broken": hub_model(hub, "Org/Broken-Model", "e1" * 20, qwen3, config="{not json"),
        "unsupported": hub_model(
            hub,
            "Org/Mamba-Thing",
            "f1" * 20,
            qwen3,
            config=json.dumps({**json.loads((qwen3 / "config.json").read_text()), "model_type": "mamba"}),
        ),
        "gone": hub_model(hub, "Org/Gone-Qwen3", REV_GONE, qwen3),
    }
    extra.mkdir()
    shutil.copytree(qwen2, extra / "local-qwen2", ignore=shutil.ignore_patterns(".*"))
    paths["local"] = extra / "local-qwen2"
    (extra / "ggufs").mkdir()
    paths["gguf"] = extra / "ggufs" / "tiny-llama.gguf"
    gguf_params = write_gguf(paths["gguf"])
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "MLXRS_HOME": str(home), "MLXRS_MODEL_DIRS": str(extra)}
    env.pop("HF_HOME", None)
    scan = cli(env, "scan", "--json")
    assert scan.returncode == 0, scan.stderr
    # the stale one: its snapshot is deleted after the scan
    shutil.rmtree(paths["gone"])
    return {
        "root": root,
        "hub": hub,
        "home": home,
        "extra": extra,
        "env": env,
        "paths": paths,
        "scan": json.loads(scan.stdout),
        "gguf_params": gguf_params,
        "src": {"qwen3": qwen3, "qwen2": qwen2},
    }


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`mlxrs ARGS` in-process under `env` (tests/cli_util.py); `serve` runs as a process."""
    return run_cli(*args, env=env)


def cli_process(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxrs", *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def in_world(world: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for k in ("HF_HUB_CACHE", "MLXRS_HOME", "MLXRS_MODEL_DIRS"):
        monkeypatch.setenv(k, world["env"][k])
    return world


def by_name(scan: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for m in scan["models"]:
        out.setdefault(m["name"], []).append(m)
    return out


# ---- scan ---------------------------------------------------------------------------------------


def test_scan_records_every_loadable_model(world: dict[str, Any]) -> None:
    models = by_name(world["scan"])
    assert set(models) == {
        "Org/Alpha-Qwen3",
        "Org/Beta-Llama",
        "Other/Gemma-Tiny",
        "Org/Mamba-Thing",
        "Org/Gone-Qwen3",
        "local-qwen2",
        "tiny-llama.gguf",
    }
    assert (world["home"] / "registry.sqlite").is_file()
    a = models["Org/Alpha-Qwen3"][0]
    params, nbytes = st_facts(world["src"]["qwen3"])
    assert a == {
        **a,
        "repo_id": "Org/Alpha-Qwen3",
        "revision": REV_ALPHA,
        "is_main": True,
        "source": "hf-cache",
        "format": "safetensors",
        "model_type": "qwen3",
        "supported": True,
        "params": params,
        "weight_bytes": nbytes,
        "dtype": "float32",
        "quantization": None,
        "context_length": 4096,
        "chat_template": True,
        "tools": False,
        "path": str(world["paths"]["alpha"]),
    }
    revs = {m["revision"]: m["is_main"] for m in models["Org/Beta-Llama"]}
    assert revs == {REV_BETA_OLD: False, REV_BETA_MAIN: True}
    assert models["Other/Gemma-Tiny"][0]["model_type"] == "gemma3_text"
    m = models["Org/Mamba-Thing"][0]
    assert m["supported"] is False and "'mamba' is not supported" in m["note"]
    local = models["local-qwen2"][0]
    assert local["source"] == "model-dirs" and local["model_type"] == "qwen2" and local["supported"]
    g = models["tiny-llama.gguf"][0]
    assert g == {
        **g,
        "format": "gguf",
        "model_type": "llama",
        "supported": True,
        "params": world["gguf_params"],
        "quantization": "F16",
        "context_length": 2048,
        "chat_template": True,
        "tools": True,
        "path": str(world["paths"]["gguf"]),
    }
    # the broken one is reported, not recorded
    skipped = {s["path"]: s["why"] for s in world["scan"]["skipped"]}
    assert "config.json: invalid JSON" in skipped[str(world["paths"]["broken"])]  # the loader's reader says so
    assert "Org/Broken-Model" in skipped[str(world["paths"]["broken"])]


def test_scan_prints_a_summary_and_the_table(world: dict[str, Any], tmp_path: Path) -> None:
    env = {**world["env"], "MLXRS_HOME": str(tmp_path / "home2")}
    r = cli(env, "scan")
    assert r.returncode == 0, r.stderr
    assert "7 models (6 loadable by mlxrs)" in r.stdout  # two revisions of Beta; Gone is gone by now
    assert "skipped " + str(world["paths"]["broken"]) in r.stdout
    assert "Org/Alpha-Qwen3" in r.stdout and "tiny-llama.gguf" in r.stdout
    assert (tmp_path / "home2" / "registry.sqlite").is_file()


def test_registry_is_sqlite_with_the_recorded_columns(world: dict[str, Any]) -> None:
    con = sqlite3.connect(world["home"] / "registry.sqlite")
    cols = {r[1] for r in con.execute("PRAGMA table_info(models)")}
    n = con.execute("SELECT count(*) FROM models").fetchone()[0]
    con.close()
    assert {
        "name",
        "repo_id",
        "revision",
        "path",
        "model_type",
        "supported",
        "params",
        "weight_bytes",
        "quantization",
        "context_length",
        "chat_template",
        "tools",
    } <= cols
    assert n == 8


HF_CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.mark.parametrize(
    "given",
    [
        ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"),
        ("HUGGINGFACE_HUB_CACHE", "HF_HOME"),
        ("HF_HOME", "XDG_CACHE_HOME"),
        ("XDG_CACHE_HOME",),
        (),
    ],
)
def test_hub_cache_location_follows_huggingface_hub(
    given: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`hub.hub_cache()` (what `get` writes to and `scan` walks) is where huggingface_hub, imported
    afresh under the same environment, puts its cache; and it follows environment changes made
    after mlxrs was imported."""
    from mlxrs import hub, registry

    assert registry.hub_cache is hub.hub_cache  # one function
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for k in HF_CACHE_VARS:
        monkeypatch.delenv(k, raising=False)
    for k in given:
        monkeypatch.setenv(k, str(tmp_path / k.lower()))
    oracle = subprocess.run(
        [sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert hub.hub_cache() == Path(oracle)


def test_db_path_follows_mlxrs_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mlxrs import registry

    monkeypatch.setenv("MLXRS_HOME", str(tmp_path / "h"))
    assert registry.db_path() == tmp_path / "h" / "registry.sqlite"
    monkeypatch.delenv("MLXRS_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert registry.db_path() == tmp_path / "c" / "mlxrs" / "registry.sqlite"


def test_huggingface_hub_agrees_on_the_cache_layout(world: dict[str, Any]) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(world["hub"])
    repos = {r.repo_id: {rev.commit_hash for rev in r.revisions} for r in info.repos}
    assert repos["Org/Beta-Llama"] == {REV_BETA_OLD, REV_BETA_MAIN}
    assert "Org/Alpha-Qwen3" in repos


# ---- ls -----------------------------------------------------------------------------------------


def test_ls_lists_everything_and_reports_the_stale_entry(world: dict[str, Any]) -> None:
    r = cli(world["env"], "ls")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "REV", "TYPE", "MLXRS", "PARAMS", "QUANT", "SIZE", "CTX", "CHAT", "STATUS"]
    row = {ln.split()[0]: ln for ln in lines[1:] if ln and not ln.startswith("1 stale")}
    assert row["Org/Gone-Qwen3"].split()[-1] == "stale"
    assert row["Org/Alpha-Qwen3"].split()[-1] == "ok"
    assert " no " in row["Org/Mamba-Thing"]
    assert "tools" in row["tiny-llama.gguf"] and "F16" in row["tiny-llama.gguf"]
    assert "1 stale entry (files gone): Org/Gone-Qwen3 — run `mlxrs scan` to drop them" in r.stdout


def test_ls_pattern_filters(world: dict[str, Any]) -> None:
    r = cli(world["env"], "ls", "beta")
    assert r.returncode == 0
    rows = r.stdout.splitlines()[1:]
    assert len(rows) == 2 and all(x.startswith("Org/Beta-Llama") for x in rows)
    r = cli(world["env"], "ls", "*qwen*", "--json")
    assert {e["name"] for e in json.loads(r.stdout)} == {"Org/Alpha-Qwen3", "Org/Gone-Qwen3", "local-qwen2"}
    stale = {e["name"]: e["stale"] for e in json.loads(r.stdout)}
    assert stale == {"Org/Alpha-Qwen3": False, "Org/Gone-Qwen3": True, "local-qwen2": False}
    r = cli(world["env"], "ls", "nothing-like-this")
    assert r.returncode == 1
    assert "'nothing-like-this': no models match (try `mlxrs scan`)" in r.stderr


def test_ls_on_an_empty_registry(world: dict[str, Any], tmp_path: Path) -> None:
    r = cli({**world["env"], "MLXRS_HOME": str(tmp_path)}, "ls")
    assert r.returncode == 0
    assert "the registry is empty: (try `mlxrs scan`)" in r.stderr
    assert not (tmp_path / "registry.sqlite").exists()


# ---- name resolution ----------------------------------------------------------------------------


def test_resolution(in_world: dict[str, Any]) -> None:
    from mlxrs.registry import resolve_name

    p = in_world["paths"]
    assert resolve_name("Org/Alpha-Qwen3") == p["alpha"]
    assert resolve_name("alpha") == p["alpha"]  # unique substring, any case
    assert resolve_name("org/beta-llama") == p["beta"]  # two revisions: refs/main wins
    assert resolve_name(f"Org/Beta-Llama@{REV_BETA_OLD[:7]}") == p["beta_old"]
    assert resolve_name("gemma-tiny") == p["gemma"]
    assert resolve_name("local-qwen2") == p["local"]
    assert resolve_name("tiny-llama") == p["gguf"]
    # "qwen3" matches Alpha and the stale Gone: the stale one is not a candidate
    assert resolve_name("qwen3") == p["alpha"]


def test_misses_and_ambiguity(in_world: dict[str, Any]) -> None:
    from mlxrs.errors import ModelLoadError
    from mlxrs.registry import resolve_name

    with pytest.raises(ModelLoadError, match=r"no models match \(try `mlxrs scan`\)"):
        resolve_name("zebra")
    with pytest.raises(ModelLoadError, match=r"no models match \(try `mlxrs scan`\)"):
        resolve_name("broken")  # not recorded
    with pytest.raises(ModelLoadError) as e:
        resolve_name("qwen")
    msg = str(e.value)
    assert "'qwen' is ambiguous: it matches 2 models" in msg
    assert "Org/Alpha-Qwen3@a1a1a1a" in msg and "local-qwen2" in msg and str(in_world["paths"]["local"]) in msg
    with pytest.raises(ModelLoadError) as e:
        resolve_name("Org/")
    assert "ambiguous" in str(e.value) and "Org/Beta-Llama" in str(e.value)
    with pytest.raises(ModelLoadError) as e:
        resolve_name("gone")
    assert "stale registry entry whose files are gone" in str(e.value) and "mlxrs scan" in str(e.value)


def test_session_accepts_a_name(in_world: dict[str, Any]) -> None:
    import mlxrs

    with mlxrs.Session("alpha") as s:
        assert s.model_path == str(in_world["paths"]["alpha"])
        assert len(s.generate([5, 6, 7], max_tokens=3, temperature=0).tokens) == 3
    with pytest.raises(mlxrs.errors.ModelLoadError, match=r"no models match \(try `mlxrs scan`\)"):
        mlxrs.Session("zebra")


def test_paths_still_win_over_names(in_world: dict[str, Any], tmp_path: Path) -> None:
    from mlxrs.errors import ModelLoadError
    from mlxrs.models import resolve_model

    assert resolve_model(str(in_world["paths"]["local"])) == in_world["paths"]["local"]
    # an absolute path that does not exist is not looked up as a name
    missing = tmp_path / "alpha"
    assert resolve_model(str(missing)) == missing
    with pytest.raises(ModelLoadError, match="does not exist"):
        import mlxrs

        mlxrs.Session(missing)


# ---- fit and serve take names -------------------------------------------------------------------


def test_fit_accepts_names(world: dict[str, Any]) -> None:
    r = cli(world["env"], "fit", "alpha", "--ctx", "1000", "--json")
    assert r.returncode == 0, r.stderr
    by_name_plan = json.loads(r.stdout)
    r = cli(world["env"], "fit", str(world["paths"]["alpha"]), "--ctx", "1000", "--json")
    assert json.loads(r.stdout) == by_name_plan
    r = cli(world["env"], "fit", "tiny-llama", "--json")  # a GGUF, planned from its header
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    # planned as the import this backend makes of it (f32 on the CPU, bf16 on a GPU)
    per_param = {"f32": 4, "bf16": 2}[mlxrs._native.default_import_dtype()]
    assert p["weightsBytes"] == per_param * world["gguf_params"] and p["contextTokens"] == 2048
    r = cli(world["env"], "fit", "zebra")
    assert r.returncode == 1
    assert r.stderr.strip() == "error: 'zebra' is not a model directory or file, and no models match (try `mlxrs scan`)"
    r = cli(world["env"], "fit", "qwen")
    assert r.returncode == 1 and "ambiguous" in r.stderr and "local-qwen2" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_accepts_a_name(world: dict[str, Any]) -> None:
    with Server("beta", env=world["env"]) as s:
        status, body = s.get("/v1/models")
        assert status == 200 and body["data"][0]["id"] == "beta"
        status, out = s.post("/v1/completions", {"model": "beta", "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 2
        assert s.stats()["memory_plan"]["weightsBytes"] == st_facts(world["paths"]["beta"])[1]


def test_serve_reports_a_miss_and_exits_1(world: dict[str, Any]) -> None:
    r = cli_process(world["env"], "serve", "zebra", "--port", str(free_port()))
    assert r.returncode == 1
    assert "no models match (try `mlxrs scan`)" in r.stderr
    r = cli_process(world["env"], "serve", "qwen", "--port", str(free_port()))
    assert r.returncode == 1 and "ambiguous" in r.stderr


# ---- incremental scans --------------------------------------------------------------------------

AUDIT = """
CREATE TABLE audit (tbl TEXT, op TEXT, path TEXT);
CREATE TRIGGER models_ins AFTER INSERT ON models BEGIN INSERT INTO audit VALUES ('models', 'insert', NEW.path); END;
CREATE TRIGGER models_upd AFTER UPDATE ON models BEGIN INSERT INTO audit VALUES ('models', 'update', NEW.path); END;
CREATE TRIGGER models_del AFTER DELETE ON models BEGIN INSERT INTO audit VALUES ('models', 'delete', OLD.path); END;
CREATE TRIGGER skipped_ins AFTER INSERT ON skipped BEGIN INSERT INTO audit VALUES ('skipped', 'insert', NEW.path); END;
CREATE TRIGGER skipped_upd AFTER UPDATE ON skipped BEGIN INSERT INTO audit VALUES ('skipped', 'update', NEW.path); END;
CREATE TRIGGER skipped_del AFTER DELETE ON skipped BEGIN INSERT INTO audit VALUES ('skipped', 'delete', OLD.path); END;
"""


def audited(db: Path) -> list[tuple[str, str, str]]:
    """The writes sqlite recorded (through AUDIT's triggers) since the last call; clears them."""
    con = sqlite3.connect(db)
    with con:
        rows = con.execute("SELECT tbl, op, path FROM audit ORDER BY rowid").fetchall()
        con.execute("DELETE FROM audit")
    con.close()
    return rows


@pytest.fixture
def small_world(tmp_path: Path) -> dict[str, Any]:
    """A hub cache with two models (one broken), MLXRS_MODEL_DIRS with a directory and a GGUF, scanned
    once into a registry whose writes sqlite audits from then on."""
    hub, extra, db = tmp_path / "hub", tmp_path / "extra", tmp_path / "home" / "registry.sqlite"
    qwen3 = make_model("qwen3-float32", "qwen3")
    paths = {
        "alpha": hub_model(hub, "Org/Alpha-Qwen3", REV_ALPHA, qwen3),
        "broken": hub_model(hub, "Org/Broken-Model", "e1" * 20, qwen3, config="{not json"),
    }
    extra.mkdir()
    shutil.copytree(make_model("qwen2-float32", "qwen2"), extra / "local-qwen2", ignore=shutil.ignore_patterns(".*"))
    paths["local"] = extra / "local-qwen2"
    paths["gguf"] = extra / "tiny-llama.gguf"
    write_gguf(paths["gguf"])
    from mlxrs import registry

    first = registry.scan(hub=hub, extra=[extra], db=db)
    con = sqlite3.connect(db)
    con.executescript(AUDIT)
    con.close()
    return {"hub": hub, "extra": extra, "db": db, "paths": paths, "first": first, "src": qwen3}


def test_a_second_scan_of_an_unchanged_cache_reads_and_writes_nothing(
    small_world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxrs import registry

    w = small_world
    assert w["first"].read == 4 and w["first"].unchanged == 0
    assert {e.name for e in w["first"].entries} == {"Org/Alpha-Qwen3", "local-qwen2", "tiny-llama.gguf"}

    def never(*a: Any, **kw: Any) -> Any:
        raise AssertionError(f"an unchanged model was read again: {a}")

    monkeypatch.setattr(registry, "inspect_dir", never)
    monkeypatch.setattr(registry, "inspect_gguf", never)
    again = registry.scan(hub=w["hub"], extra=[w["extra"]], db=w["db"])
    assert audited(w["db"]) == []  # sqlite saw no write to the models or the skipped paths
    assert (again.read, again.unchanged, again.removed) == (0, 4, 0)
    assert [e.to_json() for e in again.entries] == [e.to_json() for e in w["first"].entries]
    assert dict(again.skipped) == dict(w["first"].skipped)
    assert "config.json: invalid JSON" in dict(again.skipped)[str(w["paths"]["broken"])]


def test_a_model_added_changed_or_removed_is_the_only_row_written(small_world: dict[str, Any]) -> None:
    from mlxrs import registry

    w = small_world
    # added to the hub cache: read and inserted, and found by name
    beta = hub_model(w["hub"], "Org/Beta-Qwen3", REV_BETA_MAIN, w["src"])
    res = registry.scan(hub=w["hub"], extra=[w["extra"]], db=w["db"])
    assert audited(w["db"]) == [("models", "insert", str(beta))]
    assert (res.read, res.unchanged) == (1, 4)
    assert registry.resolve_name("beta", db=w["db"]) == beta
    assert "Org/Beta-Qwen3" in {e.name for e in registry.entries(w["db"])}
    # changed (a model directory's config.json rewritten): that row alone is replaced
    cfg = w["paths"]["local"] / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "max_position_embeddings": 1234}))
    res = registry.scan(hub=w["hub"], extra=[w["extra"]], db=w["db"])
    writes = audited(w["db"])
    assert {p for _t, _op, p in writes} == {str(w["paths"]["local"])} and res.read == 1, writes
    assert {e.name: e.context_length for e in res.entries}["local-qwen2"] == 1234
    # removed: its row is deleted, nothing else written
    (w["paths"]["gguf"]).unlink()
    res = registry.scan(hub=w["hub"], extra=[w["extra"]], db=w["db"])
    assert audited(w["db"]) == [("models", "delete", str(w["paths"]["gguf"]))]
    assert (res.read, res.removed) == (0, 1)


def test_names_are_looked_up_through_indexes(small_world: dict[str, Any]) -> None:
    from mlxrs import registry

    con = sqlite3.connect(small_world["db"])
    plan = " ".join(
        str(r[-1])
        for r in con.execute(f"EXPLAIN QUERY PLAN SELECT path FROM models {registry.EXACT_WHERE}", ("org/alpha-qwen3",))
    )
    con.close()
    assert "models_name" in plan and "models_repo_id" in plan, plan
    assert registry.resolve_name("ORG/ALPHA-QWEN3", db=small_world["db"]) == small_world["paths"]["alpha"]


# ---- rescan drops the stale entry (last: it changes the registry) -------------------------------


def test_rescan_drops_the_stale_entry(world: dict[str, Any]) -> None:
    r = cli(world["env"], "scan", "--json")
    names = {m["name"] for m in json.loads(r.stdout)["models"]}
    assert "Org/Gone-Qwen3" not in names and "Org/Alpha-Qwen3" in names
    r = cli(world["env"], "ls")
    assert "stale" not in r.stdout


# ---- describing a model directory (crates/mlxrs-core/src/describe.rs) ------------------------------


def header_tensors(d: Path) -> dict[str, tuple[str, list[int], int]]:
    """{name: (dtype, shape, bytes)} of every safetensors file of `d`, parsed here (struct + json)."""
    import struct

    out: dict[str, tuple[str, list[int], int]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            head = json.loads(fh.read(n))
        for k, t in head.items():
            if k != "__metadata__":
                out[k] = (t["dtype"], t["shape"], t["data_offsets"][1] - t["data_offsets"][0])
    return out


def expected_entry(d: Path, supported: bool) -> dict[str, Any]:
    """What `ls` must show of `d`, from config.json (json.load) and the headers parsed above: the
    parameters counted unpacked (a quantized weight's uint32 words hold 32/bits values each; its
    scales and biases are not parameters)."""
    cfg = json.loads((d / "config.json").read_text())
    q = cfg.get("quantization")
    tensors = header_tensors(d)
    params = 0
    for k, (dt, shape, _) in tensors.items():
        base = k.rsplit(".", 1)[0]
        if k.endswith((".scales", ".biases")) and f"{base}.weight" in tensors:
            continue
        n = int(np.prod(shape)) if shape else 1
        if q and f"{base}.scales" in tensors and dt == "U32":
            n = n * 32 // (q.get(base) or q)["bits"]
        params += n
    quant = None
    if q:
        quant = f"{q['bits']}-bit g{q['group_size']}" + ("" if q.get("mode", "affine") == "affine" else f" {q['mode']}")
    tc = cfg.get("text_config", cfg)
    return {
        "model_type": cfg["model_type"],
        "supported": supported,
        "params": params,
        "weight_bytes": sum(t[2] for t in tensors.values()),
        "dtype": tc.get("torch_dtype", cfg.get("torch_dtype")),
        "quantization": quant,
        "context_length": tc.get("max_position_embeddings", cfg.get("max_position_embeddings")),
        "files": sorted(p.name for p in d.glob("*.safetensors")),
    }


def described(d: Path) -> dict[str, Any]:
    from mlxrs import registry

    e = registry.inspect_dir(d).to_json()
    return {
        k: e[k]
        for k in (
            "model_type",
            "supported",
            "params",
            "weight_bytes",
            "dtype",
            "quantization",
            "context_length",
            "files",
        )
    }


@pytest.mark.parametrize("name,arch,bits", [("llama-float32", "llama", None), ("llama-q4", "llama", 4)])
def test_describe_a_model_as_its_config_and_headers_say(name: str, arch: str, bits: int | None) -> None:
    d = make_model(name, arch, quant_bits=bits)
    assert described(d) == expected_entry(d, True)
    if bits:
        assert described(d)["quantization"] == f"{bits}-bit g64"


def test_describe_an_unsupported_model_type(tmp_path: Path) -> None:
    src = make_model("qwen3-float32", "qwen3")
    d = tmp_path / "mamba"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns(".*"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    from mlxrs import registry

    assert "mamba" not in mlxrs._native.SUPPORTED_MODEL_TYPES
    assert described(d) == expected_entry(d, False)
    assert registry.inspect_dir(d).note == "model_type 'mamba' is not supported"
    (d / "tokenizer.json").unlink()
    assert registry.inspect_dir(d).note == "model_type 'mamba' is not supported; no tokenizer.json"
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    e = registry.inspect_dir(d)
    assert (e.model_type, e.supported) == (None, False) and e.note and "config.json has no model_type" in e.note


@pytest.mark.parametrize("bad,why", [("[1, 2]", "not a JSON object"), ("{oops", "invalid JSON")])
def test_describe_refuses_what_is_not_a_model_directory(bad: str, why: str, tmp_path: Path) -> None:
    from mlxrs import registry

    d = tmp_path / "m"
    shutil.copytree(make_model("qwen3-float32", "qwen3"), d, ignore=shutil.ignore_patterns(".*"))
    (d / "config.json").write_text(bad)
    with pytest.raises(ValueError, match=why) as e:
        registry.inspect_dir(d)
    assert "config.json" in str(e.value)
    (d / "config.json").write_text("{}")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        registry.inspect_dir(d)


@pytest.mark.parametrize("dtype", ["f32", "q8"])
def test_describe_a_gguf_import(dtype: str, tmp_path: Path) -> None:
    from test_gguf_import_arch import write_gguf

    g = tmp_path / "llama.gguf"
    write_gguf(make_model("llama-float32", "llama"), g)
    d = tmp_path / f"import-{dtype}"
    mlxrs._native.gguf_import(str(g), str(d), dtype)
    want = expected_entry(d, True)
    assert described(d) == want
    assert (want["quantization"] is not None) == (dtype == "q8")
