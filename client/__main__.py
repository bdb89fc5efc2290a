"""``python -m client``: the same as ``stager-client`` (how srun starts per-node tasks)."""

import sys

from client.cli import main

sys.exit(main())
