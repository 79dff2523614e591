"""`infer generate`: run one prompt offline and stream its text to the terminal."""

from __future__ import annotations

import argparse
import sys
import time


def register(subparsers) -> None:
    from infer.engine.args import add_engine_args

    p = subparsers.add_parser("generate", help="generate text offline, streaming to the terminal")
    add_engine_args(p)
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text (repeat for several prompts, generated as one batch)",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from infer.core.sampling_params import InvalidRequestError, SamplingParams
    from infer.engine.args import engine_config_from_args
    from infer.engine.engine import LLMEngine
    from infer.model.chat_template import render_chat_ids

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:  # (before the model loads: a bad value is said at once)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
            stop=tuple(args.stop),
            seed=args.seed,
        )
    except InvalidRequestError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(engine_config_from_args(args))
    except (ValueError, RuntimeError, OSError) as e:  # as `infer serve`: one line, no traceback
        print(f"error: the engine could not start: {e}", file=sys.stderr)
        return 1
    tok = engine.tokenizer
    if args.chat and not getattr(tok, "chat_template", None):
        print("error: --chat needs a chat template, and this model's tokenizer has none",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        for i, prompt in enumerate(args.prompt):
            if args.chat:
                ids = render_chat_ids(tok, [{"role": "user", "content": prompt}])
            else:  # (the tokenizer's BOS etc., as the offline API and the server add them)
                ids = tok.encode(prompt)
            engine.add_request(str(i), ids, params)
    except InvalidRequestError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    single = len(args.prompt) == 1
    start = time.perf_counter()
    n_tokens = 0
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            n_tokens += len(out.new_token_ids)
            if single:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            else:
                texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
    elapsed = time.perf_counter() - start
    if single:
        sys.stdout.write("\n")
    else:
        for i, prompt in enumerate(args.prompt):
            print(f"--- [{i}] {prompt!r}\n{texts.get(str(i), '')}")
    print(
        f"[{n_tokens} tokens in {elapsed:.2f}s, {n_tokens / max(elapsed, 1e-9):.1f} tok/s]",
        file=sys.stderr,
    )
    return 0
