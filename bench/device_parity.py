"""Every architecture's parity with mlx-lm on a GPU (MLX's CUDA backend on the H200 test machine, or
Metal): the tiny random models of tests/tinymodels.py in float32, bfloat16 (which MLX's CPU cannot
run for MoE experts: the CPU test suite skips those) and 4-bit; for each, mlxrs's greedy tokens and
last-position logits against mlx-lm 0.32.2's (tests/oracle_mlxlm.py in a subprocess), a batch of
mixed-length prompts decoded together (the stacked KV, the GPU default) against each prompt alone,
and, for the MoE architectures, the experts streamed from the files.

    python bench/device_parity.py [--archs llama,qwen3_moe] [--variants float32,bfloat16-q4,bfloat16-mxfp4]
                                  [--out parity.json] [--no-compile] [--oracle-batch]

    python bench/device_parity.py --media [--media-cases gemma3-image,gemma4-audio] [--variants float32,bfloat16]

--media runs the vision and audio towers instead: the tiny Gemma 3 (image), Gemma 4 (image; audio
clip) and Qwen3.5 (image; a video as 5 frames) multimodal models of tests/tinymodels.py through mlxrs
and mlx-vlm 0.7.10 (tests/oracle_mlxvlm.py in a subprocess) on the same weights and media: the
prompt ids, 32 greedy tokens (the first divergence and, there, mlxrs's logit margin between its token
and mlx-vlm's), the last-position logits and the tower's projected embeddings (max difference,
absolute and relative to the largest). mlx-vlm must be importable (on the device: carried, see
bench/pack_mlx_vlm.sh and bench/device_run.sh); without it each row records the import error.
mlxrs's margin at the first divergence comes from its logits of the prompt plus the tokens before it
in one prefill (generate decodes them one at a time: in bfloat16 the two can round apart).

--no-compile runs both engines with MLX_DISABLE_COMPILE=1 (MLX's compiler off: every op its own
kernel), which tells a difference in where the two fuse ops from one in what they compute.
--oracle-batch also decodes the same batch with mlx-lm's BatchGenerator (bench/oracle_batch.py) and
records where its rows leave mlx-lm's own single-sequence runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France; Berlin of Germany."
N = 32
ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma4_text",
    "qwen3_next",
    "qwen3_5",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "gemma4_text_moe",
    "qwen3_5_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "mistral4",
]
MOE = {
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "gemma4_text_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "mistral4",
}
TOL = {"float32": 1e-3, "bfloat16": 5e-2}


def run_oracle(script: str, job: dict) -> dict:
    """One job through the tests' oracle script `script` (mlx-lm's or mlx-vlm's) in a process of its own."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout)


def oracle(d: Path, ids: list[int]) -> dict:
    from oracle_server import mlxlm_job

    return run_oracle("oracle_mlxlm.py", mlxlm_job(d, ids, N))


def oracle_batch(d: Path, prompts: list[list[int]]) -> list[int | None]:
    """Where each row of mlx-lm's BatchGenerator first leaves mlx-lm's own run of it alone."""
    job = {"model": str(d), "prompts": prompts, "max_tokens": N}
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "oracle_batch.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    out = json.loads(r.stdout)
    return [
        next((i for i, (x, y) in enumerate(zip(b, al)) if x != y), None) for b, al in zip(out["batch"], out["alone"])
    ]


def one(arch: str, dtype: str, quant: int | None, with_oracle_batch: bool = False, mode: str = "affine") -> dict:
    import numpy as np

    import mlxrs
    from tinymodels import make_model

    name = f"{arch}-{dtype}" + (f"-q{quant}" if quant else "") + ("" if mode == "affine" else f"-{mode}")
    row: dict = {"arch": arch, "dtype": dtype, "quant": quant, "mode": mode}
    try:
        d = make_model(name, arch, dtype=dtype, quant_bits=quant, quant_mode=mode)
        with mlxrs.Session(d) as s:
            ids = s.tokenize(TEXT)
            ours = s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0).tokens
            logits = np.array(s.logits(ids), dtype=np.float32)
            ps = [ids[:n] for n in (3, len(ids), 11, 27)]
            alone = [s.generate(p, max_tokens=N, ignore_eos=True, temperature=0.0).tokens for p in ps]
            batch = [r.tokens for r in s.generate_batch(ps, max_tokens=N, ignore_eos=True, temperature=0.0)]
            row["stacked_decode_steps"] = s.info["stacked_decode_steps"]
        ref = oracle(d, ids)
        row["tokens_equal"] = ours == ref["tokens"]
        row["first_diff"] = next((i for i, (a, b) in enumerate(zip(ours, ref["tokens"])) if a != b), None)
        row["logits_max_diff"] = float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32))))
        row["logits_ok"] = row["logits_max_diff"] <= TOL[dtype] * (4 if quant else 1)
        row["batch_equals_alone"] = batch == alone
        # where each batched row first leaves its alone run (None: never), of N tokens
        row["batch_first_diff"] = [
            next((i for i, (x, y) in enumerate(zip(b, al)) if x != y), None) for b, al in zip(batch, alone)
        ]
        if with_oracle_batch:
            row["oracle_batch_first_diff"] = oracle_batch(d, ps)
        if arch in MOE:
            with mlxrs.Session(d, stream_experts=True) as s:
                st = s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0).tokens
                x = s.info["experts"]
            row["streamed_equal"] = st == ours
            row["streamed_hit_rate"] = x["hit_rate"]
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


