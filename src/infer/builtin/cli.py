"""``infer train``: build a built-in model, into the cache (default) or a folder of your choice.

infer train --preset small                 # build (or find) the cached default model
infer train --preset toy --out ./toy --steps 500 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from infer.builtin.presets import BUILTIN_NAMES, DEFAULT_SEED, get_preset


def register(subparsers) -> None:
    """Add the ``train`` subcommand to the ``infer`` CLI."""
    p = subparsers.add_parser(
        "train",
        help="train a built-in model (toy, small or small-draft) offline",
        description="Train a built-in model on Python's bundled documentation. Deterministic "
        "for a seed. Without --out the model goes into the user cache; with the default "
        "--seed and --steps that is the copy `infer serve --model NAME` uses.",
    )
    p.add_argument("--preset", choices=BUILTIN_NAMES, required=True, help="which model")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the cache)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: preset's)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _train_into(out: Path, preset_name: str, seed: int, steps: int | None, progress: bool):
    """Train into a temp sibling of ``out`` and rename it into place when finished."""
    from infer.builtin.train import train

    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"infer train: {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        result = train(get_preset(preset_name), tmp, seed=seed, steps=steps, progress=progress)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def run(args: argparse.Namespace) -> int:
    progress = not args.no_progress
    if args.steps is not None and args.steps < 1:
        raise SystemExit("infer train: --steps must be >= 1")
    if args.out is None:
        from infer.builtin.cache import ensure_builtin_model

        path = ensure_builtin_model(
            args.preset, progress=progress, seed=args.seed, steps=args.steps
        )
    else:
        result = _train_into(args.out, args.preset, args.seed, args.steps, progress)
        path = args.out
        print(
            f"trained {result.steps} steps in {result.elapsed_s:.1f}s "
            f"({result.tokens_per_s:,.0f} tokens/s)",
            file=sys.stderr,
        )
    manifest = json.loads((path / "infer_builtin.json").read_text())
    print(f"model:      {path}")
    print(f"parameters: {manifest['num_params']:,}")
    print(
        f"loss:       {manifest['final_loss']:.4f} (train)  {manifest['val_loss']:.4f} (held out)"
    )
    print(
        f"sample ({manifest['sample_prompt']!r} + {get_preset(args.preset).sample_tokens} tokens):"
    )
    print(manifest["sample"])
    return 0
