"""The engine loop, shared by the engine thread and the engine process.

``run_engine_loop`` owns an ``LLMEngine``: it takes the commands that arrived (blocking only when
the engine is idle), applies them, runs one ``step()`` and hands everything the step produced to
``emit`` as one list. Where the commands come from and where the list goes is the transport's
business (a ``queue.SimpleQueue`` and ``call_soon_threadsafe`` for the thread, a pipe for the
process: see ``core_client``), so both modes serve by exactly the same rules:

- a refused ``AddRequest`` (bad input, can never fit) is answered with an ``Ack`` carrying the
  error, and nothing else changes;
- a forward pass that fails fails the requests of its batch (``LLMEngine.step``); any other
  exception out of ``step()`` fails every unfinished request, and the loop goes on serving;
- ``Stop`` aborts whatever is left, lets the engine release it, emits their final outputs and
  returns.

Every emitted list ends with a ``StatsUpdate``, so the frontend's view of the queue (for 429s and
``/metrics``) is never more than one step old.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infer.core.multimodal import ImageInput
from infer.core.outputs import RequestOutput
from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.distributed import EngineDeadError

logger = logging.getLogger("infer.engine")

# Test hook: seconds to sleep in every step, so a test can make work provably outlast a timeout.
STEP_DELAY_ENV = "INFER_TEST_STEP_DELAY"


# ---- commands (frontend -> engine) ---------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # (pooling: an embedding request)
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    lora_name: str | None = None  # a loaded LoRA adapter (None: the base model)
    export_kv: bool = False  # prefill/decode disaggregation (LLMEngine.add_request)
    kv_payload: Any = None  # a KVPayload for the decode side
    images: tuple[ImageInput, ...] = ()  # a vision-language model's (LLMEngine.add_request)


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CallEngine:
    """Call ``engine.<method>(*args)`` between steps; answered by a ``CallResult``."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Stop:
    pass


# ---- replies (engine -> frontend) ----------------------------------------------------------


@dataclass(frozen=True)
class Ack:
    """The engine took (``error is None``) or refused a request."""

    request_id: str
    error: BaseException | None


@dataclass(frozen=True)
class CallResult:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class StatsUpdate:
    stats: Any  # EngineStats
    num_steps: int
    num_step_failures: int


@dataclass(frozen=True)
class FinishedElsewhere:
    """With several API server processes: a request another one served has finished (its final
    output, without payloads), for this one's metrics and live view (``engine.frontends``)."""

    output: RequestOutput


@dataclass(frozen=True)
class EngineStopped:
    """The loop has returned (after ``Stop``) or died (``error`` says why)."""

    error: str | None = None


class RequestFailedError(Exception):
    """The engine failed while serving a request (HTTP 500 / an error event in a stream)."""


def error_output(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        error=error,
    )


class _Loop:
    def __init__(self, engine: Any, emit: Callable[[list], None]) -> None:
        self.engine = engine
        self.emit = emit
        self.num_steps = 0
        self.num_step_failures = 0
        self.step_delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)

    def stats(self) -> StatsUpdate:
        return StatsUpdate(self.engine.get_stats(), self.num_steps, self.num_step_failures)

    def run(self, next_commands: Callable[[bool], list]) -> None:
        engine = self.engine
        while True:
            commands = next_commands(not engine.has_unfinished_requests())
            stop = any(isinstance(c, Stop) for c in commands)
            replies, aborted = self.apply(commands)
            if stop:
                for rid in engine.unfinished_request_ids():
                    engine.abort_request(rid)
                while engine.has_unfinished_requests():
                    replies.extend(engine.step())  # the aborted requests' final outputs
                self.emit([*replies, self.stats(), EngineStopped()])
                return
            if engine.has_unfinished_requests() or aborted:
                replies.extend(self.step())
            replies.append(self.stats())
            self.emit(replies)

    def apply(self, commands: list) -> tuple[list, bool]:
        engine = self.engine
        replies: list = []
        aborted = False
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                error: BaseException | None = None
                try:
                    engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        priority=cmd.priority,
                        cache_salt=cmd.cache_salt,
                        arrival_time=cmd.arrival_time,
                        lora_request=cmd.lora_name,
                        export_kv=cmd.export_kv,
                        kv_payload=cmd.kv_payload,
                        images=cmd.images,
                    )
                except InvalidRequestError as e:
                    error = e
                except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
                    logger.exception("add_request failed for %s", cmd.request_id)
                    error = RequestFailedError(f"{type(e).__name__}: {e}")
                replies.append(Ack(cmd.request_id, error))
            elif isinstance(cmd, AbortRequests):
                for rid in cmd.request_ids:
                    engine.abort_request(rid)
                aborted = True
            elif isinstance(cmd, CallEngine):
                try:
                    replies.append(CallResult(cmd.call_id, getattr(engine, cmd.method)(*cmd.args)))
                except Exception as e:  # noqa: BLE001 - the caller gets the error
                    replies.append(CallResult(cmd.call_id, error=e))
        return replies, aborted

    def step(self) -> list:
        engine = self.engine
        if self.step_delay:
            time.sleep(self.step_delay)
        try:
            outputs = engine.step()
            self.num_steps += 1
            return outputs
        except EngineDeadError:
            raise  # the loop ends; the transport reports why (EngineStopped)
        except Exception as e:  # noqa: BLE001
            # Not a forward-pass failure (those fail their batch inside step()): we cannot tell
            # which request broke it, so fail every unfinished one and keep serving.
            self.num_step_failures += 1
            logger.exception("engine step failed; failing the requests in flight")
            why = f"engine step failed: {type(e).__name__}: {e}"
            failed = []
            for rid in engine.unfinished_request_ids():
                engine.abort_request(rid)
                failed.append(error_output(rid, why))
            return failed


def run_engine_loop(
    engine: Any, next_commands: Callable[[bool], list], emit: Callable[[list], None]
) -> None:
    """Serve ``engine`` until a ``Stop`` command: see the module docstring.

    Args:
        next_commands: ``next_commands(block)`` returns the commands that have arrived, waiting
            for at least one when ``block`` (the engine is idle).
        emit: takes each iteration's replies (acks, ``RequestOutput`` deltas, call results,
            a ``StatsUpdate``) as one list.
    """
    loop = _Loop(engine, emit)
    emit([loop.stats()])
    loop.run(next_commands)
