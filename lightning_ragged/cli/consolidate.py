"""``python -m lightning_ragged.consolidate``: write a sharded checkpoint directory as one ``.ckpt`` file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_ragged.checkpoint.consolidation import consolidate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ragged.consolidate",
        description="Write a lightning_ragged (or any Lightning/DCP) sharded checkpoint directory as one ordinary .ckpt file.",
    )
    parser.add_argument("checkpoint_dir", help="the sharded checkpoint directory")
    parser.add_argument("output_file", help="the .ckpt file to write (must not exist)")
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="refuse pickled objects beyond tensors and plain containers (the default; kept for compatibility)",
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="fully unpickle meta.pt, .metadata and pickled items (they can run arbitrary code): only for "
        "checkpoints whose writer you trust, e.g. with OmegaConf hyperparameters",
    )
    parser.add_argument(
        "--no-verify-checksums", action="store_true", help="do not check the shards against their recorded checksums"
    )
    args = parser.parse_args(argv)
    if args.weights_only and args.trust_checkpoint:
        parser.error("--weights-only and --trust-checkpoint contradict each other")
    output = Path(args.output_file)
    if output.exists():
        print(f"error: {output} exists; choose another path or remove it first", file=sys.stderr)
        return 1
    try:
        consolidate(
            args.checkpoint_dir,
            output,
            weights_only=True if args.weights_only else None,
            trust_checkpoint=args.trust_checkpoint,
            verify_checksums=not args.no_verify_checksums,
        )
    except Exception as error:  # noqa: BLE001 - a CLI: print the clear message, not a traceback
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
