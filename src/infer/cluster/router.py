"""The ingress deployment: one OpenAI endpoint in front of the replicas.

For ``/v1/completions``, ``/v1/chat/completions`` and the embedding routes (``/v1/embeddings``,
``/score``, ``/rerank``) the router tokenizes the prompt (an embedding request's first input,
a score's ``text_1``, a rerank's ``query``) the way the server does (same tokenizer, same chat
template rendering), hashes its full blocks the way the prefix cache does, asks the routing
policy for a replica and streams that replica's answer back unchanged (status, headers, SSE
chunk by chunk). A client that disconnects cancels the replica call, which delivers
``http.disconnect`` to the replica's app and aborts the engine request. ``/metrics`` sums the
replicas' metrics and adds the router's own; ``/health``, ``/reset_prefix_cache`` and the LoRA
load / unload routes go to every replica; anything else to one of them in turn.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray import serve
from ray.exceptions import ObjectLostError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from infer.cluster.asgi import ForwardedRequest, ResponseStart
from infer.cluster.disagg import KVReceived, NoRoom, PrefillResult, split_request
from infer.cluster.metrics import merge_metrics
from infer.cluster.policy import LeastLoaded, RoutingPolicy, make_policy, prompt_block_hashes
from infer.kv_cache.block_pool import BlockHash
from infer.server.errors import APIError
from infer.server.serving import SSE_DONE, sse

logger = logging.getLogger("infer.cluster")

# Embedding routes: all prefill, never split; the field holding the text routed by.
POOLING_PATHS = {"/v1/embeddings": "input", "/classify": "input", "/v1/classify": "input",
                 "/score": "text_1", "/v1/score": "text_1",
                 "/rerank": "query", "/v1/rerank": "query", "/v2/rerank": "query"}  # fmt: skip
# The chat route's fronts (OpenAI's Responses API, Anthropic's Messages API): routed by their
# prompt as chat is, never split (their bodies are not the chat route's).
FRONT_PATHS = ("/v1/responses", "/v1/messages")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", *POOLING_PATHS, *FRONT_PATHS)
BROADCAST_PATHS = ("/health", "/reset_prefix_cache", "/v1/load_lora_adapter",
                   "/v1/unload_lora_adapter")  # fmt: skip
# Tokenize off the event loop above this many characters (as the server does).
_INLINE_TOKENIZE_CHARS = 16_384
# Routing-time samples kept for /router/stats percentiles.
_RECENT = 4096
# Disaggregated: how long a request whose KV no decode replica has room for waits for room.
DECODE_ROOM_WAIT_S = 30.0


@dataclass(frozen=True)
class RouterSpec:
    """The router's options (pickled to its actor)."""

    policy: str = "prefix"
    tokenizer_path: str = ""
    chat_template: str | None = None
    max_load_gap: int = 4
    log_level: str = "info"
    api_key: str | None = None  # guards /router/stats (the replicas guard everything else)
    # Each replica's role, in the order the replicas are bound ("both" for all when empty):
    # with prefill and decode replicas the router splits requests (infer.cluster.disagg).
    roles: tuple[str, ...] = ()


def replica_names(roles: tuple[str, ...]) -> list[str]:
    """Deployment names: ``replica-i`` when every replica does both phases, else
    ``prefill-k`` / ``decode-k``."""
    if all(r == "both" for r in roles):
        return [f"replica-{i}" for i in range(len(roles))]
    seen: dict[str, int] = {}
    names = []
    for role in roles:
        names.append(f"{role}-{seen.get(role, 0)}")
        seen[role] = seen.get(role, 0) + 1
    return names


class _ChatRendering:
    """What ``infer.server.chat.render_chat`` reads of a ``Serving``: the tokenizer and the
    ``--chat-template`` override (and no images: a prompt's placeholders are hashed as
    tokens, so prompts with images route by their text)."""

    image_prompts = None

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        from infer.server.serving import ServerSettings

        self.tokenizer = tokenizer
        self.settings = ServerSettings(served_model_names=("router",), chat_template=chat_template)


