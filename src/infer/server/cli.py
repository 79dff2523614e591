"""``infer serve``: load the model, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from infer.config import EngineConfig
from infer.engine.affinity import CpuBinding, plan_cpu_binding
from infer.engine.args import add_engine_args, byte_size, engine_config_from_args
from infer.engine.async_engine import END_GRACE_S
from infer.engine.heap import freeze_startup_heap, frozen_imports

if TYPE_CHECKING:
    from infer.server.serving import ServerSettings

logger = logging.getLogger("infer.server")


def _number(kind: type, low: float, *, high: float | None = None, above: bool = False):
    """An argparse type: a ``kind`` (int or float) >= ``low`` (> with ``above``), <= ``high``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value < low or (above and value == low) or (high is not None and value > high):
            bound = f"> {low}" if above else f">= {low}"
            if high is not None:
                bound = f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    g.add_argument("--port", type=_number(int, 0, high=65535), default=8000)
    g.add_argument("--api-key", default=os.environ.get("INFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every "
                   "route but /health (default: $INFER_API_KEY)")  # fmt: skip
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the --model value)")  # fmt: skip
    g.add_argument("--chat-template", type=Path, default=None,
                   help="a Jinja chat template file overriding the model's")  # fmt: skip
    g.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                   help="chat replies: a thinking model's <think>...</think> in the message's "
                   "'reasoning' field (and 'reasoning_content'), apart from its content")  # fmt: skip
    g.add_argument("--tool-call-parser", default="hermes",
                   choices=["hermes", "llama3_json", "mistral", "qwen3_coder"],
                   help="how the model writes tool calls in a tool_choice auto reply: hermes "
                   "(<tool_call> blocks: Hermes, Qwen) | llama3_json (Llama 3.1/3.2) | mistral "
                   "([TOOL_CALLS] and a JSON array) | qwen3_coder (<tool_call> blocks of "
                   "<function=...> and <parameter=...>: Qwen3-Coder)")  # fmt: skip
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always on")  # fmt: skip
    g.add_argument("--max-request-bytes", type=byte_size, default=8 * 2**20,
                   help="refuse larger request bodies with 413 (default 8MiB)")  # fmt: skip
    g.add_argument("--request-timeout", type=_number(float, 0, above=True), default=None,
                   help="seconds a request may wait and run before it is aborted")  # fmt: skip
    g.add_argument("--drain-timeout", type=_number(float, 0), default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")  # fmt: skip
    g.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="do not serve the live view of the engine at /dashboard")  # fmt: skip
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine loop in its own process (the default), apart from HTTP "
                   "work; --no-engine-process runs it on a thread of the server process")  # fmt: skip
    g.add_argument("--torch-threads", type=_number(int, 1), default=None,
                   help="intra-op threads for the engine's torch (default: torch's choice; 1 is "
                   "far steadier on a small, shared CPU box - see docs/server.md)")  # fmt: skip
    g.add_argument("--api-server-count", "-asc", type=_number(int, 1), default=1, metavar="N",
                   help="processes serving HTTP over the one engine, sharing the port: more "
                   "than one when the API server's CPU is the bound (many streams of a fast "
                   "engine; see docs/server.md; default 1)")  # fmt: skip
    g.add_argument("--cpu-bind", default="off", metavar="off|auto|CORES",
                   help="give the engine's main thread the first core to itself; its other compute "
                   "threads (one per other core) and the server process share the rest: auto = "
                   "every core this process may use, or a list like 0-3 (Linux; default off; "
                   "see docs/server.md)")  # fmt: skip
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--no-access-log", dest="access_log", action="store_false")

    g = parser.add_argument_group('replicas (Ray Serve; the ray extra: pip install -e ".[ray]")')
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run N engine replicas on Ray Serve behind this one endpoint, with a "
                   "router (see docs/replicas.md)")  # fmt: skip
    g.add_argument("--prefill-replicas", type=int, default=0, metavar="P",
                   help="disaggregated serving: P replicas compute prompts and hand their KV "
                   "to the decode replicas (with --decode-replicas; see docs/disaggregation.md)")  # fmt: skip
    g.add_argument("--decode-replicas", type=int, default=0, metavar="D",
                   help="disaggregated serving: D replicas take the prompt KV and stream the "
                   "tokens")  # fmt: skip
    g.add_argument("--router-policy", default="prefix",
                   choices=["prefix", "round-robin", "least-loaded"],
                   help="how the router picks a replica: the one most likely to hold the "
                   "prompt's prefix in its cache (default), in turn, or the least loaded")  # fmt: skip
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of "
                   "starting a local one")  # fmt: skip
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="Ray CPUs each replica reserves (default: 1, or a fair share of a "
                   "local machine with fewer cores than replicas)")  # fmt: skip
    g.add_argument("--router-max-load-gap", type=int, default=4,
                   help="prefix policy: send to the replica holding the prefix unless it has "
                   "more than this many requests in flight beyond the least-loaded one")  # fmt: skip


