"""The multimodal parity oracle: mlx-vlm 0.7.10 run in its own process (given the same BLAS as
mlxrs through LD_PRELOAD, like oracle_mlxlm.py). The tests reach it through tests/oracle_server.py
(one long-lived process, each model loaded once); run as a script it answers one job: reads a JSON
job on stdin, writes JSON on stdout.

Gemma 4 (variable image sizes, per-layer inputs, audio) takes its own path: see `gemma4`; its job may
name "audio": [WAV paths] (out: "mel" and "mel_mask" per clip, "audio_features": each clip's
encoder frames through the projector, `[frames, hidden]`). Qwen3.5 (patches, M-RoPE positions,
video frames) too: see `qwen3_5`.

Job: {"model": dir, "prompt": text with one image marker per image, "images": [paths],
      "max_tokens": n, "prefill_step_size": n}
Out: {"input_ids": [ids] (the processor's), "pixel_values": [[floats]] per image (flattened [3, H, W]),
      "features": [floats] (the projector's output for all images, flattened), "tokens": [ids] (greedy),
      "logits": [last-position logits, float32] (the merged embeddings through the language model, as
      generate's prefill runs them: all but the last position, then the last)}
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
import numpy as np


def gemma4(job: dict, model, processor) -> dict:
    """Gemma 4: the processor's pixel values (one `[3, H, W]` per image, each at its own size),
    `encode_image`'s features, the last-position logits of `get_input_embeddings`' merged
    embeddings and per-layer inputs through the language model on generate's prefill schedule,
    and `generate_step`'s greedy tokens."""
    from mlx_vlm.utils import load_image

    images = [load_image(p) for p in job["images"]]
    audio = _gemma4_audio(job)
    inputs = processor(text=[job["prompt"]], images=images or None, audio=audio or None, return_tensors="np")
    input_ids = mx.array(np.asarray(inputs["input_ids"]))
    out: dict = {"input_ids": input_ids[0].tolist()}
    pixel_values = inputs.get("pixel_values")
    if pixel_values is not None:
        items = list(pixel_values) if isinstance(pixel_values, list) else list(np.asarray(pixel_values))
        out["pixel_values"] = [np.asarray(p, dtype=np.float32).ravel().tolist() for p in items]
        out["pixel_shapes"] = [list(np.asarray(p).shape) for p in items]
        out["features"] = np.asarray(model.encode_image(pixel_values).astype(mx.float32)).ravel().tolist()
    extra: dict = {}
    if audio:
        feats = mx.array(np.stack([np.asarray(f, dtype=np.float32) for f in inputs["input_features"]]))
        fmask = mx.array(np.stack([np.asarray(m, dtype=bool) for m in inputs["input_features_mask"]]))
        extra = {"input_features": feats, "input_features_mask": fmask}
        out["mel"] = [np.asarray(f, dtype=np.float32).ravel().tolist() for f in np.asarray(feats)]
        out["mel_mask"] = [np.asarray(m).tolist() for m in np.asarray(fmask)]
        # each clip's encoder frames through the projector (all of them, the padded ones zero)
        out["audio_features"] = []
        for i in range(feats.shape[0]):
            enc, _ = model.audio_tower(feats[i : i + 1], ~fmask[i : i + 1])
            out["audio_features"].append(np.asarray(model.embed_audio(enc)[0].astype(mx.float32)).tolist())
    emb = model.get_input_embeddings(input_ids, pixel_values, **extra)
    h, pli = emb.inputs_embeds, emb.per_layer_inputs
    lm = model.language_model
    cache = lm.make_cache()
    n, i, step = input_ids.shape[1], 0, job.get("prefill_step_size", 2048)

    def run(a: int, b: int):
        return lm(
            input_ids[:, a:b],
            inputs_embeds=h[:, a:b],
            cache=cache,
            per_layer_inputs=None if pli is None else pli[:, a:b],
        ).logits

    while n - i > 1:
        k = min(step, n - 1 - i)
        run(i, i + k)
        mx.eval([c.state for c in cache])
        i += k
    out["logits"] = np.asarray(run(i, n)[0, -1].astype(mx.float32)).tolist()
    from mlx_vlm.generate.ar import generate_step

    out["tokens"] = [
        int(t)
        for t, _ in generate_step(
            input_ids,
            model,
            pixel_values,
            None,
            max_tokens=job["max_tokens"],
            temperature=0.0,
            prefill_step_size=step,
            **extra,
        )
    ]
    return out


def _gemma4_audio(job: dict) -> list:
    """The job's audio clips as mlx-vlm's generate loads them (`load_audio`: decoded, averaged to
    mono, resampled to the feature extractor's 16 kHz)."""
    if not job.get("audio"):
        return []
    from mlx_vlm.utils import load_audio

    return [load_audio(p, sr=16000) for p in job["audio"]]


