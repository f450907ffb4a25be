"""mlxrs's exceptions. The server maps each class to an HTTP status in one place."""

from __future__ import annotations


class MlxrsError(Exception):
    """Base class of every mlxrs error."""


class MlxError(MlxrsError):
    """MLX raised an error; the message is MLX's own."""


class NativeRuntimeError(MlxrsError):
    """The native runtime (libmlxc/libmlx) could not be found, loaded, or does not match this mlxrs."""


class InvalidArgumentError(MlxrsError, ValueError):
    """An argument was rejected before reaching MLX."""


class ModelLoadError(MlxrsError):
    """A model directory or file is missing, unreadable or malformed."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture (model_type) is not one mlxrs implements."""


class BusyError(MlxrsError):
    """The engine's queue is full (max_concurrency running, max_queue waiting): retry later."""


class EngineError(MlxrsError):
    """The session's engine thread died (an internal error): what was running and every later
    request fail with this; `Session.info["engine"]` says "dead" with the message. Close the
    session and load the model again."""


class ContextLengthError(MlxrsError):
    """A request does not fit the memory admission ceiling."""


class DownloadError(MlxrsError):
    """A download failed or did not verify."""


__all__ = [
    "MlxrsError",
    "MlxError",
    "NativeRuntimeError",
    "InvalidArgumentError",
    "ModelLoadError",
    "UnsupportedModelError",
    "BusyError",
    "EngineError",
    "ContextLengthError",
    "DownloadError",
]
