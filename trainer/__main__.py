"""``python -m trainer`` == ``stager-train`` (what torchrun and srun launch)."""

from __future__ import annotations

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
