"""``python -m lightning_ragged.consolidate``: write a sharded checkpoint directory as one ``.ckpt`` file,
or (``--format hf``) as a Hugging Face model directory of ``safetensors`` files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_ragged.checkpoint.consolidation import consolidate
from lightning_ragged.checkpoint.hf_export import MAX_SHARD_SIZE, export_hf, parse_max_shard_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ragged.consolidate",
        description="Write a lightning_ragged (or any Lightning/DCP) sharded checkpoint directory as one ordinary .ckpt file, "
        "or (--format hf) as a Hugging Face safetensors directory that from_pretrained loads.",
    )
    parser.add_argument("checkpoint_dir", help="the sharded checkpoint directory")
    parser.add_argument("output_file", help="the .ckpt file (--format hf: the directory) to write (must not exist)")
    parser.add_argument(
        "--format",
        choices=("lightning", "hf"),
        default="lightning",
        help="lightning: one ordinary .ckpt (default); hf: safetensors files + index that transformers' from_pretrained loads",
    )
    parser.add_argument("--config", help="hf: config.json (or its directory) to copy; also names the tied weights and checks names and shapes")
    parser.add_argument("--prefix", default="", help="hf: the name prefix to strip, e.g. 'model.' (the LightningModule attribute holding the model); other keys are left out")
    parser.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, help=f"hf: the largest safetensors file (default {MAX_SHARD_SIZE}), e.g. 500MB")
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
    if args.format == "lightning" and (args.config or args.prefix or args.max_shard_size != MAX_SHARD_SIZE):
        parser.error("--config, --prefix and --max-shard-size are for --format hf")
    try:
        parse_max_shard_size(args.max_shard_size)
    except ValueError as error:
        parser.error(f"--max-shard-size: {error}")
    output = Path(args.output_file)
    if output.exists():
        print(f"error: {output} exists; choose another path or remove it first", file=sys.stderr)
        return 1
    try:
        reading = dict(
            weights_only=True if args.weights_only else None,
            trust_checkpoint=args.trust_checkpoint,
            verify_checksums=not args.no_verify_checksums,
        )
        if args.format == "hf":
            export_hf(args.checkpoint_dir, output, config=args.config, prefix=args.prefix,
                      max_shard_size=args.max_shard_size, **reading)
        else:
            consolidate(args.checkpoint_dir, output, **reading)
    except Exception as error:  # noqa: BLE001 - a CLI: print the clear message, not a traceback
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
