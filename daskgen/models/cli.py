"""``python -m daskgen.models``: convert SmolLM2 or build the tiny models from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from daskgen.errors import DaskgenError
from daskgen.models.cache import CACHE_ENV
from daskgen.models.smollm2 import smollm2_instruct
from daskgen.models.tiny import build_tiny_model
from daskgen.models.tiny_vl import DEFAULT_FAMILY, FAMILIES, build_tiny_vl_model


def main(argv: list[str] | None = None) -> int:
    """Command line: ``smollm2 [--cache-dir DIR]``, ``tiny PATH [--seed N] [--tokenizer-from DIR] [--head-dim N]``
    or ``tiny-vl [PATH] [--seed N] [--tokenizer-from DIR] [--cache-dir DIR] [--family NAME]``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "smollm2":
            print(smollm2_instruct(args.cache_dir))
        elif args.command == "tiny-vl":
            print(
                build_tiny_vl_model(
                    args.path,
                    seed=args.seed,
                    tokenizer_from=args.tokenizer_from,
                    cache_dir=args.cache_dir,
                    family=args.family,
                )
            )
        else:
            print(
                build_tiny_model(args.path, seed=args.seed, tokenizer_from=args.tokenizer_from, head_dim=args.head_dim)
            )
    except DaskgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    """The ``python -m daskgen.models`` argument parser, with its ``smollm2``, ``tiny`` and ``tiny-vl`` commands."""
    parser = argparse.ArgumentParser(
        prog="python -m daskgen.models", description="Build the project's local models offline."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    smol = sub.add_parser("smollm2", help="convert SmolLM2-135M-Instruct (if needed); print its folder")
    smol.add_argument("--cache-dir", type=Path, default=None, help=f"default: ${CACHE_ENV} or ~/.cache/daskgen")
    tiny = sub.add_parser("tiny", help="build the tiny test model into PATH; print PATH")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tokenizer-from", type=Path, default=None)
    tiny.add_argument("--head-dim", type=int, default=None, help="attention head width (vLLM on CPU needs >= 32)")
    vl = sub.add_parser("tiny-vl", help="build the tiny vision model (into PATH, default the cache); print its folder")
    vl.add_argument("path", type=Path, nargs="?", default=None)
    vl.add_argument("--seed", type=int, default=0)
    vl.add_argument("--tokenizer-from", type=Path, default=None)
    vl.add_argument("--family", choices=sorted(FAMILIES), default=DEFAULT_FAMILY, help=f"default {DEFAULT_FAMILY}")
    vl.add_argument(
        "--cache-dir", type=Path, default=None, help=f"without PATH; default: ${CACHE_ENV} or ~/.cache/daskgen"
    )
    return parser