def server_settings(
    args: argparse.Namespace, names: tuple[str, ...], chat_template: str | None
) -> ServerSettings:
    """The HTTP front end's settings from the flags of :func:`add_server_args`."""
    from infer.server.serving import ServerSettings  # not at import: `infer --help` stays fast

    return ServerSettings(
        served_model_names=names,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        request_timeout=args.request_timeout,
        chat_template=chat_template,
        drain_timeout=args.drain_timeout,
        dashboard=args.dashboard,
        reasoning_parser=getattr(args, "reasoning_parser", None),
        tool_call_parser=getattr(args, "tool_call_parser", "hermes"),
        api_server_count=getattr(args, "api_server_count", 1),
    )


def register(subparsers) -> None:
    """Add ``infer serve`` to the ``infer`` command."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API.")  # fmt: skip
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.server",
                                description="Serve a model over an OpenAI-compatible HTTP API.")  # fmt: skip
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=serve)
    return p


def configure_logging(level: str, access_log: bool, tag: str | None = None) -> None:
    """The server's log format (``tag``: which of several API server processes writes)."""
    where = f" [{tag}]" if tag else ""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")  # fmt: skip
    logging.getLogger("infer.access").setLevel(logging.INFO if access_log else logging.WARNING)


def _while_the_engine_starts() -> None:
    """This process's own start-up, done while the engine builds: import the app's modules
    (fastapi, the pydantic schemas) and those of the classes the engine's first answer carries
    (``infer.engine.engine``), then collect and freeze the start-up heap (engine/heap.py) -
    ``serve`` freezes again once the app is built, a short pass over the few new objects."""
    import infer.engine.engine
    import infer.server.app  # noqa: F401

    freeze_startup_heap()


def start_engine(
    config: EngineConfig,
    engine_process: bool,
    torch_threads: int | None,
    binding: CpuBinding | None = None,
    meanwhile: Callable[[], object] | None = None,
    frontends: Sequence[Any] = (),
) -> Any:
    """The engine ``build_app`` serves: the loop in its own process (``EngineProcess``) or an
    ``LLMEngine`` whose loop will run on a thread of this process. Also used by each replica
    of ``--data-parallel-size``. ``meanwhile`` is work of this process to do while the engine
    process starts (before the engine is built, without one); ``frontends``: the engine's
    ends of the other API server processes' pipes (``--api-server-count``)."""
    if engine_process:
        from infer.engine.core_client import EngineProcess

        return EngineProcess(config, torch_threads=torch_threads, binding=binding,
                             meanwhile=meanwhile, frontends=frontends)  # fmt: skip
    if meanwhile is not None:
        meanwhile()
    from infer.engine.engine import LLMEngine

    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    return LLMEngine(config)


def cpu_binding(args: argparse.Namespace, config: EngineConfig) -> CpuBinding | None:
    """What ``--cpu-bind`` asks for, refused (ValueError) where it cannot apply."""
    if args.cpu_bind == "off":
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpu-bind works on Linux only")
    if not args.engine_process:
        raise ValueError(
            "--cpu-bind needs the engine in its own process (drop --no-engine-process)"
        )
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--cpu-bind does not combine with --tensor-parallel-size (each rank "
                         "binds its own cores)")  # fmt: skip
    if args.data_parallel_size > 1 or args.ray_address:
        raise ValueError("--cpu-bind is for one engine; replicas get their cores from Ray")
    binding = plan_cpu_binding(args.cpu_bind)
    if binding is None:
        logger.warning("--cpu-bind %s: one core, so nothing to bind", args.cpu_bind)
    return binding


