"""``python -m lightning_ragged.consolidate CKPT_DIR OUT.ckpt``: a thin entry; the CLI is ``lightning_ragged.cli.consolidate``."""

import sys

from lightning_ragged.cli.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