@serve.deployment(max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class Router:
    """Routes each request to a replica chosen by the policy; see the module docstring."""

    async def __init__(self, spec: RouterSpec, *replicas: DeploymentHandle) -> None:
        from prometheus_client import disable_created_metrics

        from infer.model.tokenizer import load_tokenizer
        from infer.server.cli import configure_logging

        configure_logging(spec.log_level, access_log=False)
        if not replicas:
            raise ValueError("the router needs at least one replica")
        self.spec = spec
        self.replicas = list(replicas)
        self.draining = False  # (drain: new requests get 503, those in flight finish)
        roles = spec.roles or ("both",) * len(replicas)
        if len(roles) != len(replicas):
            raise ValueError(f"{len(roles)} roles for {len(replicas)} replicas")
        self.names = replica_names(roles)
        infos = await asyncio.gather(*(h.info.remote() for h in self.replicas))
        self.infos = dict(zip(self.names, infos, strict=True))
        self.block_size = infos[0].block_size
        if any(i.block_size != self.block_size for i in infos):
            raise ValueError("the replicas' KV block sizes differ")
        # Disaggregated: the policy picks among the prefill replicas (``self.routed`` maps its
        # indices to replicas), the least-loaded decode replica continues the stream.
        self.decode_ids = [i for i, r in enumerate(roles) if r == "decode"]
        self.routed = [i for i, r in enumerate(roles) if r != "decode"]
        if bool(self.decode_ids) != any(r == "prefill" for r in roles):
            raise ValueError("prefill replicas need decode replicas and the other way round")
        self.decode_policy = LeastLoaded(len(self.decode_ids)) if self.decode_ids else None
        kwargs = {}
        if spec.policy == "prefix":
            # A replica can cache at most its pool's blocks: remember no more than that.
            kwargs = {"capacity_blocks": min(infos[i].num_blocks for i in self.routed),
                      "max_load_gap": spec.max_load_gap}  # fmt: skip
        self.policy: RoutingPolicy = make_policy(spec.policy, len(self.routed), **kwargs)
        self.needs_hashes = spec.policy == "prefix"
        self.tokenizer = load_tokenizer(spec.tokenizer_path) if self.needs_hashes else None
        self.chat = _ChatRendering(self.tokenizer, spec.chat_template)
        self._any = 0  # round-robin over replicas for the un-routed paths

        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.m_requests = Counter("infer:router_requests", "Generation requests sent, by replica "
                                  "and routing reason.", ["replica", "reason"],
                                  registry=self.registry)  # fmt: skip
        self.m_in_flight = Gauge("infer:router_requests_in_flight", "Generation requests in "
                                 "flight, by replica.", ["replica"], registry=self.registry)  # fmt: skip
        self.m_routing = Histogram("infer:router_routing_seconds", "Request arrival at the "
                                   "router to the replica call (read body, tokenize, hash, "
                                   "choose).", registry=self.registry,
                                   buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01,
                                            0.02, 0.05, 0.1))  # fmt: skip
        self.m_matched = Counter("infer:router_prefix_matched_blocks", "Prompt blocks the "
                                 "chosen replica was sent before (prefix policy).",
                                 registry=self.registry)  # fmt: skip
        for name in self.names:
            self.m_in_flight.labels(name)
        self.m_transfers = Counter("infer:kv_transfers", "Prompt KV hand-offs from a prefill "
                                   "replica to a decode replica.", registry=self.registry)  # fmt: skip
        self.m_transfer_bytes = Counter("infer:kv_transfer_bytes", "Bytes of prompt KV handed "
                                        "off.", registry=self.registry)  # fmt: skip
        self.m_transfer_seconds = Histogram("infer:kv_transfer_seconds", "Per hand-off: export "
                                            "on the prefill side (copy out, into the object "
                                            "store) + fetch on the decode side.",
                                            registry=self.registry,
                                            buckets=(1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1,
                                                     0.2, 0.5, 1.0, 2.0))  # fmt: skip
        self.m_no_room = Counter("infer:kv_transfer_no_room", "Decode replicas that had no room "
                                 "for a prompt's KV when asked.", registry=self.registry)  # fmt: skip
        self.m_phase_failures = Counter("infer:disagg_replica_failures", "Calls to a prefill or "
                                        "decode replica that failed (the replica died or "
                                        "restarted).", ["phase"], registry=self.registry)  # fmt: skip
        # (arrival -> replica call, of which: tokenize + hash + choose) per recent request
        self.recent_routing: deque[tuple[float, float]] = deque(maxlen=_RECENT)
        logger.info("router: %d replicas, policy %s, block size %d", len(replicas),
                    spec.policy, self.block_size)  # fmt: skip

    # ---- the endpoint -------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = await request.body()
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=tuple(request.headers.raw),
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
        )
        path = forwarded.path
        if _names_a_stored_response(forwarded):  # (its replica, not the best one, has it)
            return await self._stored_response(forwarded)
        if request.method == "POST" and path in ROUTED_PATHS:
            if self.draining:  # as a single server answers while it drains
                return _error(503, "the server is shutting down", "unavailable")
            return await self._generate(forwarded, arrived, request)
        if path == "/metrics" and request.method == "GET":
            return await self._metrics(forwarded)
        if path == "/router/stats" and request.method == "GET":
            if not self._authorized(request):
                return JSONResponse({"error": {"message": "missing or wrong API key: send "
                                               "'Authorization: Bearer <key>'",
                                               "type": "invalid_request_error",
                                               "code": "invalid_api_key"}},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            await self._refresh_infos()
            return JSONResponse(self.stats())
        if path == "/reset_prefix_cache" and request.method == "POST":
            answers = await self._call_all(forwarded)
            response, forget = reset_answer(answers)
            if forget:  # every replica dropped its prefixes: the router's memory of them goes
                self._forget_prefixes()
            return response
        if path in BROADCAST_PATHS:
            return await self._broadcast(forwarded)
        named = request.query_params.get("replica")
        if named in self.names:  # e.g. /dashboard?replica=decode-0: that replica's live view
            return await self._forward(self.names.index(named), forwarded, request, on_end=None)
        return await self._forward(self._next_turn(), forwarded, request, on_end=None)

    async def drain(self, timeout: float) -> bool:
        """Shutting down: refuse new requests (503) and wait up to ``timeout`` s for those in
        flight to finish (True when they did); then the replicas can go."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while sum(self.stats()["in_flight"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not sum(self.stats()["in_flight"])

    def _authorized(self, request: Request) -> bool:
        """The replicas check the key on what they answer; the router's own route does here."""
        if not self.spec.api_key:
            return True
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, f"Bearer {self.spec.api_key}".encode())

    def _track(self, policy: RoutingPolicy, local: int, replica: int, reason: str,
               hashes: list[BlockHash] = (), count: bool = True) -> Any:  # fmt: skip
        """Count a request started on ``replica`` (index ``local`` of ``policy``; ``count``
        False: in flight only, counted as sent by the caller once it is); the function that
        ends it, exactly once, however the response ends."""
        policy.start(local, hashes)
        name = self.names[replica]
        if count:
            self.m_requests.labels(name, reason).inc()
        self.m_in_flight.labels(name).inc()
        ended = False

        def on_end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                policy.finish(local)
                self.m_in_flight.labels(name).dec()

        return on_end

    async def _generate(self, fwd: ForwardedRequest, arrived: float, raw: Request) -> Response:
        decide_from = time.perf_counter()
        prefill_fwd = None
        if self.decode_policy is not None and fwd.path not in (*POOLING_PATHS, *FRONT_PATHS):
            prefill_fwd = split_request(fwd)
        # (an embedding request is all prefill with nothing to hand over: disaggregated, a
        # decode replica runs it whole, as a request that is not split)
        if self.decode_policy is not None and prefill_fwd is None:
            # Not split (several prompts or choices, prompt logprobs): one decode replica
            # runs both phases.
            self.recent_routing.append((time.perf_counter() - arrived, 0.0))
            return await self._decode_phase(fwd, None, raw)
        hashes: list[BlockHash] = []
        if self.needs_hashes:
            hashes = await self._block_hashes(fwd.path, fwd.body)
        decision = self.policy.choose(hashes)
        replica = self.routed[decision.replica]
        on_end = self._track(self.policy, decision.replica, replica, decision.reason, hashes)
        self.m_matched.inc(decision.matched_blocks)
        now = time.perf_counter()
        self.m_routing.observe(now - arrived)
        self.recent_routing.append((now - arrived, now - decide_from))
        if prefill_fwd is not None:
            try:
                result = await _cancelling(self.replicas[replica].prefill.remote(prefill_fwd))
            except Exception as e:  # noqa: BLE001 - the replica died or restarted
                self.m_phase_failures.labels("prefill").inc()
                logger.warning("prefill on %s failed: %s", self.names[replica], e)
                return _error(503, f"the prefill replica failed: {type(e).__name__}",
                              "replica_failed")  # fmt: skip
            finally:  # done, failed, or the client left (cancelled): the prefill is over
                on_end()
            if result.ticket is None and result.start.status != 200:
                # An error answer (bad input, 429, ...): the client's, as one server gives it.
                return Response(result.body, status_code=result.start.status,
                                headers=_response_headers(result.start))  # fmt: skip
            # (A success without a ticket: the KV could not be exported; the decode replica
            # computes the prompt itself.)
            return await self._decode_phase(fwd, result if result.ticket else None, raw)
        try:
            return await self._forward(replica, fwd, raw, on_end=on_end)
        except BaseException:
            on_end()
            raise

    async def _decode_phase(self, fwd: ForwardedRequest, prefill: PrefillResult | None,
                            raw: Request) -> Response:  # fmt: skip
        """Send the request to the least-loaded decode replica that has room for it, with the
        prefill's KV when there is one: that replica first fetches the payload (``receive``:
        one without room answers ``NoRoom`` and the next is asked; when none has, wait for room,
        up to ``DECODE_ROOM_WAIT_S``), then runs the request from it (``handle``). A payload
        that cannot be fetched (its prefill replica died) is dropped: the decode replica
        computes the prompt. A replica call that fails before the response starts is retried
        once (on the next replica); then a 503 names the failure."""
        assert self.decode_policy is not None
        ticket = prefill.ticket if prefill is not None else None
        policy = self.decode_policy
        deadline = time.monotonic() + DECODE_ROOM_WAIT_S
        failures = 0
        while True:
            order = sorted(range(policy.num_replicas),
                           key=lambda i: (policy.in_flight[i], policy.sent[i], i))  # fmt: skip
            for local in order:
                replica = self.decode_ids[local]
                # (counted as sent once it is: a replica without room is asked, not sent to)
                on_end = self._track(policy, local, replica, "decode", count=False)
                handle = self.replicas[replica]
                gen = None
                try:
                    key = None
                    if ticket is not None:
                        received = await self._receive(handle, ticket)
                        if isinstance(received, NoRoom):
                            on_end()
                            self.m_no_room.inc()
                            continue
                        if received is None:  # the payload is lost: compute the prompt there
                            ticket = None
                        else:
                            assert prefill is not None
                            key = received.key
                            self.m_transfers.inc()
                            self.m_transfer_bytes.inc(received.nbytes)
                            self.m_transfer_seconds.observe(prefill.export_seconds +
                                                            received.seconds)  # fmt: skip
                    gen = handle.options(stream=True).handle.remote(fwd, key)
                    self.m_requests.labels(self.names[replica], "decode").inc()
                    first = await gen.__anext__()
                except asyncio.CancelledError:
                    if gen is not None:
                        gen.cancel()
                    on_end()
                    raise
                except Exception as e:  # noqa: BLE001 - the replica died or restarted
                    if gen is not None:
                        gen.cancel()
                    on_end()
                    failures += 1
                    self.m_phase_failures.labels("decode").inc()
                    logger.warning("decode on %s failed: %s", self.names[replica], e)
                    if failures > 1:
                        return _error(503, f"the decode replica failed: {type(e).__name__}",
                                      "replica_failed")  # fmt: skip
                    continue
                return await self._relay(gen, first, on_end)
            if time.monotonic() > deadline:
                return _error(503, f"no decode replica had room for this prompt's KV within "
                              f"{DECODE_ROOM_WAIT_S:g}s", "no_room")  # fmt: skip
            await asyncio.sleep(0.05)

    async def _receive(self, handle: DeploymentHandle, ticket: Any) -> KVReceived | NoRoom | None:
        """A decode replica's ``receive`` of the payload; None when the payload itself is
        lost (its owner, the prefill replica, died): the replica's own failures raise."""
        try:
            return await _cancelling(handle.receive.remote(ticket))
        except Exception as e:
            if isinstance(e, ObjectLostError) or isinstance(getattr(e, "cause", None),
                                                             ObjectLostError):  # fmt: skip
                logger.warning("a transferred KV payload was lost (%s): computing the prompt "
                               "on the decode replica", type(e).__name__)  # fmt: skip
                return None
            raise

    async def _forward(self, replica: int, fwd: ForwardedRequest, raw: Request,
                       on_end: Any) -> Response:  # fmt: skip
        """Call the replica; return its answer as it comes (an SSE stream chunk by chunk)."""
        gen, start = await self._open(replica, fwd)
        return await self._relay(gen, start, on_end)

    async def _open(self, replica: int, fwd: ForwardedRequest) -> tuple[Any, Any]:
        """Call the replica: its answer's stream and first piece (the stream cancelled if
        that never comes)."""
        gen = self.replicas[replica].options(stream=True).handle.remote(fwd)
        try:
            return gen, await gen.__anext__()
        except BaseException:
            gen.cancel()
            raise

    async def _relay(self, gen: Any, start: Any, on_end: Any) -> Response:
        """A replica's answer from its first piece on: an SSE stream relayed chunk by chunk
        (a replica that dies mid-stream ends it with an error event), else the whole body."""
        assert isinstance(start, ResponseStart)
        headers = _response_headers(start)
        if (start.header("content-type") or "").startswith("text/event-stream"):

            def cleanup() -> None:  # done, or the client went away: stop the replica's side
                gen.cancel()
                if on_end is not None:
                    on_end()

            async def body():
                try:
                    async for chunk in gen:
                        yield chunk
                except Exception as e:  # noqa: BLE001 - the replica died mid-stream
                    logger.warning("a replica failed mid-stream: %s", e)
                    yield sse(json.dumps(APIError(502, f"the replica serving this stream "
                                                  f"failed: {type(e).__name__}",
                                                  type="server_error",
                                                  code="replica_failed").body()))  # fmt: skip
                    yield SSE_DONE
                finally:
                    cleanup()

            return _RelayResponse(body(), cleanup, status_code=start.status, headers=headers)
        try:  # a plain body: collect it, so the client gets a Content-Length
            chunks = [chunk async for chunk in gen]
        finally:
            gen.cancel()
            if on_end is not None:
                on_end()
        return Response(b"".join(chunks), status_code=start.status, headers=headers)

    def _next_turn(self) -> int:
        """The replica whose turn it is for an un-routed request (round-robin)."""
        replica = self._any
        self._any = (self._any + 1) % len(self.replicas)
        return replica

    async def _stored_response(self, fwd: ForwardedRequest) -> Response:
        """A request about a stored response (``previous_response_id``, ``GET`` / ``DELETE
        /v1/responses/{id}``): a response is kept by the replica that made it, so each replica
        in turn until one knows it (one that answers ``response_not_found`` is passed by; the
        last one's answer stands)."""
        first = self._next_turn()
        for k in range(len(self.replicas)):
            gen, start = await self._open((first + k) % len(self.replicas), fwd)
            if start.status not in (400, 404) or k == len(self.replicas) - 1:
                return await self._relay(gen, start, on_end=None)
            try:
                body = b"".join([chunk async for chunk in gen])
            finally:
                gen.cancel()
            if b'"response_not_found"' not in body:  # (another 400: the answer)
                return Response(body, status_code=start.status,
                                headers=_response_headers(start))  # fmt: skip
        raise AssertionError("unreachable: the last replica's answer is returned")

    async def _call(self, replica: int, fwd: ForwardedRequest) -> tuple[ResponseStart, bytes]:
        """One whole response from ``replica``."""
        pieces = [p async for p in self.replicas[replica].options(stream=True).handle.remote(fwd)]
        start = pieces[0]
        assert isinstance(start, ResponseStart)
        return start, b"".join(p for p in pieces[1:] if isinstance(p, bytes))

    async def _call_all(self, fwd: ForwardedRequest) -> list[tuple[ResponseStart, bytes]]:
        return await asyncio.gather(*(self._call(i, fwd) for i in range(len(self.replicas))))

    async def _broadcast(self, fwd: ForwardedRequest) -> Response:
        """Send to every replica: the first failure is the answer, else replica 0's answer."""
        answers = await self._call_all(fwd)
        start, body = next(((s, b) for s, b in answers if s.status >= 400), answers[0])
        return Response(body, status_code=start.status, headers=_response_headers(start))

    async def _metrics(self, fwd: ForwardedRequest) -> Response:
        answers = await self._call_all(fwd)
        bad = next(((s, b) for s, b in answers if s.status != 200), None)
        if bad is not None:  # e.g. a 401 without the API key: the replicas' answer stands
            return Response(bad[1], status_code=bad[0].status, headers=_response_headers(bad[0]))
        text = merge_metrics([b.decode() for _, b in answers])
        own = generate_latest(self.registry).decode()
        return Response(text + own, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- routing ------------------------------------------------------------------------------
    async def _block_hashes(self, path: str, body: bytes) -> list[BlockHash]:
        """The prompt's block hashes, or none when the body cannot be read as a prompt (the
        replica then answers the error)."""
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                return []
            salt = data.get("cache_salt")
            salt = salt if isinstance(salt, str) else None
            if len(body) > _INLINE_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(self._prompt_ids, path, data)
            else:
                ids = self._prompt_ids(path, data)
        except Exception:  # noqa: BLE001 - a bad body is the replica's to reject, with its error
            logger.debug("no prompt hashes for this body", exc_info=True)
            return []
        return prompt_block_hashes(ids, self.block_size, salt) if ids else []

    def _prompt_ids(self, path: str, data: dict[str, Any]) -> list[int]:
        """The first prompt's token ids, as the server computes them."""
        if path in ("/v1/chat/completions", *FRONT_PATHS):
            from infer.server.chat import render_request

            # (self.chat has the two attributes rendering reads: settings, tokenizer)
            return render_request(self.chat, _as_chat(path, data))  # type: ignore[arg-type]
        prompt = data.get(POOLING_PATHS.get(path, "prompt"))
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, str):
            special = bool(data.get("add_special_tokens", True)) and not data.get("suffix")
            return self.tokenizer.encode(prompt, add_special_tokens=special)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []

    def _forget_prefixes(self) -> None:
        """After /reset_prefix_cache nothing is cached anywhere: start affinity afresh."""
        held = getattr(self.policy, "held", None)
        if held is not None:
            for h in held:
                h.clear()

    async def _refresh_infos(self, timeout: float = 2.0) -> None:
        """Ask each replica again (Serve may have replaced one: new process ids); one that
        does not answer in ``timeout`` seconds keeps what it said last."""

        async def ask(handle: DeploymentHandle) -> Any:
            response = handle.info.remote()
            try:
                return await asyncio.wait_for(response, timeout)
            except Exception:  # noqa: BLE001 - down or restarting: keep the last answer
                response.cancel()
                return None

        answers = await asyncio.gather(*(ask(h) for h in self.replicas))
        for name, info in zip(self.names, answers, strict=True):
            if info is not None:
                self.infos[name] = info

    def stats(self) -> dict[str, Any]:
        """The router's counters, for ``GET /router/stats`` and the benchmark: routing time per
        request (arrival -> replica call) and its decision part (tokenize, hash, choose; the
        rest is reading the body from Serve's proxy), over the last requests."""

        def summary(xs: list[float]) -> dict[str, float | int | None]:
            xs = sorted(xs)
            if not xs:
                return {"count": 0, "p50": None, "p99": None, "mean": None}
            at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
            return {"count": len(xs), "p50": at(0.5), "p99": at(0.99), "mean": sum(xs) / len(xs)}

        sent = [0] * len(self.names)
        in_flight = [0] * len(self.names)
        for policy, ids in ((self.policy, self.routed), (self.decode_policy, self.decode_ids)):
            for local, replica in enumerate(ids):
                sent[replica] = policy.sent[local]  # type: ignore[union-attr]
                in_flight[replica] = policy.in_flight[local]  # type: ignore[union-attr]
        return {
            "policy": self.policy.name,
            "replicas": self.names,
            "roles": {n: i.role for n, i in self.infos.items()},
            "pids": {n: {"replica": i.pid, "engine": i.engine_pid} for n, i in self.infos.items()},
            "sent": sent,
            "in_flight": in_flight,
            "routing_seconds": summary([r for r, _ in self.recent_routing]),
            "decision_seconds": summary([d for _, d in self.recent_routing]),
        }