MEDIA_CASES = ["gemma3-image", "gemma4-image", "gemma4-audio", "qwen3_5-image", "qwen3_5-video"]
QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
MEDIA_PROMPTS = {
    "gemma3-image": "Describe <start_of_image> please.",
    "gemma4-image": "Describe <|image|> please.",
    "gemma4-audio": "Listen to <|audio|> and answer.",
    "qwen3_5-image": f"<|im_start|>user\nDescribe {QWEN_VISION} please.<|im_end|>\n<|im_start|>assistant\n",
    "qwen3_5-video": f"<|im_start|>user\nWhat happens in {QWEN_VIDEO}?<|im_end|>\n<|im_start|>assistant\n",
}


def _png(path: Path, rgb) -> Path:
    """`rgb` (uint8 `[H, W, 3]`) as a PNG, written with zlib alone (no imaging library needed here)."""
    import struct
    import zlib

    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )
    return path


def media_files(d: Path) -> dict[str, list[Path]]:
    """The test media (the CPU tests' shapes): an image (a gradient with noise, 90×70), a 1.3 s
    16 kHz stereo WAV (downmixed by both; at the extractor's rate, so mlx-vlm's loader needs no
    resampler — scipy — on the device), five video frames of 90×60."""
    import numpy as np

    from audio_util import tone, wav_bytes

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    yy, xx = np.mgrid[0:70, 0:90]
    img = np.stack([(xx * 2.8) % 256, (yy * 3.6) % 256, rng.integers(0, 256, (70, 90))], -1).astype(np.uint8)
    wav = d / "clip.wav"
    wav.write_bytes(wav_bytes(tone(1.3, 16000, 2, seed=5), 16000, 16))
    rng = np.random.default_rng(9)
    yy, xx = np.mgrid[0:60, 0:90]
    frames = []
    for i in range(5):
        f = np.stack([(xx * 2.8 + 20 * i) % 256, (yy * 3.6) % 256, rng.integers(0, 256, (60, 90))], -1)
        frames.append(_png(d / f"f{i}.png", f.astype(np.uint8)))
    return {"image": [_png(d / "a.png", img)], "audio": [wav], "video": frames}


def vlm_oracle(job: dict) -> dict:
    return run_oracle("oracle_mlxvlm.py", job)


