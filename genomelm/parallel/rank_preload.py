"""Imported by the local launcher's forkserver after torch (`multiprocessing.set_forkserver_preload`), and
nowhere else: what training and scoring ranks import next, loaded once so that each rank forks with it (on
2 CPU cores, about 1.4 s of CPU less per rank than importing it in every rank). None of it starts a thread.
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401 - the model's compiled and dynamo-disabled paths
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
