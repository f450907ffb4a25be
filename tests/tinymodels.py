"""Tiny random-weight models in the Hugging Face layout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), for every architecture mlxrs implements.

Weights are drawn with MLX's PRNG from a fixed seed and written with mx.save_safetensors, so a
model directory is reproducible. Quantized variants are produced by mlx-lm's own converter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from buildlock import built_under

ROOT = Path(__file__).resolve().parent / ".models"

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n# comments and code\tand tabs\n"
    "Large language models predict the next token. Über naïve café — 東京 and 北京, emoji 🙂🚀. "
    "Numbers 0123456789 and symbols !@#$%^&*()[]{}<>?/\\|~`'\" ; : , . "
) * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(
    d: Path,
    vocab: int,
    *,
    bos: bool = False,
    extra_specials: dict[str, str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> None:
    """A byte-level BPE trained on a small corpus, exactly `vocab` tokens (specials included);
    `extra_specials` ({attribute: token}, e.g. Gemma 3's boi/eoi/image tokens) are added as special
    tokens and named in tokenizer_config.json's extra_special_tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", *(extra_specials or {}).values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    # pad the vocabulary to exactly `vocab` with unused tokens so every model id decodes
    n = tok.get_vocab_size()
    if n < vocab:
        tok.add_tokens([f"<unused{i}>" for i in range(vocab - n)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(d / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": "<s>" if bos else None,
        "chat_template": chat_template,
        "model_max_length": 4096,
    }
    if extra_specials:
        cfg["extra_special_tokens"] = dict(extra_specials)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def _mla_moe(heads: int, layers: int) -> dict[str, Any]:
    """The latent attention and mixture shared by the deepseek_v3-family and Mistral Small 4 models:
    queries through a rank-128 LoRA, keys/values from a rank-128 latent + a 32-dim rope key (nope 64,
    v 64); layer 0 dense, the others a MoE of 8 experts of width 128, 2 per token, in 1 of 2 groups,
    plus 1 shared expert."""
    return dict(
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_key_value_heads=heads,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        num_hidden_layers=max(layers, 3),
        tie_word_embeddings=False,
        attention_bias=False,
    )


def _yarn(original: int, mscale_all_dim: float) -> dict[str, Any]:
    """YaRN rope scaling by 4 from `original` positions (mscale 1, `mscale_all_dim` as given)."""
    return {
        "factor": 4.0,
        "original_max_position_embeddings": original,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": mscale_all_dim,
    }


def _yarn_llama4() -> dict[str, Any]:
    """rope_parameters of YaRN (factor 4, mscale_all_dim 1) with Llama 4's query scale stepping every 32
    positions (original_max_position_embeddings), so a 64-token generation crosses two steps."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, **_yarn(32, 1.0), "llama_4_scaling_beta": 0.1}


def base_config(
    arch: str,
    *,
    vocab: int = 512,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    inter: int = 512,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "eos_token_id": 0,
    }
    if arch == "llama":
        cfg.update(tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    elif arch == "qwen2":
        cfg.update(tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    elif arch == "qwen3":
        cfg.update(tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    elif arch == "qwen3_moe":
        # 8 experts of width 128, 2 per token; layer 1 of 3 dense (mlp_only_layers)
        cfg.update(
            tie_word_embeddings=False,
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            num_hidden_layers=max(layers, 3),
        )
    elif arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        # Gated DeltaNet linear attention on layers 0, 2; gated full attention on 1, 3
        # (full_attention_interval 2); 2 key heads shared by 4 value heads; a quarter of each
        # head rotated. qwen3_next as released: every layer a MoE with a gated shared expert.
        n = max(layers, 4)
        cfg.update(
            num_hidden_layers=n,
            full_attention_interval=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
            attention_bias=False,
            layer_types=["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
        )
        if arch == "qwen3_next":
            cfg.update(
                architectures=["Qwen3NextForCausalLM"],
                partial_rotary_factor=0.25,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
            )
        else:
            del cfg["rope_theta"]
            if arch == "qwen3_5_moe":
                cfg.update(
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=128,
                    shared_expert_intermediate_size=128,
                    norm_topk_prob=True,
                )
            cfg.update(
                architectures=["Qwen3_5ForCausalLM"],
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
            )
    elif arch == "mixtral":
        # 8 experts of width 128 (mixtral's intermediate_size), 2 per token, in every layer; the head
        # dim derived from hidden_size (mixtral has none), the window unused as in mlx-lm
        del cfg["head_dim"]
        cfg.update(
            tie_word_embeddings=False,
            architectures=["MixtralForCausalLM"],
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=128,
            sliding_window=None,
            rms_norm_eps=1e-5,
        )
    elif arch == "glm4_moe":
        # layer 0 dense (first_k_dense_replace), layers 1-2 a MoE of 8 experts of width 128, 2 per token,
        # chosen in 1 of 2 groups (sigmoid scores + e_score_correction_bias) and scaled by 2.5, plus 1
        # shared expert; q/k/v biases, qk-norm, half the head dim rotated; an MTP layer 3 to drop
        cfg.update(
            tie_word_embeddings=False,
            architectures=["Glm4MoeForCausalLM"],
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            partial_rotary_factor=0.5,
            rope_scaling=None,
            num_hidden_layers=max(layers, 3),
            num_nextn_predict_layers=1,
        )
    elif arch == "gpt_oss":
        # 4 layers alternating a 16-token window and full attention, attention sinks, biases everywhere;
        # 8 biased experts of width 128 (gpt-oss's intermediate_size), 2 per token, clamped SwiGLU
        cfg.update(
            architectures=["GptOssForCausalLM"],
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=128,
            sliding_window=16,
            rms_norm_eps=1e-5,
            num_hidden_layers=max(layers, 4),
            rope_scaling=None,
            layer_types=["sliding_attention", "full_attention"] * (max(layers, 4) // 2),
        )
    elif arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        # multi-head latent attention: queries through a rank-128 LoRA, keys/values from a rank-128
        # latent + a 32-dim rope key (nope 64, v 64), YaRN (factor 4, mscale_all_dim 0.8: the rope's
        # mscale and the softmax scale both != 1); layer 0 dense, layers 1-2 a MoE of 8 experts
        # of width 128, 2 per token, in 1 of 2 groups, scaled by 2.5, plus 1 shared expert
        del cfg["head_dim"]
        cfg.update(
            _mla_moe(heads, layers),
            architectures=["DeepseekV3ForCausalLM"],
            routed_scaling_factor=2.5,
            moe_layer_freq=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            rope_scaling={"type": "yarn", **_yarn(1024, 0.8)},
        )
        if arch != "deepseek_v3":
            # the sparse-attention indexer: 4 heads of 64, the best 16 positions per query (a strict
            # subset of any prompt past 16 tokens); its rope mlx-lm's default (interleaved for GLM-5)
            cfg.update(index_n_heads=4, index_head_dim=64, index_topk=16)
        if arch == "glm_moe_dsa":  # GLM-5: the rope in rope_parameters (a plain one here)
            del cfg["rope_scaling"], cfg["rope_theta"]
            cfg.update(
                architectures=["GlmMoeDsaForCausalLM"], rope_parameters={"rope_theta": 50000.0, "rope_type": "default"}
            )
    elif arch == "mistral4":
        # Mistral Small 4: deepseek_v3's latent attention (q rank 128, latent 128 + a 32-dim rope key,
        # nope 64, v 64), the rope in rope_parameters (YaRN factor 4, mscale_all_dim 1: the rope's
        # mscale and the softmax scale both != 1) with Llama 4's query scale stepping every 32
        # positions (original_max_position_embeddings), so a 64-token generation crosses a step; layer
        # 0 dense, layers 1-2 a MoE of 8 experts of width 128, 2 per token, chosen by softmax in 1 of
        # 2 groups, scaled by 1.5, plus 1 shared expert; experts in Hugging Face's fused layout
        del cfg["head_dim"], cfg["rope_theta"]
        cfg.update(
            _mla_moe(heads, layers),
            architectures=["Mistral3ForConditionalGeneration"],
            routed_scaling_factor=1.5,
            rope_parameters=_yarn_llama4(),
        )
    elif arch == "ministral3":
        # Ministral 3: Llama's decoder, the rope in rope_parameters (YaRN factor 4, mscale_all_dim 1)
        # with Llama 4's query scale stepping every 32 positions (original_max_position_embeddings),
        # so a 64-token generation crosses two steps; the head tied (mlx-lm's default)
        del cfg["rope_theta"]
        cfg.update(
            architectures=["Ministral3ForCausalLM"],
            tie_word_embeddings=True,
            rope_parameters=_yarn_llama4(),
        )
    elif arch == "gemma3_text":
        cfg.update(
            sliding_window=16,
            sliding_window_pattern=2,
            query_pre_attn_scalar=head_dim,
            rope_local_base_freq=10000.0,
            architectures=["Gemma3ForCausalLM"],
        )
    elif arch in ("gemma4_text", "gemma4_text_moe", "gemma4_text_full"):
        # 6 layers sliding/global alternating (window 16), the last 2 reading layers 2 and 3's KV
        # (double-wide MLPs); global layers with twice the head dim and a proportional rope on a
        # quarter of it; per-layer inputs of 64; soft-capped logits. The MoE variant: 8 GeGLU experts
        # (2 per token) beside the MLP, keys as values on the global layers (1 KV head), an untied
        # head. The full variant: every layer global (a model the engine can stack).
        types = ["sliding_attention", "full_attention"] * (max(layers, 6) // 2)
        cfg.update(
            model_type="gemma4_text",
            num_hidden_layers=len(types),
            layer_types=types,
            sliding_window=16,
            global_head_dim=2 * head_dim,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=64,
            vocab_size_per_layer_input=vocab,
            final_logit_softcapping=30.0,
            use_double_wide_mlp=True,
            tie_word_embeddings=True,
            architectures=["Gemma4ForCausalLM"],
            rope_parameters={
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
        )
        if arch == "gemma4_text_moe":
            cfg.update(
                enable_moe_block=True,
                num_experts=8,
                top_k_experts=2,
                moe_intermediate_size=128,
                attention_k_eq_v=True,
                num_global_key_value_heads=1,
                tie_word_embeddings=False,
            )
        if arch == "gemma4_text_full":
            cfg.update(layer_types=["full_attention"] * len(types))
    elif arch in ("mistral3", "mistral3_llama", "mistral3_ministral3"):
        # Mistral's multimodal layout: the text model in text_config (mistral4, ministral3 as the
        # Ministral 3 releases ship, or a Mistral/Llama one), the head untied by mistral3's default,
        # its weights under model.language_model.*, a vision tower and projector the loaders drop
        inner_arch = {"mistral3": "mistral4", "mistral3_llama": "llama", "mistral3_ministral3": "ministral3"}[arch]
        text = base_config(
            inner_arch,
            vocab=vocab,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            inter=inter,
        )
        if arch == "mistral3_ministral3":
            del text["tie_word_embeddings"]
        if arch == "mistral3_llama":
            text.update(model_type="mistral")
            del text["tie_word_embeddings"], text["architectures"]
        cfg = {
            "model_type": "mistral3",
            "text_config": text,
            "vision_config": {"model_type": "pixtral"},
            "eos_token_id": 0,
            "image_token_index": 10,
            "architectures": ["Mistral3ForConditionalGeneration"],
        }
    elif arch == "gemma4":
        # the multimodal layout: the text model in text_config, its weights under
        # model.language_model.*, a vision tower the loaders drop
        text = base_config(
            "gemma4_text",
            vocab=vocab,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            inter=inter,
        )
        cfg = {
            "model_type": "gemma4",
            "vocab_size": vocab,
            "text_config": text,
            "eos_token_id": 0,
            "tie_word_embeddings": True,
            "architectures": ["Gemma4ForConditionalGeneration"],
        }
    return cfg


def _weights(arch: str, cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import mlx.core as mx

    key = mx.random.key(seed)
    counter = [0]

    def rnd(shape: tuple[int, ...], scale: float) -> Any:
        counter[0] += 1
        return (
            mx.random.normal(shape, key=mx.random.fold_in(key, counter[0])) * scale
            if hasattr(mx.random, "fold_in")
            else mx.random.normal(shape, key=mx.random.split(key, counter[0] + 1)[counter[0]]) * scale
        )

    if cfg["model_type"] == "gemma4":
        w = {
            k.replace("model.", "model.language_model.", 1): x
            for k, x in _gemma4_weights(cfg["text_config"], rnd).items()
        }
        w["model.vision_tower.patch_embedder.weight"] = rnd((8, 8), 1.0)
        return w
    if cfg["model_type"] == "mistral3":
        text = cfg["text_config"]
        untied = {**text, "tie_word_embeddings": text.get("tie_word_embeddings", False)}  # mistral3's default
        inner = _weights("mistral4" if text["model_type"] == "mistral4" else "llama", untied, seed)
        w = {
            (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): x
            for k, x in inner.items()
        }
        w["model.vision_tower.patch_conv.weight"] = rnd((8, 3, 2, 2), 1.0)
        w["model.multi_modal_projector.linear_1.weight"] = rnd((8, 8), 1.0)
        return w
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    if cfg["model_type"] == "gemma4_text":
        return _gemma4_weights(cfg, rnd)
    gemma = arch == "gemma3_text"

    def norm(n: int) -> Any:  # gemma stores an offset from one
        return rnd((n,), 0.1) if gemma else 1.0 + rnd((n,), 0.1)

    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        return _qwen3_next_weights(arch, cfg, rnd)
    w: dict[str, Any] = {
        "model.embed_tokens.weight": rnd((v, h), 0.5 if not gemma else 0.05),
        "model.norm.weight": norm(h),
    }
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        if arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "mistral4"):
            # the Hugging Face layout (kv_b_proj, which the loaders split into embed_q/unembed_out)
            a, qk = f"{p}.self_attn", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            kr, vd, qr = cfg["kv_lora_rank"], cfg["v_head_dim"], cfg["q_lora_rank"]
            if qr is None:
                w[f"{a}.q_proj.weight"] = rnd((nh * qk, h), h**-0.5)
            else:
                w[f"{a}.q_a_proj.weight"] = rnd((qr, h), h**-0.5)
                w[f"{a}.q_a_layernorm.weight"] = norm(qr)
                w[f"{a}.q_b_proj.weight"] = rnd((nh * qk, qr), qr**-0.5)
            w[f"{a}.kv_a_proj_with_mqa.weight"] = rnd((kr + cfg["qk_rope_head_dim"], h), h**-0.5)
            w[f"{a}.kv_a_layernorm.weight"] = norm(kr)
            w[f"{a}.kv_b_proj.weight"] = rnd((nh * (cfg["qk_nope_head_dim"] + vd), kr), kr**-0.5)
            w[f"{a}.o_proj.weight"] = rnd((h, nh * vd), (nh * vd) ** -0.5)
            if "index_topk" in cfg:
                ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
                w[f"{a}.indexer.wq_b.weight"] = rnd((ih * ihd, qr), qr**-0.5)
                w[f"{a}.indexer.wk.weight"] = rnd((ihd, h), h**-0.5)
                w[f"{a}.indexer.k_norm.weight"] = norm(ihd)
                w[f"{a}.indexer.k_norm.bias"] = rnd((ihd,), 0.1)
                w[f"{a}.indexer.weights_proj.weight"] = rnd((ih, h), h**-0.5)
        else:
            w[f"{p}.self_attn.q_proj.weight"] = rnd((nh * hd, h), h**-0.5)
            w[f"{p}.self_attn.k_proj.weight"] = rnd((nkv * hd, h), h**-0.5)
            w[f"{p}.self_attn.v_proj.weight"] = rnd((nkv * hd, h), h**-0.5)
            w[f"{p}.self_attn.o_proj.weight"] = rnd((h, nh * hd), (nh * hd) ** -0.5)
        if arch == "qwen3_moe" and l not in cfg["mlp_only_layers"]:
            # the Hugging Face layout, one tensor per expert (the loaders stack them)
            ne, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            w[f"{p}.mlp.gate.weight"] = rnd((ne, h), h**-0.5)
            for e in range(ne):
                w[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rnd((mi, h), h**-0.5)
                w[f"{p}.mlp.experts.{e}.up_proj.weight"] = rnd((mi, h), h**-0.5)
                w[f"{p}.mlp.experts.{e}.down_proj.weight"] = rnd((h, mi), mi**-0.5)
        elif arch == "mixtral":
            # the Hugging Face layout: w1 (gate), w2 (down), w3 (up) per expert
            ne, p2 = cfg["num_local_experts"], f"{p}.block_sparse_moe"
            w[f"{p2}.gate.weight"] = rnd((ne, h), h**-0.5)
            for e in range(ne):
                w[f"{p2}.experts.{e}.w1.weight"] = rnd((i, h), h**-0.5)
                w[f"{p2}.experts.{e}.w2.weight"] = rnd((h, i), i**-0.5)
                w[f"{p2}.experts.{e}.w3.weight"] = rnd((i, h), h**-0.5)
        elif arch == "mistral4" and l >= cfg["first_k_dense_replace"]:
            # Hugging Face's fused layout: gate and up stacked in one tensor per layer, down in another
            ne, mi, ns = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
            w[f"{p}.mlp.gate.weight"] = rnd((ne, h), h**-0.5)
            w[f"{p}.mlp.experts.gate_up_proj"] = rnd((ne, 2 * mi, h), h**-0.5)
            w[f"{p}.mlp.experts.down_proj"] = rnd((ne, h, mi), mi**-0.5)
            w[f"{p}.mlp.shared_experts.gate_proj.weight"] = rnd((mi * ns, h), h**-0.5)
            w[f"{p}.mlp.shared_experts.up_proj.weight"] = rnd((mi * ns, h), h**-0.5)
            w[f"{p}.mlp.shared_experts.down_proj.weight"] = rnd((h, mi * ns), (mi * ns) ** -0.5)
        elif arch in ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa") and l >= cfg["first_k_dense_replace"]:
            ne, mi, ns = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
            w[f"{p}.mlp.gate.weight"] = rnd((ne, h), h**-0.5)
            w[f"{p}.mlp.gate.e_score_correction_bias"] = rnd((ne,), 0.3)
            for e in range(ne):
                w[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rnd((mi, h), h**-0.5)
                w[f"{p}.mlp.experts.{e}.up_proj.weight"] = rnd((mi, h), h**-0.5)
                w[f"{p}.mlp.experts.{e}.down_proj.weight"] = rnd((h, mi), mi**-0.5)
            w[f"{p}.mlp.shared_experts.gate_proj.weight"] = rnd((mi * ns, h), h**-0.5)
            w[f"{p}.mlp.shared_experts.up_proj.weight"] = rnd((mi * ns, h), h**-0.5)
            w[f"{p}.mlp.shared_experts.down_proj.weight"] = rnd((h, mi * ns), (mi * ns) ** -0.5)
        elif arch == "gpt_oss":
            # mlx-lm's layout (its sanitize passes a checkpoint with gate_proj.weight through)
            ne = cfg["num_local_experts"]
            w[f"{p}.mlp.router.weight"] = rnd((ne, h), h**-0.5)
            w[f"{p}.mlp.router.bias"] = rnd((ne,), 0.5)
            for proj, shape in [("gate_proj", (ne, i, h)), ("up_proj", (ne, i, h)), ("down_proj", (ne, h, i))]:
                # gate scaled up so that the clamp at 7 is reached
                w[f"{p}.mlp.experts.{proj}.weight"] = rnd(
                    shape, (4.0 if proj == "gate_proj" else 1.0) * shape[2] ** -0.5
                )
                w[f"{p}.mlp.experts.{proj}.bias"] = rnd(shape[:2], 0.5)
            w[f"{p}.self_attn.sinks"] = rnd((nh,), 1.0)
            w[f"{p}.self_attn.q_proj.bias"] = rnd((nh * hd,), 0.1)
            w[f"{p}.self_attn.k_proj.bias"] = rnd((nkv * hd,), 0.1)
            w[f"{p}.self_attn.v_proj.bias"] = rnd((nkv * hd,), 0.1)
            w[f"{p}.self_attn.o_proj.bias"] = rnd((h,), 0.1)
        else:
            w[f"{p}.mlp.gate_proj.weight"] = rnd((i, h), h**-0.5)
            w[f"{p}.mlp.up_proj.weight"] = rnd((i, h), h**-0.5)
            w[f"{p}.mlp.down_proj.weight"] = rnd((h, i), i**-0.5)
        w[f"{p}.input_layernorm.weight"] = norm(h)
        w[f"{p}.post_attention_layernorm.weight"] = norm(h)
        if arch in ("qwen2", "glm4_moe"):
            w[f"{p}.self_attn.q_proj.bias"] = rnd((nh * hd,), 0.1)
            w[f"{p}.self_attn.k_proj.bias"] = rnd((nkv * hd,), 0.1)
            w[f"{p}.self_attn.v_proj.bias"] = rnd((nkv * hd,), 0.1)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text", "glm4_moe"):
            w[f"{p}.self_attn.q_norm.weight"] = norm(hd)
            w[f"{p}.self_attn.k_norm.weight"] = norm(hd)
        if gemma:
            w[f"{p}.pre_feedforward_layernorm.weight"] = norm(h)
            w[f"{p}.post_feedforward_layernorm.weight"] = norm(h)
        if arch == "llama":
            w[f"{p}.self_attn.rotary_emb.inv_freq"] = rnd((hd // 2,), 1.0)  # sanitize must drop it
    if arch == "glm4_moe":  # the multi-token-prediction layer, which the loaders drop
        w[f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"] = rnd((h, 2 * h), h**-0.5)
    if (not cfg.get("tie_word_embeddings", True) and not gemma) or arch == "gpt_oss":
        w["lm_head.weight"] = rnd((v, h), h**-0.5)
    return w


def _gemma4_weights(cfg: dict[str, Any], rnd: Any) -> dict[str, Any]:
    """Gemma 4 in the Hugging Face layout: every layer with k/v projections (sanitize drops the
    KV-shared layers'), the experts as `gate_up_proj` / `down_proj` (sanitize splits them)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    pl, first_shared = cfg["hidden_size_per_layer_input"], n - cfg["num_kv_shared_layers"]

    def norm(k: int) -> Any:
        return 1.0 + rnd((k,), 0.1)

    w: dict[str, Any] = {
        "model.embed_tokens.weight": rnd((v, h), 0.05),
        "model.norm.weight": norm(h),
        "model.embed_tokens_per_layer.weight": rnd((v, n * pl), 0.1),
        "model.per_layer_model_projection.weight": rnd((n * pl, h), h**-0.5),
        "model.per_layer_projection_norm.weight": norm(pl),
    }
    for l in range(n):
        p = f"model.layers.{l}"
        full = cfg["layer_types"][l] == "full_attention"
        hd = cfg["global_head_dim"] if full else cfg["head_dim"]
        kv = cfg.get("num_global_key_value_heads", nkv) if full and cfg.get("attention_k_eq_v") else nkv
        w[f"{p}.self_attn.q_proj.weight"] = rnd((nh * hd, h), h**-0.5)
        w[f"{p}.self_attn.k_proj.weight"] = rnd((kv * hd, h), h**-0.5)
        if not (full and cfg.get("attention_k_eq_v")):
            w[f"{p}.self_attn.v_proj.weight"] = rnd((kv * hd, h), h**-0.5)
        w[f"{p}.self_attn.o_proj.weight"] = rnd((h, nh * hd), (nh * hd) ** -0.5)
        w[f"{p}.self_attn.q_norm.weight"] = norm(hd)
        w[f"{p}.self_attn.k_norm.weight"] = norm(hd)
        w[f"{p}.self_attn.rotary_emb.inv_freq"] = rnd((hd // 2,), 1.0)  # sanitize must drop it
        wi = i * (2 if l >= first_shared and cfg["use_double_wide_mlp"] else 1)
        w[f"{p}.mlp.gate_proj.weight"] = rnd((wi, h), h**-0.5)
        w[f"{p}.mlp.up_proj.weight"] = rnd((wi, h), h**-0.5)
        w[f"{p}.mlp.down_proj.weight"] = rnd((h, wi), wi**-0.5)
        for k in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_per_layer_input_norm",
        ):
            w[f"{p}.{k}.weight"] = norm(h)
        w[f"{p}.per_layer_input_gate.weight"] = rnd((pl, h), h**-0.5)
        w[f"{p}.per_layer_projection.weight"] = rnd((h, pl), pl**-0.5)
        w[f"{p}.layer_scalar"] = 1.0 + rnd((1,), 0.1)
        if cfg.get("enable_moe_block"):
            ne, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            w[f"{p}.router.proj.weight"] = rnd((ne, h), h**-0.5)
            w[f"{p}.router.scale"] = norm(h)
            w[f"{p}.router.per_expert_scale"] = norm(ne)
            w[f"{p}.experts.gate_up_proj"] = rnd((ne, 2 * mi, h), h**-0.5)
            w[f"{p}.experts.down_proj"] = rnd((ne, h, mi), mi**-0.5)
            for k in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                w[f"{p}.{k}.weight"] = norm(h)
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = rnd((v, h), h**-0.5)
    return w


def _qwen3_next_weights(arch: str, cfg: dict[str, Any], rnd: Any) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 in the Hugging Face layout: conv1d weights [C, 1, K], the decoder's
    RMSNorms stored as offsets from one (the loaders fold them), per-expert MoE tensors."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kern = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    kd, vd = nk * dk, nv * dv
    w: dict[str, Any] = {
        "model.embed_tokens.weight": rnd((v, h), 0.5),
        "model.norm.weight": rnd((h,), 0.1),
        "lm_head.weight": rnd((v, h), h**-0.5),
    }
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        if (l + 1) % cfg["full_attention_interval"]:
            a = f"{p}.linear_attn"
            if arch == "qwen3_next":
                w[f"{a}.in_proj_qkvz.weight"] = rnd((2 * kd + 2 * vd, h), h**-0.5)
                w[f"{a}.in_proj_ba.weight"] = rnd((2 * nv, h), h**-0.5)
            else:
                w[f"{a}.in_proj_qkv.weight"] = rnd((2 * kd + vd, h), h**-0.5)
                w[f"{a}.in_proj_z.weight"] = rnd((vd, h), h**-0.5)
                w[f"{a}.in_proj_b.weight"] = rnd((nv, h), h**-0.5)
                w[f"{a}.in_proj_a.weight"] = rnd((nv, h), h**-0.5)
            w[f"{a}.conv1d.weight"] = rnd((2 * kd + vd, 1, kern), 0.5)
            w[f"{a}.dt_bias"] = 1.0 + rnd((nv,), 0.1)
            w[f"{a}.A_log"] = rnd((nv,), 0.5)
            w[f"{a}.norm.weight"] = 1.0 + rnd((dv,), 0.1)
            w[f"{a}.out_proj.weight"] = rnd((h, vd), vd**-0.5)
        else:
            a = f"{p}.self_attn"
            w[f"{a}.q_proj.weight"] = rnd((2 * nh * hd, h), h**-0.5)
            w[f"{a}.k_proj.weight"] = rnd((nkv * hd, h), h**-0.5)
            w[f"{a}.v_proj.weight"] = rnd((nkv * hd, h), h**-0.5)
            w[f"{a}.o_proj.weight"] = rnd((h, nh * hd), (nh * hd) ** -0.5)
            w[f"{a}.q_norm.weight"] = rnd((hd,), 0.1)
            w[f"{a}.k_norm.weight"] = rnd((hd,), 0.1)
        if cfg.get("num_experts", 0) > 0:
            ne, mi, si = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
            w[f"{p}.mlp.gate.weight"] = rnd((ne, h), h**-0.5)
            if arch == "qwen3_5_moe":  # the experts fused: gate and up stacked, [experts, 2 * width, hidden]
                w[f"{p}.mlp.experts.gate_up_proj"] = rnd((ne, 2 * mi, h), h**-0.5)
                w[f"{p}.mlp.experts.down_proj"] = rnd((ne, h, mi), mi**-0.5)
            for e in range(ne if arch == "qwen3_next" else 0):
                w[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rnd((mi, h), h**-0.5)
                w[f"{p}.mlp.experts.{e}.up_proj.weight"] = rnd((mi, h), h**-0.5)
                w[f"{p}.mlp.experts.{e}.down_proj.weight"] = rnd((h, mi), mi**-0.5)
            w[f"{p}.mlp.shared_expert.gate_proj.weight"] = rnd((si, h), h**-0.5)
            w[f"{p}.mlp.shared_expert.up_proj.weight"] = rnd((si, h), h**-0.5)
            w[f"{p}.mlp.shared_expert.down_proj.weight"] = rnd((h, si), si**-0.5)
            w[f"{p}.mlp.shared_expert_gate.weight"] = rnd((1, h), h**-0.5)
        else:
            w[f"{p}.mlp.gate_proj.weight"] = rnd((i, h), h**-0.5)
            w[f"{p}.mlp.up_proj.weight"] = rnd((i, h), h**-0.5)
            w[f"{p}.mlp.down_proj.weight"] = rnd((h, i), i**-0.5)
        w[f"{p}.input_layernorm.weight"] = rnd((h,), 0.1)
        w[f"{p}.post_attention_layernorm.weight"] = rnd((h,), 0.1)
    return w


@built_under(ROOT)
def make_model(
    name: str,
    arch: str,
    *,
    dtype: str = "float32",
    quant_bits: int | None = None,
    quant_mode: str = "affine",
    quant_mix: str | None = None,
    seed: int = 0,
    bos: bool = False,
    **shape: Any,
) -> Path:
    """Write (once) and return the directory of a tiny model. `quant_bits`: quantized by mlx-lm's
    `convert` in `quant_mode` (affine: group size 64; the other modes: theirs). `quant_mix`
    "experts-mxfp4": mlx-lm's convert with a predicate quantizing the routed experts mxfp4 (per-layer
    config entries), the attention projections affine `quant_bits` (the global entry), the rest not;
    "experts-only-mxfp4": the experts mxfp4, nothing else quantized."""
    import mlx.core as mx

    d = ROOT / name
    # what the directory was built from, kept in its .complete marker: one name is one model, and a
    # second caller asking the same name for another model is a test bug (whichever ran first would
    # decide what both get), so it fails here rather than testing the wrong model
    params = json.dumps(
        dict(
            arch=arch,
            dtype=dtype,
            quant_bits=quant_bits,
            quant_mode=quant_mode,
            quant_mix=quant_mix,
            seed=seed,
            bos=bos,
            shape=shape,
        ),
        sort_keys=True,
    )
    if (d / ".complete").exists():
        built = (d / ".complete").read_text()
        if built == params:
            return d
        if built.startswith("{"):
            raise ValueError(f"tiny model {name!r} was built as {built}, now asked for as {params}: use another name")
    shutil.rmtree(d, ignore_errors=True)
    src = d if quant_bits is None else ROOT / f"{name}.src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    # "qwen3_5-vl": Qwen3.5 as its multimodal checkpoints ship it: the text config in text_config,
    # the text weights under model.language_model, a vision tower beside them (loaders drop it)
    wrapped = arch == "qwen3_5-vl"
    arch = "qwen3_5" if wrapped else arch
    cfg = base_config(arch, **shape)
    cfg["torch_dtype"] = dtype
    w = _weights(arch, cfg, seed)
    if wrapped:
        w = {
            (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): x for k, x in w.items()
        }
        w["model.visual.patch_embed.proj.weight"] = w["lm_head.weight"][:8]
        cfg = {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": cfg,
            "vision_config": {"depth": 1},
            "eos_token_id": cfg["eos_token_id"],
            "torch_dtype": dtype,
        }
    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype]
    w = {k: x.astype(dt) for k, x in w.items()}
    mx.eval(w)
    mx.save_safetensors(str(src / "model.safetensors"), w, metadata={"format": "mlx"})
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(src, cfg.get("text_config", cfg)["vocab_size"], bos=bos)
    if quant_bits is not None:
        from mlx_lm import convert

        shutil.rmtree(d, ignore_errors=True)
        predicate = None
        if quant_mix in ("experts-mxfp4", "experts-only-mxfp4"):

            def predicate(path: str, _module: Any) -> bool | dict[str, Any]:
                if ".experts." in path or ".switch_mlp." in path:
                    return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
                return quant_mix == "experts-mxfp4" and ".self_attn." in path
        elif quant_mix is not None:
            raise ValueError(f"unknown quant_mix {quant_mix!r}")
        convert(
            hf_path=str(src),
            mlx_path=str(d),
            quantize=True,
            q_bits=quant_bits,
            q_group_size=64 if quant_mode == "affine" else None,
            q_mode=quant_mode,
            quant_predicate=predicate,
        )
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, d / f)
        shutil.rmtree(src, ignore_errors=True)
    (d / ".complete").write_text(params)
    return d


# The memory planner's test models (tests/test_fit.py, bench/fit_calibration.py): name -> (architecture,
# dtype, shape). Weights of 100-350 MB, and a KV cache of up to 64 KiB/token.
FIT_MODELS: dict[str, tuple[str, str, dict[str, int]]] = {
    # 8 layers × 8 KV heads × 128 × K,V × 4 B = 64 KiB/token; 88M parameters (352 MB)
    "fit-llama-f32": (
        "llama",
        "float32",
        dict(hidden=1024, layers=8, heads=8, kv_heads=8, head_dim=128, inter=2048, vocab=2048),
    ),
    # Gemma 3: every 2nd layer full attention, the others a 16-token sliding window (KV capped)
    "fit-gemma3-f32": (
        "gemma3_text",
        "float32",
        dict(hidden=768, layers=6, heads=4, kv_heads=2, head_dim=192, inter=3072, vocab=2048),
    ),
    # bfloat16 weights, KV and activations; GQA 16/4 (MLX's CPU matmul is slow in bfloat16: short prompts)
    "fit-qwen3-bf16": (
        "qwen3",
        "bfloat16",
        dict(hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, inter=2816, vocab=2048),
    ),
    # fit-llama-f32's shape in bfloat16: separates the dtype from the architecture
    "fit-llama-bf16": (
        "llama",
        "bfloat16",
        dict(hidden=1024, layers=8, heads=8, kv_heads=8, head_dim=128, inter=2048, vocab=2048),
    ),
}


@built_under(ROOT)
def make_fit_model(name: str) -> Path:
    """Write (once) and return one of FIT_MODELS."""
    arch, dtype, shape = FIT_MODELS[name]
    return make_model(name, arch, dtype=dtype, **shape)


# Gemma 3's image markers (its tokenizer's boi/eoi/image tokens)
GEMMA3_SPECIALS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}

# A Gemma-style chat template that renders image content parts as the boi marker, as Gemma 3's does
GEMMA3_CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@built_under(ROOT)
def make_gemma3_vision(
    name: str = "gemma3-vision-f32",
    *,
    dtype: str = "float32",
    image_size: int = 112,
    patch: int = 14,
    mm_tokens: int = 16,
    seed: int = 0,
) -> Path:
    """Write (once) a tiny random Gemma 3 multimodal model in the Hugging Face layout (as
    transformers 4 and mlx-vlm save it): `language_model.model.*`, `vision_tower.vision_model.*`
    (the patch convolution in PyTorch's [out, in, kh, kw]), `multi_modal_projector.*`;
    preprocessor_config.json and processor_config.json for Gemma 3's processor, a tokenizer with
    its image markers. mlx-vlm 0.7.10 loads it."""
    import mlx.core as mx

    d = ROOT / name
    if (d / ".complete").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    text = base_config("gemma3_text", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, inter=256)
    text.update(rope_theta=1_000_000.0, mm_tokens_per_image=mm_tokens)
    text.pop("eos_token_id")
    text.pop("architectures")
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": patch,
        "image_size": image_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }
    write_tokenizer(d, text["vocab_size"], extra_specials=GEMMA3_SPECIALS, chat_template=GEMMA3_CHAT_TEMPLATE)
    tok = json.loads((d / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "mm_tokens_per_image": mm_tokens,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "eos_token_id": 0,
        "torch_dtype": dtype,
    }
    w = {f"language_model.{k}": v for k, v in _weights("gemma3_text", text, seed).items()}
    keys = iter(mx.random.split(mx.random.key(seed + 1), 64))

    def rnd(shape: tuple[int, ...], scale: float) -> Any:
        return mx.random.normal(shape, key=next(keys)) * scale

    vh, vi = vision["hidden_size"], vision["intermediate_size"]
    p = "vision_tower.vision_model"
    w[f"{p}.embeddings.patch_embedding.weight"] = rnd((vh, 3, patch, patch), (3 * patch * patch) ** -0.5)
    w[f"{p}.embeddings.patch_embedding.bias"] = rnd((vh,), 0.1)
    w[f"{p}.embeddings.position_embedding.weight"] = rnd(((image_size // patch) ** 2, vh), 0.5)
    for i in range(vision["num_hidden_layers"]):
        l = f"{p}.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{l}.self_attn.{proj}.weight"] = rnd((vh, vh), vh**-0.5)
            w[f"{l}.self_attn.{proj}.bias"] = rnd((vh,), 0.1)
        for ln in ("layer_norm1", "layer_norm2"):
            w[f"{l}.{ln}.weight"] = 1.0 + rnd((vh,), 0.1)
            w[f"{l}.{ln}.bias"] = rnd((vh,), 0.1)
        w[f"{l}.mlp.fc1.weight"] = rnd((vi, vh), vh**-0.5)
        w[f"{l}.mlp.fc1.bias"] = rnd((vi,), 0.1)
        w[f"{l}.mlp.fc2.weight"] = rnd((vh, vi), vi**-0.5)
        w[f"{l}.mlp.fc2.bias"] = rnd((vh,), 0.1)
    w[f"{p}.post_layernorm.weight"] = 1.0 + rnd((vh,), 0.1)
    w[f"{p}.post_layernorm.bias"] = rnd((vh,), 0.1)
    w["multi_modal_projector.mm_soft_emb_norm.weight"] = rnd((vh,), 0.1)
    # scaled so that the image embeddings are of the text embeddings' order after mlx-vlm's merge
    w["multi_modal_projector.mm_input_projection_weight"] = rnd((vh, text["hidden_size"]), 0.2)
    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    w = {k: x.astype(dt) for k, x in w.items()}
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma3ImageProcessor",
                "processor_class": "Gemma3Processor",
                "do_resize": True,
                "size": {"height": image_size, "width": image_size},
                "resample": 2,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": True,
                "do_pan_and_scan": False,
            },
            indent=2,
        )
    )
    (d / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": mm_tokens})
    )
    (d / ".complete").write_text("ok")
    return d


# Gemma 4's image markers (its tokenizer's boi/eoi/image tokens; the video token mlx-vlm's processor
# would otherwise add past the vocabulary)
GEMMA4_SPECIALS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "video_token": "<|video|>",
}

# Gemma 3's template shape with Gemma 4's image marker (its image token, which the processor expands)
GEMMA4_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("<start_of_image>", "<|image|>")


@built_under(ROOT)
def make_gemma4_vision(
    name: str = "gemma4-vision-f32",
    *,
    dtype: str = "float32",
    seed: int = 0,
    vision_overrides: dict[str, Any] | None = None,
    max_soft_tokens: int = 16,
) -> Path:
    """Write (once) a tiny random Gemma 4 multimodal model in the Hugging Face layout (as
    transformers saves Gemma4ForConditionalGeneration): the text model (tests' gemma4_text shape,
    per-layer inputs, KV sharing) under `model.language_model.*`, a vision tower of 8×8 patches
    pooled 2×2 (at most 16 image tokens, standardized, clipped linears with bounds that clip) under
    `model.vision_tower.*`, `model.embed_vision.*`; processor_config.json for Gemma 4's processor
    and a tokenizer with its image markers. mlx-vlm 0.7.10 loads it. `vision_overrides` (another
    name then) changes the tower's sizes, `max_soft_tokens` the largest image."""
    import mlx.core as mx

    d = ROOT / name
    if (d / ".complete").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    text = base_config("gemma4_text", hidden=128, layers=6, heads=4, kv_heads=2, head_dim=32, inter=256)
    text.pop("eos_token_id")
    text.pop("architectures")
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 8,
        "pooling_kernel_size": 2,
        "position_embedding_size": 64,
        "default_output_length": 16,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "use_clipped_linears": True,
        "standardize": True,
        **(vision_overrides or {}),
    }
    write_tokenizer(d, text["vocab_size"], extra_specials=GEMMA4_SPECIALS, chat_template=GEMMA4_CHAT_TEMPLATE)
    tok = json.loads((d / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "audio_config": None,
        "vocab_size": text["vocab_size"],
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "video_token_id": ids["<|video|>"],
        "vision_soft_tokens_per_image": max_soft_tokens,
        "eos_token_id": 0,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }
    keys = iter(mx.random.split(mx.random.key(seed), 512))

    def rnd(shape: tuple[int, ...], scale: float) -> Any:
        return mx.random.normal(shape, key=next(keys)) * scale

    w = {k.replace("model.", "model.language_model.", 1): x for k, x in _gemma4_weights(text, rnd).items()}
    vh, vi, hd = vision["hidden_size"], vision["intermediate_size"], vision["head_dim"]
    nh, nkv, p = vision["num_attention_heads"], vision["num_key_value_heads"], vision["patch_size"]
    v = "model.vision_tower"
    w[f"{v}.patch_embedder.input_proj.weight"] = rnd((vh, 3 * p * p), (3 * p * p) ** -0.5)
    w[f"{v}.patch_embedder.position_embedding_table"] = rnd((2, vision["position_embedding_size"], vh), 0.5)

    def clipped(name: str, out: int, inp: int) -> None:
        w[f"{name}.linear.weight"] = rnd((out, inp), inp**-0.5)
        # bounds that clip some of the values (scalars, as Hugging Face stores them)
        w[f"{name}.input_min"] = mx.array(-2.5 + float(rnd((), 0.1)))
        w[f"{name}.input_max"] = mx.array(2.5 + float(rnd((), 0.1)))
        w[f"{name}.output_min"] = mx.array(-1.5 + float(rnd((), 0.1)))
        w[f"{name}.output_max"] = mx.array(1.5 + float(rnd((), 0.1)))

    for i in range(vision["num_hidden_layers"]):
        l = f"{v}.encoder.layers.{i}"
        clipped(f"{l}.self_attn.q_proj", nh * hd, vh)
        clipped(f"{l}.self_attn.k_proj", nkv * hd, vh)
        clipped(f"{l}.self_attn.v_proj", nkv * hd, vh)
        clipped(f"{l}.self_attn.o_proj", vh, nh * hd)
        w[f"{l}.self_attn.q_norm.weight"] = 1.0 + rnd((hd,), 0.1)
        w[f"{l}.self_attn.k_norm.weight"] = 1.0 + rnd((hd,), 0.1)
        clipped(f"{l}.mlp.gate_proj", vi, vh)
        clipped(f"{l}.mlp.up_proj", vi, vh)
        clipped(f"{l}.mlp.down_proj", vh, vi)
        for k in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            w[f"{l}.{k}.weight"] = 1.0 + rnd((vh,), 0.1)
    w[f"{v}.std_bias"] = rnd((vh,), 0.1)
    w[f"{v}.std_scale"] = 1.0 + rnd((vh,), 0.1)
    # scaled so that the image embeddings are of the text embeddings' order (sqrt(128) × 0.05)
    w["model.embed_vision.embedding_projection.weight"] = rnd((text["hidden_size"], vh), 0.5 * vh**-0.5)
    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    w = {k: x.astype(dt) for k, x in w.items()}
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "Gemma4Processor",
                "image_seq_length": max_soft_tokens,
                "image_processor": {
                    "image_processor_type": "Gemma4ImageProcessor",
                    "patch_size": p,
                    "max_soft_tokens": max_soft_tokens,
                    "pooling_kernel_size": vision["pooling_kernel_size"],
                    "do_resize": True,
                    "do_rescale": True,
                    "rescale_factor": 1 / 255,
                    "do_normalize": False,
                },
            },
            indent=2,
        )
    )
    (d / ".complete").write_text("ok")
    return d


