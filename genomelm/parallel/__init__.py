"""Running one model over many processes: between `genomelm.model` (which never communicates) and the run
core `genomelm.run`. This package imports `genomelm.model` and `genomelm.data`, never a package above it
(`tests/test_layering.py` checks it).

Context parallelism for the KDA and DSA layers:
- `layout`: how a window is split over the ranks (`ContextLayout`: zigzag or contiguous, shard / restore,
  labels made over the whole window before sharding, global positions);
- `exchange`: the autograd-aware collectives (KDA: conv halo, segment-summary hand-over; DSA: the keys of the
  whole window, `gather_window`);
- `context`: `apply_context_parallel(model, group, kind)`, the CP forward of each KDA and DSA attention
  module;
- `launch`: `launch(fn, world_size, ...)`, N local ranks (gloo on CPU, NCCL on CUDA) with failures and hangs
  turned into errors in the parent (the Ray launcher, and the choice between them, live in the run core:
  `genomelm.run.launchers`).
The mesh and the rest of the split:
- `mesh`: `ParallelDims(dp, cp, ep)` and the process groups / device meshes of a run (`Mesh`);
- `expert`: `apply_expert_parallel(model, group)`, each rank's share of the routed experts (`ExpertShard`,
  `is_expert_parallel`) and the all-to-all token dispatch; `placement`: where the experts live, by load
  (`expert_slots`: the tables the exchange reads, `expert_rows`: the experts in expert order for DCP);
- `training`: what a step moves (`ContextRun`, `ParallelRun`: FSDP2 sharding, gradient sums, clipping);
- `checkpoint`: `Checkpointer`, the checkpoint folders of a run (listing, atomic writes, pruning; the
  one-process layout and the sharded DCP layout, RNG state); `export`: `genomelm export` to the Hugging Face
  layout; `rank_loading`: each rank's share of a Hugging Face checkpoint.
The model's math (a KDA segment's summary, DSA's `project` / `attend` seams) lives in `genomelm.model`; only
this package communicates.
"""

from .context import (
    ContextParallel,
    apply_context_parallel,
    dsa_context_parallel_forward,
    kda_context_parallel_forward,
    remove_context_parallel,
)
from .launch import LaunchError, LaunchTimeout, is_output_rank, launch
from .layout import CONTIGUOUS, ZIGZAG, ContextLayout, LayoutError, LocalWindow, next_token_labels

__all__ = [
    "CONTIGUOUS",
    "ZIGZAG",
    "ContextLayout",
    "ContextParallel",
    "LaunchError",
    "LaunchTimeout",
    "LayoutError",
    "LocalWindow",
    "apply_context_parallel",
    "dsa_context_parallel_forward",
    "is_output_rank",
    "kda_context_parallel_forward",
    "launch",
    "next_token_labels",
    "remove_context_parallel",
]