def media_one(case: str, dtype: str, files: dict[str, list[Path]]) -> dict:
    """One tower case (`MEDIA_CASES`) in `dtype` against mlx-vlm."""
    import numpy as np

    import mlxrs
    from tinymodels import make_gemma3_vision, make_gemma4_audio, make_gemma4_vision, make_qwen3_5_vision

    make = {
        "gemma3-image": make_gemma3_vision,
        "gemma4-image": make_gemma4_vision,
        "gemma4-audio": make_gemma4_audio,
        "qwen3_5-image": make_qwen3_5_vision,
        "qwen3_5-video": make_qwen3_5_vision,
    }[case]
    row: dict = {"case": case, "dtype": dtype}
    try:
        arch = case.split("-")[0]
        d = make(
            f"{arch}-{'audio' if case == 'gemma4-audio' else 'vision'}-{'f32' if dtype == 'float32' else 'bf16'}",
            dtype=dtype,
        )
        prompt = MEDIA_PROMPTS[case]
        kind = case.split("-")[1]
        paths = files[kind]
        job: dict = {"model": str(d), "prompt": prompt, "images": [], "max_tokens": N}
        if kind == "image":
            job["images"] = [str(p) for p in paths]
        elif kind == "audio":
            job["audio"] = [str(p) for p in paths]
        else:
            job["video"] = [str(p) for p in paths]
        ref = vlm_oracle(job)
        with mlxrs.Session(d) as s:
            images = paths if kind == "image" else None
            video = paths if kind == "video" else None
            clips = s.audio_clips(paths) if kind == "audio" else None
            audio = paths if kind == "audio" else None
            ids = s._prepare(prompt, None, None, images, audio, video)[0]
            media = {
                "image": lambda extra: s._s.logits(extra, [p.read_bytes() for p in paths]),
                "audio": lambda extra: s._s.logits(extra, None, clips),
                "video": lambda extra: s._s.logits(extra, video=[p.read_bytes() for p in paths]),
            }[kind]
            if kind == "image":
                feats = s.image_features(paths)
            elif kind == "audio":
                feats = s.audio_features(paths)
            else:
                feats = s.video_features(paths)
            out = s.generate(
                prompt, images=images, audio=audio, video=video, max_tokens=N, ignore_eos=True, temperature=0.0
            )
            ours = out.tokens
            logits = np.array(media(ids), dtype=np.float32)
            row["ids_equal"] = ids == ref["input_ids"]
            row["tokens_equal"] = ours == ref["tokens"]
            first = next((i for i, (a, b) in enumerate(zip(ours, ref["tokens"])) if a != b), None)
            row["first_diff"] = first
            if first is not None:
                # how close mlxrs's own logits were between its token and mlx-vlm's there
                at = np.array(media(ids + ours[:first]), dtype=np.float32)
                row["margin_at_first_diff"] = float(at[ours[first]] - at[ref["tokens"][first]])
        theirs_l = np.array(ref["logits"], dtype=np.float32)
        row["logits_max_diff"] = float(np.max(np.abs(logits - theirs_l)))
        row["logits_ok"] = row["logits_max_diff"] <= TOL[dtype]
        ours_f = np.array(feats, dtype=np.float32)
        key = "audio_features" if kind == "audio" else "features"
        theirs_f = (
            np.concatenate([np.ravel(np.array(x, dtype=np.float32)) for x in ref[key]])
            if kind == "audio"
            else np.ravel(np.array(ref[key], dtype=np.float32))
        )
        if ours_f.size != theirs_f.size:
            row["embeddings_error"] = f"sizes differ: mlxrs {ours_f.size}, mlx-vlm {theirs_f.size}"
        else:
            diff = float(np.max(np.abs(ours_f - theirs_f)))
            row["embeddings_max_diff"] = diff
            row["embeddings_rel_diff"] = diff / max(float(np.max(np.abs(theirs_f))), 1e-30)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


def media_main(a: argparse.Namespace) -> int:
    import tempfile

    rows = []
    t0 = time.time()
    files = media_files(Path(tempfile.mkdtemp(prefix="mlxrs-media-")))
    for case in a.media_cases.split(","):
        for dtype in a.variants.split(","):
            if dtype not in TOL:
                continue  # the towers run unquantized (mlx-vlm keeps them so): float32 and bfloat16 only
            r = media_one(case, dtype, files)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    ok = [r for r in rows if "error" not in r and r["ids_equal"] and r["tokens_equal"] and r["logits_ok"]]
    print(f"{len(ok)}/{len(rows)} media rows agree with mlx-vlm ({time.time() - t0:.0f} s)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--variants", default="float32,bfloat16,float32-q4")
    ap.add_argument("--out")
    ap.add_argument("--no-compile", action="store_true", help="MLX_DISABLE_COMPILE=1 for both engines")
    ap.add_argument("--oracle-batch", action="store_true", help="mlx-lm's BatchGenerator vs its own alone runs")
    ap.add_argument("--media", action="store_true", help="the vision/audio towers against mlx-vlm 0.7.10")
    ap.add_argument("--media-cases", default=",".join(MEDIA_CASES))
    a = ap.parse_args()
    if a.media:
        if a.variants == ap.get_default("variants"):
            a.variants = "float32,bfloat16"
        return media_main(a)
    if a.no_compile:  # read by MLX at its first compile: before mlxrs is imported, inherited by the oracle
        os.environ["MLX_DISABLE_COMPILE"] = "1"
    rows = []
    t0 = time.time()
    for arch in a.archs.split(","):
        for v in a.variants.split(","):
            # float32, float32-q4 (affine 4-bit), bfloat16-mxfp4 / -mxfp8 / -nvfp4 (MLX's microscaling modes)
            dtype, _, q = v.partition("-")
            mode = q if q in ("mxfp4", "mxfp8", "nvfp4") else "affine"
            bits = (8 if q == "mxfp8" else 4) if mode != "affine" else (int(q[1:]) if q else None)
            r = one(arch, dtype, bits, a.oracle_batch, mode)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.out:  # after every row: a run cut short still leaves what it measured
                Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    ok = [
        r
        for r in rows
        if "error" not in r
        and r["tokens_equal"]
        and r["logits_ok"]
        and r["batch_equals_alone"]
        and r.get("streamed_equal", True)
    ]
    print(f"{len(ok)}/{len(rows)} rows agree with mlx-lm ({time.time() - t0:.0f} s)")
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {"rows": rows, "env": {k: os.environ.get(k) for k in ("MLXRS_BATCH_KV", "MLX_DISABLE_COMPILE")}},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
