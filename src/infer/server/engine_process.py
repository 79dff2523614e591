"""The engine in a separate process (``infer serve --engine-process``), for comparison.

``EngineProcess`` stands in for ``LLMEngine`` on the server side: every call the ``AsyncEngine``
thread makes (``add_request``, ``abort_request``, ``step``, ...) becomes a request/response over a
pipe to a child process that owns the real engine. The model, scheduler, sampler and
detokenizer then run under the child's GIL, and the server's process keeps its GIL for HTTP,
tokenization and SSE; the price is one pickled round trip per call (``step`` returns the
step's ``RequestOutput`` deltas).

::

    server process                                   engine process
    event loop ── AsyncEngine thread ── EngineProcess ══ pipe ══ LLMEngine
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
from typing import Any

from infer.config import EngineConfig
from infer.core.sampling_params import InvalidRequestError

logger = logging.getLogger("infer.server")

# What the server reads off the engine once, at start-up.
_ATTRS = ("model_name", "max_model_len", "model_path", "capacity", "eos_token_ids")


def _child(conn, config: EngineConfig, log_level: int, torch_threads: int | None) -> None:
    """The engine process: build the engine, then answer calls until told to stop."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    from infer.engine.engine import LLMEngine, QueueFullError

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - report why, then exit
        conn.send(("error", type(e).__name__, str(e), None))
        return
    conn.send(("ok", {name: getattr(engine, name) for name in _ATTRS}))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            if method == "step_bundle":  # one round trip per step: deltas, and the state after
                outputs = engine.step()
                result = (outputs, engine.has_unfinished_requests(), engine.get_stats())
            else:
                result = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", result))
        except InvalidRequestError as e:
            conn.send(("error", "InvalidRequestError", e.message, e.param))
        except QueueFullError as e:
            conn.send(("error", "QueueFullError", str(e), None))
        except Exception as e:  # noqa: BLE001 - the caller decides what a failure means
            conn.send(("error", type(e).__name__, str(e), None))


class EngineProcess:
    """An ``LLMEngine`` look-alike whose methods run in a child process."""

    def __init__(self, config: EngineConfig, torch_threads: int | None = None) -> None:
        from infer.engine.model_source import resolve_model_path
        from infer.model.tokenizer import load_tokenizer

        self.config = config
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or locks
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, name="infer-engine",
                                 args=(child_conn, config, logging.getLogger().level, torch_threads),
                                 daemon=True)  # fmt: skip
        self._proc.start()
        child_conn.close()
        self._lock = threading.Lock()
        info = self._reply()
        for name, value in info.items():
            setattr(self, name, value)
        self._unfinished = False
        self._stats = self._call("get_stats")
        # The server tokenizes and renders chat templates itself; same files as the child's.
        self.tokenizer = load_tokenizer(
            config.model.tokenizer or resolve_model_path(config.model.model)
        )
        logger.info("engine runs in process %d", self._proc.pid)

    def _reply(self) -> Any:
        try:
            status, *rest = self._conn.recv()
        except EOFError as e:
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode})") from e
        if status == "ok":
            return rest[0]
        kind, message, param = rest
        if kind == "InvalidRequestError":
            raise InvalidRequestError(message, param)
        if kind == "QueueFullError":
            from infer.engine.engine import QueueFullError

            raise QueueFullError(message)
        raise RuntimeError(f"{kind}: {message}")

    def _call(self, method: str, *args, **kwargs) -> Any:
        with self._lock:
            self._conn.send((method, args, kwargs))
            return self._reply()

    # ---- the LLMEngine surface the server uses --------------------------------------------
    # ``has_unfinished_requests`` and ``get_stats`` answer from what the last call brought
    # back, so a loop iteration costs one round trip (the step), not three.
    def add_request(self, *args, **kwargs) -> None:
        self._call("add_request", *args, **kwargs)
        self._unfinished = True

    def abort_request(self, request_id: str) -> None:
        self._call("abort_request", request_id)
        self._unfinished = True  # the abort's final output is pending until the next step

    def step(self) -> list:
        outputs, self._unfinished, self._stats = self._call("step_bundle")
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self._unfinished

    def get_stats(self):
        return self._stats

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(RuntimeError, OSError):
                self._call("close")
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
