"""docs/python-api.md stays true: every ```python block runs (each on its own, with MODEL_DIR set
to a tiny model), and the tables name exactly the options and fields the code has."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
from pathlib import Path

import pytest

import mlxrs
from mlxrs import session as session_mod
from tinymodels import make_model

DOC = Path(__file__).resolve().parent.parent / "docs" / "python-api.md"
TEXT = DOC.read_text()


def _blocks() -> list[tuple[str, str]]:
    """(id, code) of every ```python block, the id naming the section it is in."""
    out = []
    heading = "top"
    counts: dict[str, int] = {}
    for m in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```$", TEXT, re.M | re.S):
        if m.group(1):
            heading = re.sub(r"[^a-z0-9]+", "-", m.group(1).lstrip("#").strip().lower()).strip("-")
            continue
        counts[heading] = counts.get(heading, 0) + 1
        out.append((f"{heading}-{counts[heading]}", m.group(2)))
    return out


BLOCKS = _blocks()


def test_the_doc_has_examples():
    assert len(BLOCKS) >= 10
    assert all("MODEL_DIR" in code or "Session" not in code for _, code in BLOCKS)


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[i for i, _ in BLOCKS])
def test_example_runs(code):
    model_dir = make_model("llama-float32", "llama")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__", "MODEL_DIR": str(model_dir)})


def _table_first_column(after: str) -> list[str]:
    """The backticked names in the first column of the first table after the line `after`."""
    start = TEXT.index(after)
    rows = []
    for line in TEXT[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    names = []
    for r in rows[2:]:
        m = re.match(r"\|\s*`([^`]+)`", r)
        if m:
            names.append(m.group(1))
    return names


def test_sampling_table_lists_every_option():
    assert set(_table_first_column("## Sampling options")) == session_mod._SAMPLING_KEYS


def test_constructor_table_matches_the_signature():
    sig = inspect.signature(mlxrs.Session.__init__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    assert set(_table_first_column("Session(model")) == {p.name for p in params}

    def show(p: inspect.Parameter) -> str:
        return p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"

    keyword = [show(p) for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    positional = [show(p) for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert f"Session({', '.join(positional)}, *, {', '.join(keyword)})" in TEXT


@pytest.mark.parametrize("cls", [mlxrs.Completion, mlxrs.Usage, mlxrs.Timings, mlxrs.Chunk, session_mod.TokenLogprob])
def test_result_fields_are_documented(cls):
    section = TEXT[TEXT.index("## Results") : TEXT.index("## Text, tokens")]
    for f in dataclasses.fields(cls):
        assert f"`{f.name}" in section, f"{cls.__name__}.{f.name} is not documented"


def test_methods_are_documented():
    public = {n for n, v in vars(mlxrs.Session).items() if not n.startswith("_")}
    for name in public:
        assert f"`{name}" in TEXT or f"{name}(" in TEXT, f"Session.{name} is not documented"


def test_error_classes_are_documented():
    section = TEXT[TEXT.index("## Errors") :]
    for name in ("ModelLoadError", "UnsupportedModelError", "InvalidArgumentError", "MlxError", "NativeRuntimeError"):
        assert f"`{name}`" in section
