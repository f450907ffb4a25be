"""One thread that carries every stream's engine events to asyncio.

The engine sends the events of streams started with a hub (`_native.EventHub`) to one channel;
this thread waits on it without the GIL and posts each batch to the event loop that owns the
stream with a single `call_soon_threadsafe`. The server and `Session.astream` use it: no thread
per stream, and a stream's consumer never blocks the loop.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any

from . import _native


class Dispatcher:
    """Routes (stream id, event) pairs from a hub to per-stream asyncio queues."""

    def __init__(self) -> None:
        self.hub = _native.EventHub()
        self._lock = threading.Lock()
        # a stream's target; None: its consumer left before the end (late events are dropped)
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]] | None] = {}
        self._early: dict[int, list[Any]] = {}  # events that arrived before their stream registered
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mlxrs-dispatch", daemon=True)
        self._thread.start()

    def register(self, stream_id: int) -> asyncio.Queue[Any]:
        """The queue that receives `stream_id`'s events (call on the consuming loop)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._queues[stream_id] = (loop, q)
            for ev in self._early.pop(stream_id, []):
                q.put_nowait(ev)
        return q

    def unregister(self, stream_id: int, finished: bool) -> None:
        """The consumer is done with `stream_id`; `finished`: it saw the stream's last event."""
        with self._lock:
            self._early.pop(stream_id, None)
            if finished:
                self._queues.pop(stream_id, None)
            else:
                self._queues[stream_id] = None

    def close(self) -> None:
        """Stop the thread and wait for it (it wakes at least every 0.25 s). Called at interpreter
        exit: a daemon thread still inside native code when the interpreter tears down would be
        killed mid-call and abort the process."""
        self._stop = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop:
            batch = self.hub.wait(0.25)
            if not batch:
                continue
            per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
            with self._lock:
                for sid, ev in batch:
                    if sid not in self._queues:
                        self._early.setdefault(sid, []).append(ev)
                        continue
                    target = self._queues[sid]
                    if target is None:
                        if is_last(ev):
                            del self._queues[sid]
                        continue
                    per_loop.setdefault(target[0], []).append((target[1], ev))
            for loop, items in per_loop.items():
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # that loop is closed
                    pass


def is_last(ev: Any) -> bool:
    """A stream's final event: its Done, or an engine error."""
    return isinstance(ev, BaseException) or ev.get("type") == "done"


def _deliver(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


_DEFAULT: Dispatcher | None = None
_DEFAULT_LOCK = threading.Lock()


def default() -> Dispatcher:
    """The process's dispatcher, started on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Dispatcher()
            atexit.register(_DEFAULT.close)
        return _DEFAULT