class _RelayResponse(StreamingResponse):
    """A streamed replica answer that cleans up even when the client leaves before the first
    chunk was asked for (then the body generator never started, and its ``finally`` never
    runs)."""

    def __init__(self, content: Any, cleanup: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _cancelling(response: Any) -> Any:
    """Await a replica call's result; cancelled (the client left), cancel the call too, so
    the replica stops its side (a prefill is aborted in its engine)."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


def _error(status: int, message: str, code: str) -> JSONResponse:
    """An OpenAI-style error body from the router itself."""
    body = APIError(status, message, type="server_error", code=code).body()
    return JSONResponse(body, status_code=status)


_HOP_BY_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


def reset_answer(answers: list[tuple[ResponseStart, bytes]]) -> tuple[Response, bool]:
    """``/reset_prefix_cache`` as the replicas answered it: the first failure as it is, else
    ``{"reset": true}`` only when every replica reset (one that refused, with requests running,
    makes it false); and whether the router should forget its prefixes (all reset)."""
    failed = next(((s, b) for s, b in answers if s.status >= 400), None)
    if failed is not None:
        return Response(failed[1], status_code=failed[0].status,
                        headers=_response_headers(failed[0])), False  # fmt: skip
    every = all(json.loads(body).get("reset") is True for _, body in answers)
    return JSONResponse({"reset": every}), every


def _as_chat(path: str, data: dict[str, Any]) -> Any:
    """The chat request a chat-shaped body runs as (the fronts' own conversion)."""
    if path == "/v1/messages":
        from infer.server.messages import chat_request
        from infer.server.messages_protocol import MessagesRequest

        return chat_request(MessagesRequest.model_validate(data))
    if path == "/v1/responses":
        from infer.server.responses import chat_request, front_messages
        from infer.server.responses_protocol import ResponsesRequest

        request = ResponsesRequest.model_validate(data)
        return chat_request(request, front_messages(request))
    from infer.server.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(data)


def _names_a_stored_response(fwd: ForwardedRequest) -> bool:
    """A Responses API request that names a stored response: ``GET`` / ``DELETE
    /v1/responses/{id}``, or a new response continuing one (``previous_response_id``)."""
    if fwd.path.startswith("/v1/responses/") and fwd.method in ("GET", "DELETE"):
        return True
    if fwd.path != "/v1/responses" or fwd.method != "POST":
        return False
    try:
        body = json.loads(fwd.body)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("previous_response_id") is not None


def _response_headers(start: ResponseStart) -> dict[str, str]:
    """The replica's headers minus the framing ones, which this response sets itself."""
    out: dict[str, str] = {}
    for k, v in start.headers:
        if k.lower() not in _HOP_BY_HOP:
            out[k.decode("latin-1")] = v.decode("latin-1")
    return out