def disaggregation(args: argparse.Namespace, config: EngineConfig) -> None:
    """Check ``--prefill-replicas`` / ``--decode-replicas`` (ValueError naming the problem)
    and set ``--data-parallel-size`` to their sum."""
    p, d = args.prefill_replicas, args.decode_replicas
    if not p and not d:
        return
    if p < 1 or d < 1:
        raise ValueError(f"disaggregated serving needs both --prefill-replicas and "
                         f"--decode-replicas >= 1, got {p} and {d}")  # fmt: skip
    if args.data_parallel_size not in (1, p + d):
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} but --prefill-replicas "
                         f"{p} + --decode-replicas {d} = {p + d}: give one or make them agree")  # fmt: skip
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("disaggregated serving does not combine with --tensor-parallel-size "
                         "(the transferred KV is one whole cache's)")  # fmt: skip
    if config.cache.kv_cache_backend != "paged" or not config.cache.use_kv_cache:
        raise ValueError("disaggregated serving moves paged KV blocks: it needs the paged KV "
                         "cache")  # fmt: skip
    args.data_parallel_size = p + d


def address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (None: it can, as far as a bind now
    tells): a host that does not resolve, a port already in use."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r} does not resolve ({e})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            return f"{e.strerror or e} (--port {port})"
    return None


