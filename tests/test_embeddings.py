"""Session.embed and POST /v1/embeddings: the final normed hidden states, mean-pooled and
L2-normalised. Checked independently of the embedding path: the logits of the ordinary forward pass
are lm_head · h, so h at each position is recovered from them by least squares with the LM head read
from the weights file (the tiny model's head is 512×256, full column rank)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

import mlxrs
from server_util import Server
from tinymodels import make_model


@pytest.fixture(scope="module")
def model_dir():
    return make_model("llama-float32", "llama")


@pytest.fixture(scope="module")
def session(model_dir):
    with mlxrs.Session(model_dir) as s:
        yield s


def _hidden_from_logits(session: mlxrs.Session, head: np.ndarray, ids: list[int]) -> np.ndarray:
    logits = np.array(session.logits(ids), dtype=np.float64)
    h, *_ = np.linalg.lstsq(head, logits, rcond=None)
    return h


def test_embed_is_mean_pooled_normed_hidden_state(session, model_dir):
    import mlx.core as mx

    w = mx.load(str(model_dir / "model.safetensors"))
    head = np.array(w["lm_head.weight"].astype(mx.float32), dtype=np.float64)  # [vocab, hidden]
    ids = session.tokenize("the quick brown fox jumps")
    assert len(ids) >= 4
    hs = [_hidden_from_logits(session, head, ids[:k]) for k in range(1, len(ids) + 1)]
    want = np.mean(hs, axis=0)
    want /= np.linalg.norm(want)
    got = np.array(session.embed(ids))
    assert got.shape == (session.info["hidden_size"],)
    assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert np.max(np.abs(got - want)) < 1e-3, np.max(np.abs(got - want))
    assert session.embed("the quick brown fox jumps") == session.embed(ids)
    # the last position alone is not what is returned (the pooling is over every token)
    last = hs[-1] / np.linalg.norm(hs[-1])
    assert np.max(np.abs(got - last)) > 1e-2


@pytest.fixture(scope="module")
def server(model_dir):
    with Server(model_dir) as s:
        yield s


def test_embeddings_endpoint_with_the_sdk(server, session):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = ["hello world", "a different sentence entirely"]
    r = c.embeddings.create(model="text-embedding-3-small", input=texts)  # the SDK asks for base64
    assert r.model == "llama-float32" and [d.index for d in r.data] == [0, 1]
    for d, t in zip(r.data, texts):
        assert np.allclose(d.embedding, session.embed(t), atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(session.tokenize(t)) for t in texts)
    f = c.embeddings.create(model="x", input="hello world", encoding_format="float")
    assert np.allclose(f.data[0].embedding, r.data[0].embedding, atol=1e-7)
    ids = session.tokenize("hello world")
    status, body = server.post("/v1/embeddings", {"input": ids, "encoding_format": "base64"})
    assert status == 200
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(raw, r.data[0].embedding, atol=1e-7)


def test_embeddings_errors(server):
    for body, param in [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 999999]]}, "input[0]"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]:
        status, resp = server.post("/v1/embeddings", body)
        assert status == 400 and resp["error"]["param"] == param, (body, resp)
