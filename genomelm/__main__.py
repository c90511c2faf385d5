"""`python -m genomelm <stage> ...`: the same as the `genomelm` command (what `torchrun -m` and cluster
templates start)."""

import sys

from genomelm.cli import main

sys.exit(main())
