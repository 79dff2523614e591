"""The prompt-length rules, in one place: the engine and the HTTP server both call them."""

from __future__ import annotations

from collections.abc import Sequence

from infer.core.sampling_params import InvalidRequestError


def check_prompt(
    prompt_ids: Sequence[int],
    max_model_len: int,
    *,
    max_tokens: int | None = None,
    vocab_size: int | None = None,
    param: str = "prompt",
    max_tokens_param: str = "max_tokens",
    generates: bool = True,
) -> None:
    """Raise ``InvalidRequestError`` (naming ``param``, or ``max_tokens_param``: the field the
    request gave ``max_tokens`` in) if the prompt cannot be served.

    - the prompt is empty, or leaves no room for one generated token in ``max_model_len``
      (``generates=False``, an embedding request's: is longer than ``max_model_len``);
    - ``max_tokens`` is given and prompt + ``max_tokens`` exceeds ``max_model_len`` (the server
      refuses such requests, as OpenAI's API does; offline generation passes ``None`` and stops
      at the context length with ``finish_reason="length"``);
    - ``vocab_size`` is given and a token id is outside ``0..vocab_size-1``.
    """
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param=param)
    if not generates and n > max_model_len:
        raise InvalidRequestError(
            f"the input is {n} tokens but the model's context length is {max_model_len} tokens",
            param=param,
        )
    if generates and n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt is {n} tokens but the model's context length is {max_model_len} "
            "tokens (it must leave room for at least one generated token)",
            param=param,
        )
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the model's context length is {max_model_len} tokens, but {n + max_tokens} were "
            f"requested ({n} in the prompt + {max_tokens} for the completion); reduce the "
            f"prompt or {max_tokens_param}",
            param=max_tokens_param,
        )
    if vocab_size is not None:
        bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                param=param,
            )