def template_syntax_error(source: str) -> str | None:
    """Why a chat template does not compile (None: it does), compiled as transformers renders
    it (its Jinja environment has extensions of its own: ``{% generation %}``, loop controls);
    None too where this transformers has no such function to ask."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    try:
        _compile_jinja_template(source)
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


def serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.access_log,
                      tag="api0" if args.api_server_count > 1 else None)  # fmt: skip
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = args.chat_template.read_text()
        except OSError as e:
            logger.error("cannot read --chat-template %s: %s", args.chat_template, e)
            return 2
        error = template_syntax_error(chat_template)
        if error is not None:  # now, not as a 400 blaming every chat request's messages
            logger.error("--chat-template %s is not a valid Jinja template: %s",
                         args.chat_template, error)  # fmt: skip
            return 2
    if args.max_request_bytes < 1:
        logger.error("--max-request-bytes must be at least 1 byte, got %d", args.max_request_bytes)
        return 2
    try:
        config = engine_config_from_args(args)
    except ValueError as e:  # a bad option: say which, no traceback
        logger.error("%s", e)
        return 2
    if args.data_parallel_size < 1:
        logger.error("--data-parallel-size must be >= 1, got %d", args.data_parallel_size)
        return 2
    try:
        disaggregation(args, config)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    try:
        binding = cpu_binding(args, config)
        api_server_count_problem(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    names = tuple(args.served_model_name or [config.model.model or "small"])
    adapters = {m.lora_name for m in config.lora.lora_modules} if config.lora else set()
    if adapters & set(names):  # the adapter would hide the base model under that name
        logger.error("--lora-modules: %r is a served model name (--served-model-name); give "
                     "the adapter another name", sorted(adapters & set(names))[0])  # fmt: skip
        return 2
    problem = address_problem(args.host, args.port)
    if problem is not None:  # now, not after the model has loaded (minutes for a big one)
        logger.error("cannot serve on %s:%d: %s", args.host, args.port, problem)
        return 2
    if args.data_parallel_size > 1 or args.ray_address:
        try:  # ray is imported only down this path
            from infer.cluster.app import serve_cluster
        except ImportError as e:
            if (e.name or "").split(".")[0] != "ray":
                raise
            from infer.cluster import RAY_INSTALL_HINT

            logger.error("%s (%s)", RAY_INSTALL_HINT, e)
            return 2
        return serve_cluster(args, config, chat_template)
    from infer.server.api_servers import ApiServers, listening_socket, tokenizer_folder_now

    others = None  # the other API server processes (--api-server-count)
    try:
        # Bound now, listening once the app is built (a connection meanwhile is refused, not
        # left waiting out the load): held through the engine's start, the port cannot be
        # taken meanwhile, as by an ephemeral port the kernel hands tensor-parallel workers'
        # gloo sockets. With more API servers, one each (SO_REUSEPORT). Taken since the check
        # above: an error, as uvicorn's.
        sockets = [listening_socket(args.host, args.port, first=True,
                                    shared=args.api_server_count > 1)]  # fmt: skip
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", args.host, args.port, e)
        return 1
    port = sockets[0].getsockname()[1]  # (--port 0: the one the kernel chose)
    logger.info("port %d held (listening once the engine is up); the engine starts", port)
    if args.api_server_count > 1:
        # Started now, they import their modules while the engine starts.
        others = ApiServers.spawn(args, port, tokenizer_folder_now(config))
    # With the engine in its own process, this one only imports modules and loads the
    # tokenizer until the engine is up: without the cyclic collector (engine/heap.py).
    imports = frozen_imports() if args.engine_process else contextlib.nullcontext()
    try:
        with imports:
            engine = start_engine(config, args.engine_process, args.torch_threads, binding,
                                  meanwhile=_while_the_engine_starts,
                                  frontends=others.engine_ends if others else ())  # fmt: skip
    except BaseException as e:  # (a Ctrl-C during the start too: the others go with it)
        sockets[0].close()
        if others is not None:
            others.kill()
        if not isinstance(e, (ValueError, RuntimeError, OSError)):
            raise
        logger.debug("engine start-up failure", exc_info=True)  # --log-level debug: the trace
        logger.error("the engine could not start: %s", e)
        return 1
    try:
        return _serve_app(args, config, chat_template, engine, others, sockets, port)
    except BaseException:
        # Raised before a clean exit (a failure or a Ctrl-C while the app builds, a socket
        # uvicorn cannot listen on): nothing else stops the engine process and the other API
        # servers, and both ignore the SIGTERM that multiprocessing's exit sends them before
        # it waits for them.
        if others is not None:
            others.kill()
        if hasattr(engine, "kill"):
            engine.kill()
        raise


def _serve_app(args: argparse.Namespace, config: EngineConfig, chat_template: str | None,
               engine: Any, others: Any, sockets: list, port: int) -> int:  # fmt: skip
    """``serve`` once the engine is up: the app, the other API servers, uvicorn until exit."""
    from infer.server.app import build_app

    names = tuple(args.served_model_name or [engine.model_name])
    settings = server_settings(args, names, chat_template)
    app = build_app(engine, settings)
    cap = engine.capacity
    sc = config.scheduler
    logger.info(
        "serving %s (%s) on http://%s:%d: context %d tokens; KV cache %d tokens in %d blocks of %d "
        "(%.1f MiB); max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s, queue bound "
        "%s, API key %s",
        ", ".join(names), engine.model_path, args.host, port, engine.max_model_len,
        cap.num_tokens, cap.num_blocks, cap.block_size, cap.total_bytes / 2**20, sc.max_num_seqs,
        sc.max_num_batched_tokens,
        # (the engine's own config: it turns prefix caching off where it cannot apply)
        "on" if engine.config.cache.enable_prefix_caching
        else f"off ({engine.config.prefix_caching_off_reason or '--no-enable-prefix-caching'})",
        sc.max_queued_requests if sc.max_queued_requests is not None else "none",
        "required" if settings.api_key else "off",
    )  # fmt: skip
    if settings.dashboard:
        key = "?api_key=<key>" if settings.api_key else ""
        logger.info("live view: http://%s:%d/dashboard%s", args.host, port, key)
    uv_config = uvicorn_config(app, args)
    server = DrainingServer(uv_config, app.state.async_engine, args.drain_timeout)
    try:
        # Listen now, not in uvicorn: on uvloop a socket that cannot listen (a program took
        # the port while the engine loaded) was served without a word, and nothing answered.
        listen(sockets, uv_config.backlog)
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", args.host, port, e)
        if others is not None:
            others.kill()
        if hasattr(engine, "kill"):
            engine.kill()
        return 1
    if others is not None:
        try:
            others.start(settings, engine)
        except BaseException as e:  # (a Ctrl-C while they start too: the engine goes with it)
            engine.kill()
            if not isinstance(e, RuntimeError):
                raise
            logger.error("%s", e)
            return 1
    # (what uvicorn says when it binds the socket itself; given one, it says nothing)
    host = f"[{args.host}]" if ":" in args.host else args.host
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port
    )
    if others is not None:
        server.api_servers = others
        others.watch(server.api_server_died)
        # the others leave (drained) before the engine stops
        grace = args.drain_timeout + END_GRACE_S + 10
        app.state.async_engine.before_stop = lambda: others.stop(grace)
    # The engine (in this process with --no-engine-process) and the app are built: keep full
    # garbage collections from walking their objects mid-stream (engine/heap.py).
    logger.debug("froze %d start-up objects", freeze_startup_heap())
    server.run(sockets=sockets)
    if server.force_exit:  # a second Ctrl+C: no shutdown ran, nothing stopped the engine
        if server.api_servers is not None:
            server.api_servers.kill()
        if hasattr(engine, "kill"):
            engine.kill()
    return server.exit_code


def listen(sockets: list, backlog: int) -> None:
    """Make bound sockets listen (OSError: one cannot, as when another socket without
    ``SO_REUSEPORT`` listens on the port)."""
    for sock in sockets:
        sock.listen(backlog)


def uvicorn_config(app: Any, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings for the app (every API server process's)."""
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,  # ours (infer.access) says more: request id, tokens
        # (the drain, then each ended stream's wait for the engine's final outputs)
        timeout_graceful_shutdown=args.drain_timeout + END_GRACE_S + 5,
        timeout_keep_alive=30,
    )