def qwen3_5(job: dict, model, processor) -> dict:
    """Qwen3.5: the processor's patches (`[patches, C·T·p·p]`, in the tower's block order) and
    `image_grid_thw`, the tower's merged features, the last-position logits of
    `get_input_embeddings`' merged embeddings through the language model with its M-RoPE positions
    on generate's prefill schedule, and `generate_step`'s greedy tokens. `video` (a list of frame
    paths) goes to the processor as one video, `videos` (lists of frame paths) as several;
    `video_files` (video file paths) go through mlx-vlm's `prepare_inputs` as its generate sends
    them: `load_video` (OpenCV) samples each at the video processor's fps and frame bounds and the
    processor times their frames by the source's (out: "frame_counts", the frames sampled)."""
    from mlx_vlm.utils import load_image, prepare_inputs

    images = [load_image(p) for p in job["images"]]
    videos = [[load_image(p) for p in v] for v in job.get("videos") or ([job["video"]] if job.get("video") else [])]
    decoded: dict = {}
    if job.get("video_files"):
        from mlx_vlm.utils import load_video, resolve_video_sampling

        inputs = prepare_inputs(processor, videos=list(job["video_files"]), prompts=[job["prompt"]])
        for p in job["video_files"]:  # what load_video read of each file (frames [T, C, H, W] uint8)
            arr, meta = load_video(p, resolve_video_sampling(processor, {}))
            decoded.setdefault("video_frames", []).append(np.asarray(arr).tolist())
            decoded.setdefault("frame_times", []).append(meta.timestamps)
    else:
        inputs = processor(text=[job["prompt"]], images=images or None, videos=videos or None, return_tensors="np")
    input_ids = mx.array(np.asarray(inputs["input_ids"]))
    out: dict = {"input_ids": input_ids[0].tolist(), **decoded}
    extra: dict = {}
    pixel_values = None
    for pv, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if inputs.get(pv) is not None:
            pixel_values = mx.array(np.asarray(inputs[pv]))
            extra[grid] = mx.array(np.asarray(inputs[grid]))
            out["patches"] = np.asarray(inputs[pv], dtype=np.float32).tolist()
            out["grid_thw"] = np.asarray(inputs[grid]).tolist()
            dtype = model.vision_tower.patch_embed.proj.weight.dtype
            feats, _ = model.vision_tower(pixel_values.astype(dtype), extra[grid])
            out["features"] = np.asarray(feats.astype(mx.float32)).ravel().tolist()
    if pixel_values is not None and "pixel_values_videos" in inputs:
        extra["pixel_values_videos"] = pixel_values
    emb = model.get_input_embeddings(input_ids, None if "pixel_values_videos" in inputs else pixel_values, **extra)
    h = emb.inputs_embeds
    lm = model.language_model
    lm._position_ids = None
    lm._rope_deltas = None
    cache = lm.make_cache()
    n, i, step = input_ids.shape[1], 0, job.get("prefill_step_size", 2048)
    kw = {"position_ids": emb.position_ids, "rope_deltas": emb.rope_deltas}
    while n - i > 1:
        k = min(step, n - 1 - i)
        lm(input_ids[:, i : i + k], inputs_embeds=h[:, i : i + k], cache=cache, **kw)
        mx.eval([c.state for c in cache])
        i += k
    last = lm(input_ids[:, i:n], inputs_embeds=h[:, i:n], cache=cache, **kw).logits
    out["logits"] = np.asarray(last[0, -1].astype(mx.float32)).tolist()
    from mlx_vlm.generate.ar import generate_step

    lm._position_ids = None
    lm._rope_deltas = None
    pv_arg = None if "pixel_values_videos" in inputs else pixel_values
    out["tokens"] = [
        int(t)
        for t, _ in generate_step(
            input_ids,
            model,
            pv_arg,
            None,
            max_tokens=job["max_tokens"],
            temperature=0.0,
            prefill_step_size=step,
            **extra,
        )
    ]
    return out


def load(job: dict[str, Any]) -> tuple[Any, Any]:
    """(model, processor): mlx-vlm's `load`."""
    from mlx_vlm.utils import load as mlx_vlm_load

    return mlx_vlm_load(job["model"])


def run(loaded: tuple[Any, Any], job: dict[str, Any]) -> dict[str, Any]:
    """One job on a loaded model and processor; every job makes its own caches."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_image

    model, processor = loaded
    if model.config.model_type == "gemma4":
        return gemma4(job, model, processor)
    if model.config.model_type in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5(job, model, processor)
    images = [load_image(p) for p in job["images"]]
    inputs = processor(text=[job["prompt"]], images=images or None, return_tensors="np")
    input_ids = mx.array(np.asarray(inputs["input_ids"]))
    out: dict = {"input_ids": input_ids[0].tolist()}
    pixel_values = inputs.get("pixel_values")
    if pixel_values is not None:
        pixel_values = mx.array(np.asarray(pixel_values))
        out["pixel_values"] = [np.asarray(p, dtype=np.float32).ravel().tolist() for p in np.asarray(pixel_values)]
        dtype = model.language_model.model.embed_tokens.weight.dtype
        h, _, _ = model.vision_tower(pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        feats = model.multi_modal_projector(h).astype(mx.float32)
        out["features"] = np.asarray(feats).ravel().tolist()
    mask = mx.array(np.asarray(inputs["attention_mask"])) if "attention_mask" in inputs else None
    if pixel_values is not None:
        emb = model.get_input_embeddings(input_ids, pixel_values, mask=mask).inputs_embeds
        cache = model.language_model.make_cache()
        n = input_ids.shape[1]
        model.language_model(input_ids[:, : n - 1], inputs_embeds=emb[:, : n - 1], cache=cache)
        last = model.language_model(input_ids[:, n - 1 :], inputs_embeds=emb[:, n - 1 :], cache=cache).logits
        out["logits"] = np.asarray(last[0, -1].astype(mx.float32)).tolist()
    tokens = []
    for tok, _ in generate_step(
        input_ids,
        model,
        pixel_values,
        mask,
        max_tokens=job["max_tokens"],
        temperature=0.0,
        prefill_step_size=job.get("prefill_step_size", 2048),
    ):
        tokens.append(int(tok))
    out["tokens"] = tokens
    return out


def main() -> None:
    job = json.load(sys.stdin)
    json.dump(run(load(job), job), sys.stdout)


if __name__ == "__main__":
    main()
