"""``infer serve --data-parallel-size N``: N replicas and a router on Ray Serve, one endpoint.

``build_application`` assembles the Serve application (one deployment per replica, named
``replica-0`` .. ``replica-{N-1}`` so the router can address each, and the ``Router`` ingress);
``serve_cluster`` is the command: start Ray locally (or join ``--ray-address``), run the app on
``--host``/``--port``, block until SIGINT/SIGTERM, then take it down. ``build`` is the same app
for ``serve run``::

    serve run infer.cluster.app:build model=path/to/folder replicas=2 policy=prefix \\
        enable_prefix_caching=true
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError

from infer.cluster.policy import POLICIES
from infer.cluster.replica import InferReplica, ReplicaSpec
from infer.cluster.router import Router, RouterSpec, replica_names
from infer.config import EngineConfig
from infer.server.cli import server_settings
from infer.server.serving import ServerSettings

logger = logging.getLogger("infer.cluster")

APP_NAME = "infer"


@dataclass(frozen=True)
class ClusterSpec:
    """The replicas, the router and how much of Ray each replica reserves."""

    replica: ReplicaSpec
    router: RouterSpec
    num_replicas: int = 2
    replica_cpus: float = 1.0
    # Disaggregated serving: the first ``num_prefill`` replicas prefill, the rest decode.
    num_prefill: int = 0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.num_prefill and not 0 < self.num_prefill < self.num_replicas:
            raise ValueError(f"{self.num_prefill} prefill replicas of {self.num_replicas}: "
                             "at least one of each role")  # fmt: skip
        if self.router.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.router.policy!r}: choose one of "
                             f"{', '.join(POLICIES)}")  # fmt: skip
        if self.replica_cpus < 0:
            raise ValueError(f"replica_cpus must be >= 0, got {self.replica_cpus}")

    @property
    def roles(self) -> tuple[str, ...]:
        """Each replica's role, in order."""
        if not self.num_prefill:
            return ("both",) * self.num_replicas
        num_decode = self.num_replicas - self.num_prefill
        return ("prefill",) * self.num_prefill + ("decode",) * num_decode


def build_application(spec: ClusterSpec) -> serve.Application:
    """The Serve application: ``spec.num_replicas`` replica deployments behind the router
    (named ``replica-i``, or ``prefill-k`` / ``decode-k`` when disaggregated)."""
    roles = spec.roles
    replicas = [
        InferReplica.options(name=name, ray_actor_options={"num_cpus": spec.replica_cpus}).bind(
            replace(spec.replica, role=role)
        )
        for name, role in zip(replica_names(roles), roles, strict=True)
    ]
    router = replace(spec.router, roles=roles if spec.num_prefill else ())
    return Router.options(name="router").bind(router, *replicas)


def cluster_spec(args: argparse.Namespace, config: EngineConfig, chat_template: str | None,
                 replica_cpus: float) -> ClusterSpec:  # fmt: skip
    """The spec from ``infer serve``'s options; builds a built-in model here, once, first."""
    from infer.engine.model_source import resolve_model_path

    model_path = resolve_model_path(config.model.model)
    names = tuple(args.served_model_name or [config.model.model or "small"])
    settings = server_settings(args, names, chat_template)
    torch_threads = args.torch_threads or max(1, int(replica_cpus))
    replica = ReplicaSpec(engine=config, settings=settings, engine_process=args.engine_process,
                          torch_threads=torch_threads, log_level=args.log_level)  # fmt: skip
    router = RouterSpec(policy=args.router_policy,
                        tokenizer_path=str(config.model.tokenizer or model_path),
                        chat_template=chat_template, max_load_gap=args.router_max_load_gap,
                        log_level=args.log_level, api_key=args.api_key or None)  # fmt: skip
    return ClusterSpec(replica=replica, router=router, num_replicas=args.data_parallel_size,
                       replica_cpus=replica_cpus,
                       num_prefill=getattr(args, "prefill_replicas", 0))  # fmt: skip


REPLICA_STARTUP_TIMEOUT_ENV = "INFER_REPLICA_STARTUP_TIMEOUT"
PROXY_READY_TIMEOUT_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"  # Ray's own setting


def replica_startup_timeout(config: EngineConfig) -> float:
    """Seconds the replicas may take to start: ``INFER_REPLICA_STARTUP_TIMEOUT``, else 300 s +
    60 s per GB of the checkpoint's weight files (each replica loads the model)."""
    if os.environ.get(REPLICA_STARTUP_TIMEOUT_ENV):
        return float(os.environ[REPLICA_STARTUP_TIMEOUT_ENV])
    from infer.engine.model_source import resolve_model_path

    try:
        path = Path(resolve_model_path(config.model.model))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except (OSError, ValueError):
        size = 0
    return 300.0 + 60.0 * size / 1e9