def api_server_count_problem(args: argparse.Namespace) -> None:
    """Refuse (ValueError) what ``--api-server-count`` > 1 does not combine with."""
    n = args.api_server_count
    if n == 1:
        return
    if not args.engine_process:
        raise ValueError(f"--api-server-count {n} needs the engine in its own process (drop "
                         "--no-engine-process)")  # fmt: skip
    if args.data_parallel_size > 1 or args.ray_address:
        raise ValueError(f"--api-server-count {n} is for one engine: replicas "
                         "(--data-parallel-size, disaggregated serving, Ray) have their own "
                         "front end")  # fmt: skip
    if args.cpu_bind != "off":
        raise ValueError(f"--api-server-count {n} does not combine with --cpu-bind yet")
    from infer.server.lora_routes import RUNTIME_LORA_ENVS, runtime_lora_updating

    if runtime_lora_updating():
        raise ValueError(f"--api-server-count {n}: loading LoRA adapters at run time "
                         f"({RUNTIME_LORA_ENVS[0]}) needs one API server (each keeps its own "
                         "list of adapters)")  # fmt: skip


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM/SIGINT drain the engine and the process exits 0.

    uvicorn re-raises a captured signal after shutting down (so the exit status would say
    "killed by SIGTERM"); a drained shutdown is a clean exit for us, so we do not.
    """

    def __init__(self, config: uvicorn.Config, async_engine, drain_timeout: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout = drain_timeout
        self._draining = False
        self.exit_code = 0
        self.api_servers: Any = None  # the other API server processes (server/api_servers.py)
        async_engine.on_dead = self._engine_died

    def api_server_died(self, why: str, failed: bool = True) -> None:
        """Another API server process left (a thread's call): shut down; exit 1 if it failed."""
        if failed:
            logger.error("%s; shutting the server down", why)
            self.exit_code = 1
        else:
            logger.info("%s; shutting the server down", why)
        self.should_exit = True

    def _engine_died(self, why: str) -> None:
        """The engine died on its own: answer what is in flight with errors, then exit 1."""
        logger.error("the engine died (%s); shutting the server down", why)
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001 - a signal handler
        if self._draining:
            if sig == signal.SIGINT:  # a second Ctrl+C: stop waiting
                self.force_exit = True
            return
        self._draining = True
        logger.info("received %s: finishing in-flight requests (up to %gs), then exiting",
                    signal.Signals(sig).name, self.drain_timeout)  # fmt: skip
        if self.api_servers is not None:  # (a `kill PID` reaches this process only)
            self.api_servers.signal()
        self.should_exit = True  # uvicorn stops accepting and waits for open responses
        loop = self.async_engine._loop
        if loop is not None and not loop.is_closed():
            drain = self.async_engine.drain
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drain(self.drain_timeout)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
