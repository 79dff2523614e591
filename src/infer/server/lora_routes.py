"""Loading and unloading LoRA adapters at runtime: vLLM's two routes, behind vLLM's switch.

``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter
{"lora_name"}`` exist only when the server runs with ``--enable-lora`` and the environment sets
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or ``INFER_ALLOW_RUNTIME_LORA_UPDATING``) to true, as in
vLLM: anyone who can reach the port could otherwise make the server read any folder. The engine
reads and checks the adapter between two steps (the running batch waits for at most that).
"""

from __future__ import annotations

import contextlib
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from infer.server.errors import APIError
from infer.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from infer.server.serving import Serving

RUNTIME_LORA_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "INFER_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating() -> bool:
    """Whether the environment allows the two routes (``1`` / ``true``)."""
    return any(os.environ.get(e, "").strip().lower() in ("1", "true") for e in RUNTIME_LORA_ENVS)


def install_lora_routes(app: FastAPI, serving: Serving, served: tuple[str, ...]) -> None:
    errors = {code: {"description": why} for code, why in
              [(400, "bad adapter (the message says why)"), (404, "no such adapter")]}  # fmt: skip

    @app.post("/v1/load_lora_adapter", tags=["lora"], responses=errors,
              response_class=PlainTextResponse)  # fmt: skip
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name in served:
            raise APIError(400, f"'{name}' is the served model's name; an adapter needs "
                           "another", param="lora_name")  # fmt: skip
        if name in serving.lora_adapters and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")  # fmt: skip
        try:
            await serving.engine.call("load_lora_adapter", name, body.lora_path,
                                      body.load_inplace)  # fmt: skip
        except (ValueError, OSError) as e:
            raise APIError(400, str(e), param="lora_path") from None
        serving.lora_adapters[name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", tags=["lora"], responses=errors,
              response_class=PlainTextResponse)  # fmt: skip
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name not in serving.lora_adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name", code="model_not_found")  # fmt: skip
        del serving.lora_adapters[name]  # new requests cannot name it from now on
        with contextlib.suppress(KeyError):  # already gone in the engine
            await serving.engine.call("unload_lora_adapter", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