@built_under(ROOT)
def make_gemma4_vision_q4(name: str = "gemma4-vision-q4") -> Path:
    """`make_gemma4_vision`'s model converted by mlx-vlm 0.7.10 to 4 bits (group 64): the language
    model quantized, the tower not (as mlx-vlm quantizes Gemma 4), saved in mlx-vlm's layout (no
    `model.` prefix, the vision weights as `vision_tower.*`)."""
    d = ROOT / name
    if (d / ".complete").exists():
        return d
    from mlx_vlm import convert

    src = make_gemma4_vision()
    shutil.rmtree(d, ignore_errors=True)
    convert(str(src), mlx_path=str(d), quantize=True, q_bits=4, q_group_size=64)
    (d / ".complete").write_text("ok")
    return d


GEMMA4_AUDIO_SPECIALS = {
    **GEMMA4_SPECIALS,
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}

# the image template with Gemma 4's audio marker standing for an audio part
GEMMA4_AUDIO_CHAT_TEMPLATE = GEMMA4_CHAT_TEMPLATE


@built_under(ROOT)
def make_gemma4_audio(
    name: str = "gemma4-audio-f32",
    *,
    dtype: str = "float32",
    seed: int = 1,
    audio_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write (once) `make_gemma4_vision`'s layout plus a tiny random audio tower (mlx-vlm 0.7.10's
    Gemma 4 conformer: subsampling convs of 8 then 4 channels, hidden 32, 2 blocks of 4 heads,
    chunks of 4 with 5 frames of left context and 2 of right, clipped linears whose bounds clip,
    an output projection to 48) under `model.audio_tower.*` (Hugging Face's conv layouts) and
    `model.embed_audio.*`; the tokenizer with the audio markers; processor_config.json with
    `audio_seq_length` 750 and `audio_ms_per_token` 40. mlx-vlm loads it. `audio_overrides`
    (another name then) changes the encoder's sizes."""
    import mlx.core as mx

    d = ROOT / name
    if (d / ".complete").exists():
        return d
    src = make_gemma4_vision()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg["text_config"]
    write_tokenizer(
        d, text["vocab_size"], extra_specials=GEMMA4_AUDIO_SPECIALS, chat_template=GEMMA4_AUDIO_CHAT_TEMPLATE
    )
    tok = json.loads((d / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    audio = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_act": "silu",
        "subsampling_conv_channels": [8, 4],
        "conv_kernel_size": 5,
        "residual_weight": 0.5,
        "attention_chunk_size": 4,
        "attention_context_left": 6,
        "attention_context_right": 2,
        "attention_logit_cap": 50.0,
        "attention_invalid_logits_value": -1e9,
        "use_clipped_linears": True,
        "rms_norm_eps": 1e-6,
        "gradient_clipping": 1e10,
        "output_proj_dims": 48,
        **(audio_overrides or {}),
    }
    cfg.update(
        {
            "audio_config": audio,
            "image_token_id": ids["<|image|>"],
            "boi_token_id": ids["<|image>"],
            "eoi_token_id": ids["<image|>"],
            "video_token_id": ids["<|video|>"],
            "audio_token_id": ids["<|audio|>"],
            "boa_token_id": ids["<|audio>"],
            "eoa_token_id": ids["<audio|>"],
        }
    )
    w = dict(mx.load(str(src / "model.safetensors")))
    keys = iter(mx.random.split(mx.random.key(seed), 512))

    def rnd(shape: tuple[int, ...], scale: float) -> Any:
        return mx.random.normal(shape, key=next(keys)) * scale

    h, c0, c1, k = audio["hidden_size"], *audio["subsampling_conv_channels"], audio["conv_kernel_size"]
    a = "model.audio_tower"
    s = f"{a}.subsample_conv_projection"
    # Hugging Face's conv layouts: [out, in, kH, kW] and [out, 1, kW]
    w[f"{s}.layer0.conv.weight"] = rnd((c0, 1, 3, 3), 1 / 3)
    w[f"{s}.layer0.norm.weight"] = 1.0 + rnd((c0,), 0.1)
    w[f"{s}.layer1.conv.weight"] = rnd((c1, c0, 3, 3), (9 * c0) ** -0.5)
    w[f"{s}.layer1.norm.weight"] = 1.0 + rnd((c1,), 0.1)
    w[f"{s}.input_proj_linear.weight"] = rnd((h, 32 * c1), (32 * c1) ** -0.5)

    def clipped(name: str, out: int, inp: int) -> None:
        w[f"{name}.linear.weight"] = rnd((out, inp), inp**-0.5)
        w[f"{name}.input_min"] = mx.array(-2.5 + float(rnd((), 0.1)))
        w[f"{name}.input_max"] = mx.array(2.5 + float(rnd((), 0.1)))
        w[f"{name}.output_min"] = mx.array(-1.5 + float(rnd((), 0.1)))
        w[f"{name}.output_max"] = mx.array(1.5 + float(rnd((), 0.1)))

    for i in range(audio["num_hidden_layers"]):
        b = f"{a}.layers.{i}"
        for ff in ("feed_forward1", "feed_forward2"):
            w[f"{b}.{ff}.pre_layer_norm.weight"] = 1.0 + rnd((h,), 0.1)
            clipped(f"{b}.{ff}.ffw_layer_1", 4 * h, h)
            clipped(f"{b}.{ff}.ffw_layer_2", h, 4 * h)
            w[f"{b}.{ff}.post_layer_norm.weight"] = 1.0 + rnd((h,), 0.1)
        for p in ("q_proj", "k_proj", "v_proj", "post"):
            clipped(f"{b}.self_attn.{p}", h, h)
        w[f"{b}.self_attn.relative_k_proj.weight"] = rnd((h, h), h**-0.5)
        w[f"{b}.self_attn.per_dim_scale"] = rnd((h // audio["num_attention_heads"],), 0.5)
        w[f"{b}.lconv1d.pre_layer_norm.weight"] = 1.0 + rnd((h,), 0.1)
        clipped(f"{b}.lconv1d.linear_start", 2 * h, h)
        w[f"{b}.lconv1d.depthwise_conv1d.weight"] = rnd((h, 1, k), k**-0.5)
        w[f"{b}.lconv1d.conv_norm.weight"] = 1.0 + rnd((h,), 0.1)
        clipped(f"{b}.lconv1d.linear_end", h, h)
        for n in ("norm_pre_attn", "norm_post_attn", "norm_out"):
            w[f"{b}.{n}.weight"] = 1.0 + rnd((h,), 0.1)
    w[f"{a}.output_proj.weight"] = rnd((audio["output_proj_dims"], h), h**-0.5)
    w[f"{a}.output_proj.bias"] = rnd((audio["output_proj_dims"],), 0.1)
    w["model.embed_audio.embedding_projection.weight"] = rnd(
        (text["hidden_size"], audio["output_proj_dims"]), 0.5 * audio["output_proj_dims"] ** -0.5
    )
    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    w = {k: x.astype(dt) for k, x in w.items()}
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    cfg["torch_dtype"] = dtype
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    proc = json.loads((src / "processor_config.json").read_text())
    proc.update({"audio_seq_length": 750, "audio_ms_per_token": 40})
    (d / "processor_config.json").write_text(json.dumps(proc, indent=2))
    (d / ".complete").write_text("ok")
    return d


# Qwen3.5's vision markers (its tokenizer's special tokens)
QWEN35_SPECIALS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}

# A Qwen-style chat template that renders image and video content parts as Qwen3.5's does
QWEN35_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@built_under(ROOT)
def make_qwen3_5_vision(
    name: str = "qwen3_5-vision-f32",
    *,
    dtype: str = "float32",
    seed: int = 0,
    vision_overrides: dict[str, Any] | None = None,
    max_image_tokens: int = 32,
) -> Path:
    """Write (once) a tiny random Qwen3.5 multimodal model in the Hugging Face layout (as
    transformers saves Qwen3_5ForConditionalGeneration): the text model (tests' qwen3_5 shape:
    Gated DeltaNet and gated attention, interleaved M-RoPE sections [2, 3, 3]) under
    `model.language_model.*`, a vision tower of 8×8 patches (2 frames deep, merged 2×2: 16×16 pixels
    per image token; an 8×8 learned position grid, interpolated) under `model.visual.*`, the Conv3d
    patch embedding in PyTorch's layout; preprocessor configs allowing 4 to 32 image tokens, and a
    tokenizer with its vision tokens. mlx-vlm 0.7.10 loads it. `vision_overrides` (another name
    then) changes the tower's sizes, `max_image_tokens` the largest image."""
    import mlx.core as mx

    d = ROOT / name
    if (d / ".complete").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    text = base_config("qwen3_5")
    text.pop("architectures")
    text.pop("eos_token_id")
    vision = {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "in_channels": 3,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text["hidden_size"],
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
        **(vision_overrides or {}),
    }
    write_tokenizer(d, text["vocab_size"], extra_specials=QWEN35_SPECIALS, chat_template=QWEN35_CHAT_TEMPLATE)
    tok = json.loads((d / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": text["vocab_size"],
        "eos_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    keys = iter(mx.random.split(mx.random.key(seed), 512))

    def rnd(shape: tuple[int, ...], scale: float) -> Any:
        return mx.random.normal(shape, key=next(keys)) * scale

    w = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): x
        for k, x in _qwen3_next_weights("qwen3_5", text, rnd).items()
    }
    vh, vi, p, m = (
        vision["hidden_size"],
        vision["intermediate_size"],
        vision["patch_size"],
        vision["spatial_merge_size"],
    )
    tp, v = vision["temporal_patch_size"], "model.visual"
    fan = 3 * tp * p * p
    w[f"{v}.patch_embed.proj.weight"] = rnd((vh, 3, tp, p, p), fan**-0.5)  # PyTorch's Conv3d layout
    w[f"{v}.patch_embed.proj.bias"] = rnd((vh,), 0.1)
    w[f"{v}.pos_embed.weight"] = rnd((vision["num_position_embeddings"], vh), 0.5)
    for i in range(vision["depth"]):
        b = f"{v}.blocks.{i}"
        for n in ("norm1", "norm2"):
            w[f"{b}.{n}.weight"] = 1.0 + rnd((vh,), 0.1)
            w[f"{b}.{n}.bias"] = rnd((vh,), 0.1)
        w[f"{b}.attn.qkv.weight"] = rnd((3 * vh, vh), vh**-0.5)
        w[f"{b}.attn.qkv.bias"] = rnd((3 * vh,), 0.1)
        w[f"{b}.attn.proj.weight"] = rnd((vh, vh), vh**-0.5)
        w[f"{b}.attn.proj.bias"] = rnd((vh,), 0.1)
        w[f"{b}.mlp.linear_fc1.weight"] = rnd((vi, vh), vh**-0.5)
        w[f"{b}.mlp.linear_fc1.bias"] = rnd((vi,), 0.1)
        w[f"{b}.mlp.linear_fc2.weight"] = rnd((vh, vi), vi**-0.5)
        w[f"{b}.mlp.linear_fc2.bias"] = rnd((vh,), 0.1)
    mh = vh * m * m
    w[f"{v}.merger.norm.weight"] = 1.0 + rnd((vh,), 0.1)
    w[f"{v}.merger.norm.bias"] = rnd((vh,), 0.1)
    w[f"{v}.merger.linear_fc1.weight"] = rnd((mh, mh), mh**-0.5)
    w[f"{v}.merger.linear_fc1.bias"] = rnd((mh,), 0.1)
    # scaled so that the image embeddings are of the text embeddings' order (0.5)
    w[f"{v}.merger.linear_fc2.weight"] = rnd((text["hidden_size"], mh), 0.5 * mh**-0.5)
    w[f"{v}.merger.linear_fc2.bias"] = rnd((text["hidden_size"],), 0.1)
    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    w = {k: x.astype(dt) for k, x in w.items()}
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    pre = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": p,
        "temporal_patch_size": tp,
        "merge_size": m,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "size": {"shortest_edge": 4 * (p * m) ** 2, "longest_edge": max_image_tokens * (p * m) ** 2},
    }
    (d / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    vid = {
        **pre,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "fps": 2.0,
        "min_frames": 2,
        "max_frames": 16,
        "size": {"shortest_edge": 4 * (p * m) ** 2 * 2, "longest_edge": 64 * (p * m) ** 2 * 2},
    }
    vid.pop("image_processor_type")
    (d / "video_preprocessor_config.json").write_text(json.dumps(vid, indent=2))
    (d / ".complete").write_text("ok")
    return d


@built_under(ROOT)
def make_qwen3_5_vision_q4(name: str = "qwen3_5-vision-q4") -> Path:
    """`make_qwen3_5_vision`'s model converted by mlx-vlm 0.7.10 to 4 bits (group 64): the language
    model quantized, saved in mlx-vlm's layout (the tower as `vision_tower.*`, its Conv3d patch
    embedding in MLX's channels-last layout)."""
    d = ROOT / name
    if (d / ".complete").exists():
        return d
    from mlx_vlm import convert

    src = make_qwen3_5_vision()
    shutil.rmtree(d, ignore_errors=True)
    convert(str(src), mlx_path=str(d), quantize=True, q_bits=4, q_group_size=64)
    (d / ".complete").write_text("ok")
    return d
