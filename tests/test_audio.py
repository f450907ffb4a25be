"""Audio preprocessing in Rust against mlx-vlm 0.7.10's own path (mlx-audio's miniaudio decode
and kaiser_best resampler, Gemma 4's feature extractor) on the same WAV bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mlxrs import _native
from audio_util import tone, wav_bytes

audio_io = pytest.importorskip("mlx_audio.audio_io")
resample_mod = pytest.importorskip("mlx_audio.resample")
fe_mod = pytest.importorskip("mlx_vlm.models.gemma4.audio_feature_extractor")


def _reference_wave(data: bytes) -> tuple[np.ndarray, int]:
    """mlx_vlm.utils.load_audio before resampling: miniaudio to int16, /32768, channel mean."""
    a, rate = audio_io.read(io.BytesIO(data), dtype="float32")
    a = np.asarray(a, dtype=np.float32)
    return (a.mean(axis=1) if a.ndim > 1 else a), rate


@pytest.mark.parametrize(
    "bits,fmt,channels",
    [(16, "int", 1), (16, "int", 2), (24, "int", 1), (32, "int", 3), (8, "int", 2), (32, "float", 1), (32, "float", 2)],
)
def test_decode_matches_miniaudio(bits, fmt, channels):
    x = tone(0.3, 22050, channels, seed=bits + channels)
    if fmt == "float":
        x = x * 1.2  # past full scale: clamped as miniaudio does
    data = wav_bytes(x, 22050, bits, fmt)
    got, rate = _native._audio_decode(data)
    want, want_rate = _reference_wave(data)
    assert rate == want_rate == 22050
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float32), want)


@pytest.mark.parametrize(
    "src,dst", [(44100, 16000), (48000, 16000), (8000, 16000), (22050, 16000), (11025, 16000), (16000, 24000)]
)
def test_resample_matches_mlx_audio(src, dst):
    rng = np.random.default_rng(src)
    x = rng.uniform(-1, 1, 3001).astype(np.float32)
    x[:5] = 0.7  # the edge padding shows at the ends
    got = np.asarray(_native._audio_resample(x.tolist(), src, dst), dtype=np.float32)
    want = resample_mod.resample_audio_array(x, src, dst)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def _extractor_with_exact_window(**kw):
    """Gemma 4's extractor with its Hann window from a correctly rounded float32 cosine: numpy's
    SIMD float32 cos is an ulp off in 19 of the 320 values (the Rust side rounds the float64
    cosine), which moves a low-energy mel bin by ~1e-5 now and then."""
    fe = fe_mod.Gemma4AudioFeatureExtractor(**kw)
    a = 2.0 * np.pi * np.arange(fe.frame_length, dtype=np.float32) / fe.frame_length
    fe.window = np.float32(0.5) - np.float32(0.5) * np.cos(a.astype(np.float64)).astype(np.float32)
    return fe


def _exact_features(x: np.ndarray, monkeypatch, **kw) -> np.ndarray:
    """The extractor's features with the exact window and its rFFT in float64 (numpy 2 runs the
    rFFT of float32 frames in float32: noise of ~1e-7 of a frame's energy, which shows in the log of
    near-silent bands, e.g. above the Nyquist of an upsampled 8 kHz clip)."""
    rfft = np.fft.rfft
    with monkeypatch.context() as m:
        m.setattr(fe_mod.np.fft, "rfft", lambda a, *k, **kw2: rfft(np.asarray(a, dtype=np.float64), *k, **kw2))
        return _extractor_with_exact_window(**kw)([x])["input_features"][0]


@pytest.mark.parametrize("seconds", [0.05, 0.73, 1.0, 2.517, 31.0])
def test_log_mel_matches_gemma4_extractor(seconds, monkeypatch):
    x = tone(seconds, 16000, 1, seed=int(seconds * 100))[:, 0].astype(np.float32)
    feats, frames, mask = _native._audio_log_mel(x.tolist())
    feats = np.asarray(feats, dtype=np.float32).reshape(frames, 128)
    ref = fe_mod.Gemma4AudioFeatureExtractor()([x])
    want, want_mask = ref["input_features"][0], ref["input_features_mask"][0]
    assert frames == want.shape[0]
    assert list(mask) == [bool(m) for m in want_mask]
    # within 1e-5 of the stock extractor but for its window's ulps (2e-5 over a 30 s clip), within
    # 1e-5 everywhere of the extractor with the exactly rounded window
    np.testing.assert_allclose(feats, want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(feats, _exact_features(x, monkeypatch), atol=1e-5, rtol=0)


def test_log_mel_settings_from_the_config(monkeypatch):
    x = tone(0.5, 16000, 1, seed=3)[:, 0].astype(np.float32)
    fe = {
        "preemphasis": 0.97,
        "mel_floor": 1e-5,
        "per_bin_mean": list(np.linspace(-1, 1, 128)),
        "per_bin_stddev": list(np.linspace(0.5, 2, 128)),
    }
    import json

    feats, frames, _ = _native._audio_log_mel(x.tolist(), json.dumps(fe))
    want = _exact_features(x, monkeypatch, **fe)
    np.testing.assert_allclose(np.asarray(feats, dtype=np.float32).reshape(frames, 128), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rate,channels,bits", [(44100, 2, 16), (48000, 1, 24), (8000, 1, 16), (16000, 2, 32)])
def test_wav_to_features_matches_mlx_vlm(tmp_path, monkeypatch, rate, channels, bits):
    """The whole path: mlx_vlm.utils.load_audio (decode, downmix, resample) then the extractor."""
    utils = pytest.importorskip("mlx_vlm.utils")
    data = wav_bytes(tone(1.3, rate, channels, seed=rate), rate, bits)
    path = tmp_path / "a.wav"
    path.write_bytes(data)
    want_wave = utils.load_audio(str(path), sr=16000)
    samples, r = _native._audio_decode(data)
    got_wave = np.asarray(_native._audio_resample(samples, r, 16000), dtype=np.float32)
    np.testing.assert_allclose(got_wave, want_wave, atol=2e-6, rtol=0)
    feats, frames, _ = _native._audio_log_mel(got_wave.tolist())
    ours = np.asarray(feats, dtype=np.float32).reshape(frames, 128)
    np.testing.assert_allclose(ours, _exact_features(want_wave, monkeypatch), atol=1e-5, rtol=0)
    # the stock extractor: its float32 rFFT's noise in the silent band of the upsampled 8 kHz clip
    want = fe_mod.Gemma4AudioFeatureExtractor()([want_wave])["input_features"][0]
    np.testing.assert_allclose(ours, want, atol=5e-4 if rate < 16000 else 2e-5, rtol=0)


@pytest.mark.parametrize(
    "data,words",
    [
        (wav_bytes(tone(0.2, 16000), 16000, claim_frames=16000), ["shorter than its header"]),
        (b"RIFF\x10\x00\x00\x00WAVEfmt ", ["not a valid WAV"]),
        (b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\x00" * 64, ["MP3", "WAV"]),
        (b"OggS\x00\x02" + b"\x00" * 64, ["Ogg"]),
        (b"fLaC\x00\x00\x00\x22" + b"\x00" * 64, ["FLAC"]),
        (wav_bytes(tone(31, 8000), 8000), ["longer than the limit"]),
        (b"hello, world" * 10, ["unrecognized"]),
    ],
)
def test_bad_audio_is_refused_clearly(data, words):
    with pytest.raises(ValueError) as e:
        _native._audio_decode(data)
    for w in words:
        assert w in str(e.value)
