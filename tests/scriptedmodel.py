"""A tiny model whose weights make it say scripted text, so the server's reasoning and tool-call
paths can be driven end to end by a real model through the real engine (no server test hooks).

How: a one-layer Llama whose attention and MLP write nothing (zero output projections), so the
residual stream is the embedding of the last token; embeddings are one-hot (hidden ≥ vocab), so
the final RMSNorm gives sqrt(hidden)·e_t and `lm_head` row j scores token t by lm_head[j, t]. The
lm_head is a bigram table: each script piece (an added token) strongly predicts the next piece,
the last piece predicts EOS, and the token a chat prompt ends with predicts a script's first
piece. Which script runs therefore depends on how the prompt ends:

- ``<|im_start|>assistant\\n`` (thinking on, the Qwen3 template's default) → THINK_SCRIPT;
- ``…</think>\\n\\n`` (``enable_thinking=False``) → TOOL_SCRIPT (a Hermes/Qwen tool call);
- ANSWER_SCRIPT's first piece is scored below either default, so ``logit_bias`` (+100 on it)
  selects it at the first step while the bigram chain (logit 1000) still wins afterwards.

All other contexts score every token 0: greedy decoding then emits EOS (token 0) at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from buildlock import built_under
from chat_templates import QWEN3
from tinymodels import ROOT, write_tokenizer

THINK_SCRIPT = [
    "<think>",
    "\nThe user greets me; I should greet them back.\n",
    "</think>",
    "\n\nHello! How can I help?",
]
TOOL_SCRIPT = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n</tool_call>"]
# the same call in the other formats the server parses (one model directory per format)
TOOL_SCRIPTS = {
    "hermes": TOOL_SCRIPT,
    "llama3": ['{"name": "get_weather", "parameters": {"city": "Paris"}}'],
    "mistral": ["[TOOL_CALLS]", 'get_weather[ARGS]{"city": "Paris"}'],
    "gemma": ["```tool_code\n", 'get_weather(city="Paris")\n```'],
    "gemma4": ["<|tool_call>", 'call:get_weather{city:<|"|>Paris<|"|>}', "<tool_call|>"],
    "qwen3_coder": [
        "<tool_call>",
        "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
        "</tool_call>",
    ],
    "glm": ["<tool_call>", "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n", "</tool_call>"],
    "deepseek": [
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>",
        '{"city": "Paris"}',
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ],
    "kimi": [
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>",
        '{"city": "Paris"}',
        "<|tool_call_end|><|tool_calls_section_end|>",
    ],
    "minimax": [
        "<minimax:tool_call>",
        '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n',
        "</minimax:tool_call>",
    ],
}
# gpt-oss's harmony format: reasoning in the analysis channel, then a call (tests/test_server_toolformats.py
# serves it with the real gpt-oss template, whose prompt ends with HARMONY_TRIGGER)
HARMONY_TRIGGER = "<|start|>assistant"
HARMONY_SCRIPT = [
    "<|channel|>analysis<|message|>",
    "Need the weather.",
    "<|end|>",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",
    '{"city": "Paris"}',
    "<|call|>",
]
HARMONY_REASONING = "Need the weather."
ANSWER_SCRIPT = ["It is sunny in Paris."]
THINK_TEXT = "The user greets me; I should greet them back."
THINK_ANSWER = "Hello! How can I help?"
ANSWER_TEXT = "It is sunny in Paris."

CHAIN, DEFAULT = 1000.0, 50.0

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@built_under(ROOT)
def make_scripted_model(
    name: str = "scripted-qwen3",
    tool_script: list[str] = TOOL_SCRIPT,
    think_script: list[str] = THINK_SCRIPT,
    loop_to: int | None = None,
    template: str | None = None,
    trigger: str | None = None,
) -> Path:
    """`think_script` replaces THINK_SCRIPT (what a thinking-on prompt gets), e.g. for markup in an answer;
    with `loop_to` its last piece leads back to think_script[loop_to] instead of EOS: it talks until
    max_tokens (a long stream to interrupt). With `template` and `trigger` (the text its generation
    prompt ends with, made one token), the model serves that chat template and answers every prompt
    with `tool_script`."""
    import mlx.core as mx
    import numpy as np
    from tokenizers import AddedToken, Tokenizer

    d = ROOT / name
    if (d / ".complete").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    write_tokenizer(d, 512)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    pieces = sorted(
        {p for s in (think_script, tool_script, ANSWER_SCRIPT) for p in s}
        | {"\n\n"}
        | ({trigger} if trigger else set())
    )
    tok.add_tokens([AddedToken(p, normalized=False) for p in pieces])
    tok.save(str(d / "tokenizer.json"))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = template or QWEN3
    (d / "tokenizer_config.json").write_text(json.dumps(tc))

    vocab = tok.get_vocab_size()
    hidden = -(-vocab // 64) * 64
    heads = hidden // 64
    ids = {p: tok.token_to_id(p) for p in pieces}
    assert all(i is not None for i in ids.values()), ids
    if trigger:
        think_on = think_off = ids[trigger]
    else:
        think_on = tok.encode("<|im_start|>assistant\n").ids[-1]
        think_off = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n").ids[-1]
        assert think_on != think_off and think_off == ids["\n\n"], (think_on, think_off)

    table = np.zeros((vocab, vocab), dtype=np.float32)  # [next, last]
    for script in (think_script, tool_script, ANSWER_SCRIPT):
        seq = [ids[p] for p in script] + [0]
        if script is think_script and loop_to is not None:
            seq[-1] = ids[script[loop_to]]
        for a, b in zip(seq, seq[1:]):
            table[b, a] = CHAIN
    if not trigger:
        table[ids[think_script[0]], think_on] = DEFAULT
    table[ids[tool_script[0]], think_off] = DEFAULT
    scale = 1.0 / np.sqrt(hidden)
    lm_head = np.zeros((vocab, hidden), dtype=np.float32)
    lm_head[:, :vocab] = table * scale
    embed = np.zeros((vocab, hidden), dtype=np.float32)
    embed[np.arange(vocab), np.arange(vocab)] = 1.0

    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    z = lambda *s: np.zeros(s, dtype=np.float32)  # noqa: E731
    w = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": lm_head,
        "model.norm.weight": np.ones(hidden, np.float32),
        "model.layers.0.input_layernorm.weight": np.ones(hidden, np.float32),
        "model.layers.0.post_attention_layernorm.weight": np.ones(hidden, np.float32),
        "model.layers.0.self_attn.q_proj.weight": z(hidden, hidden),
        "model.layers.0.self_attn.k_proj.weight": z(hidden, hidden),
        "model.layers.0.self_attn.v_proj.weight": z(hidden, hidden),
        "model.layers.0.self_attn.o_proj.weight": z(hidden, hidden),
        "model.layers.0.mlp.gate_proj.weight": z(64, hidden),
        "model.layers.0.mlp.up_proj.weight": z(64, hidden),
        "model.layers.0.mlp.down_proj.weight": z(hidden, 64),
    }
    mx.save_safetensors(
        str(d / "model.safetensors"), {k: mx.array(v) for k, v in w.items()}, metadata={"format": "mlx"}
    )
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / ".complete").write_text("ok")
    return d


def token_id(model_dir: Path, piece: str) -> int:
    from tokenizers import Tokenizer

    i = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(piece)
    assert i is not None, piece
    return int(i)


# a model that thinks briefly, then counts "one two three two three …" until max_tokens
LOOP_SCRIPT = ["<think>", "\nLet me count.\n", "</think>", "\n\nOne ", "two ", "three "]


def make_looping_model() -> Path:
    return make_scripted_model("scripted-loop", think_script=LOOP_SCRIPT, loop_to=4)