def start_within(run: Callable[[], object], timeout: float, stop: threading.Event) -> str | None:
    """Call ``run`` (Serve's deploy, which waits for every replica to be up) on a thread and
    wait at most ``timeout`` seconds, or until ``stop`` (a signal): None once it returned, else
    why start-up failed. A replica that can neither start nor fail (a hung load) then ends
    ``infer serve`` with an error instead of an endless wait; the caller tears Serve down."""
    outcome: dict[str, BaseException | None] = {}

    def target() -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            outcome["error"] = e
        else:
            outcome["error"] = None

    thread = threading.Thread(target=target, name="infer-replicas-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline and not stop.is_set():
        thread.join(0.2)
    if "error" not in outcome:
        if stop.is_set():
            return "stopped by a signal while the replicas were starting"
        return (
            f"the replicas did not start within {timeout:g}s (a replica that hangs while "
            f"loading? set {REPLICA_STARTUP_TIMEOUT_ENV} for a longer start-up)"
        )
    if outcome["error"] is not None:
        return f"the replicas could not start: {outcome['error']}"
    return None


def serve_cluster(args: argparse.Namespace, config: EngineConfig, chat_template: str | None) -> int:
    """Run the replicas and the router until SIGINT/SIGTERM; the exit status."""
    n = args.data_parallel_size
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level=logging.WARNING)
    else:
        # A fresh local Ray on this machine, never one found in the environment.
        os.environ.pop("RAY_ADDRESS", None)
        # Serve kills an HTTP proxy not ready within 5 s (its default), failing start-up; on a
        # busy 2-core machine (three test workers beside) it took longer. Ray's actors inherit
        # the variable from this process.
        os.environ.setdefault(PROXY_READY_TIMEOUT_ENV, "30")
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    joined = bool(args.ray_address)
    try:
        cpus = float(ray.cluster_resources().get("CPU", 0.0))
        replica_cpus = args.replica_cpus
        if replica_cpus is None:  # 1 each, or a fair share where there are too few cores
            replica_cpus = min(1.0, cpus / n) if cpus else 0.0
        try:
            spec = cluster_spec(args, config, chat_template, replica_cpus)
        except (ValueError, OSError) as e:
            logger.error("%s", e)
            return 2
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
        except RayError as e:
            first_line = (str(e).splitlines() or [""])[0]
            logger.error("Ray Serve's HTTP proxy on %s:%d did not start (%s: %s); on a busy "
                         "machine set %s (seconds) higher", args.host, args.port,
                         type(e).__name__, first_line, PROXY_READY_TIMEOUT_ENV)  # fmt: skip
            return 1
        logger.info("starting %d replicas (%.2g CPUs each, of %g) and the %s router on "
                    "http://%s:%d", n, replica_cpus, cpus, spec.router.policy, args.host,
                    args.port)  # fmt: skip
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        app = build_application(spec)
        timeout = replica_startup_timeout(config)
        error = start_within(lambda: serve.run(app, name=APP_NAME, route_prefix="/"), timeout, stop)
        if error is not None:
            logger.error("%s", error)
            return 1
        logger.info("serving %s on http://%s:%d with %d replicas (%s; router policy %s)",
                    ", ".join(spec.replica.settings.served_model_names), args.host, args.port,
                    n, ", ".join(replica_names(spec.roles)), spec.router.policy)  # fmt: skip
        while not stop.wait(1.0):
            pass
        logger.info("shutting down: finishing in-flight requests (up to %gs)", args.drain_timeout)
        drain_router(args.drain_timeout)
        return 0
    finally:
        try:
            if joined:  # other applications may live on that cluster: remove only ours
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()


def drain_router(timeout: float) -> None:
    """Let the router finish what is in flight (new requests get 503) before Serve goes: shut
    down at once, the proxy and the router cut every open stream."""
    try:
        router = serve.get_app_handle(APP_NAME)
        drained = router.drain.remote(timeout).result(timeout_s=timeout + 30)
    except Exception as e:  # noqa: BLE001 - shutting down anyway: say why it was not drained
        logger.warning("could not drain the router: %s: %s", type(e).__name__, e)
        return
    if not drained:
        logger.warning("requests still in flight after %gs (--drain-timeout): cut", timeout)


def build(args: dict[str, Any]) -> serve.Application:
    """The application for ``serve run infer.cluster.app:build key=value ...``.

    Keys: ``model`` (required), ``replicas`` (2), ``policy`` (prefix), ``served_model_name``,
    ``enable_prefix_caching`` (true), ``max_num_seqs``, ``max_queued_requests``,
    ``block_size``, ``stream_interval`` (1), ``replica_cpus`` (1), ``torch_threads`` (1),
    ``max_load_gap`` (4), ``hf_overrides`` (JSON, as ``--hf-overrides``).
    """
    from infer.engine.model_source import resolve_model_path

    known = {"model", "replicas", "policy", "served_model_name", "enable_prefix_caching",
             "max_num_seqs", "max_queued_requests", "block_size", "stream_interval",
             "replica_cpus", "torch_threads", "max_load_gap", "hf_overrides"}  # fmt: skip
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown arguments {unknown}; known: {sorted(known)}")
    if "model" not in args:
        raise ValueError("model=PATH is required")
    model = str(args["model"])
    flag = str(args.get("enable_prefix_caching", "true")).lower() in ("1", "true", "yes")
    engine_kwargs: dict[str, Any] = {"model": model, "enable_prefix_caching": flag,
                                     "hf_overrides": args.get("hf_overrides")}  # fmt: skip
    for key in ("max_num_seqs", "max_queued_requests", "block_size", "stream_interval"):
        if key in args:
            engine_kwargs[key] = int(args[key])
    config = EngineConfig.from_kwargs(**engine_kwargs)
    settings = ServerSettings(served_model_names=(str(args.get("served_model_name", model)),))
    threads = int(args.get("torch_threads", 1))
    spec = ClusterSpec(
        replica=ReplicaSpec(engine=config, settings=settings, torch_threads=threads),
        router=RouterSpec(
            policy=str(args.get("policy", "prefix")),
            tokenizer_path=str(resolve_model_path(model)),
            max_load_gap=int(args.get("max_load_gap", 4)),
        ),  # fmt: skip
        num_replicas=int(args.get("replicas", 2)),
        replica_cpus=float(args.get("replica_cpus", 1.0)),
    )
    return build_application(spec)
