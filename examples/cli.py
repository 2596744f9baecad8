"""LightningCLI entry point for the GPT example.

    python examples/cli.py fit --config examples/config.yaml
    python examples/cli.py fit --config examples/config.yaml --trainer.max_steps=100 \
        --trainer.strategy.init_args.replicate_degree=node --trainer.num_nodes=2

The strategy is chosen in the YAML by class path (``lightning_ragged.RaggedFSDPStrategy``,
with its knobs as ``init_args``) or by name (``strategy: ragged_fsdp``, which needs
``import lightning_ragged``, done by ``train_gpt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

from train_gpt import CharDataModule, GPTLightning  # noqa: E402


def main() -> None:
    # No SaveConfigCallback: with `logger: false` it would write config.yaml into the working directory.
    LightningCLI(GPTLightning, CharDataModule, seed_everything_default=42, save_config_callback=None)


if __name__ == "__main__":
    main()
