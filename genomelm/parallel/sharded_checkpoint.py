"""Sharded training checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shard.

Layout of `runs/<run>/checkpoints/step-0000100/` for a run of more than one process:
- `state/`: the DCP checkpoint. Keys `model.<name>` (every entry of `GlmForCausalLM.state_dict()`, at its global
  shape) and `optimizer.*` (AdamW state by parameter name, `get_optimizer_state_dict`). FSDP2 parameters are
  DTensors already; a rank's own routed experts (expert parallel) are described to DCP as shards of the global
  [E, ...] tensor on the ("ep", "edp") mesh, so a checkpoint saved at one world size, ep or dp loads at another.
- `config.json`: the model's Hugging Face config; `trainer.pt`: step, schedule, data order, run config and
  identity (rank 0); `rng/rank-00000.pt`: each rank's RNG state.
- after the last step, `model/`: the Hugging Face layout (`genomelm export`), which `genomelm eval` reads.

All ranks write into `.tmp-step-0000100`; rank 0 renames it into place once every rank has finished (a barrier),
so a kill -9 at any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from genomelm.model.checkpoint import CONFIG_FILE, hf_config_dict
from genomelm.model.moe import Experts
from genomelm.train import checkpoints

from .mesh import Mesh

STATE_DIR = "state"
RNG_DIR = "rng"


def is_sharded(step_dir: Path) -> bool:
    """Whether a checkpoint folder holds a DCP state (this module's layout)."""
    return (Path(step_dir) / STATE_DIR / ".metadata").exists()


def _expert_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shapes [E, ...] of the expert-parallel parameters, by state-dict name."""
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts) and hasattr(module, "local_experts"):
            for param_name, param in module.named_parameters(recurse=False):
                shapes[f"{name}.{param_name}"] = (module.num_experts, *param.shape[1:])
    return shapes


def _as_global(value: Tensor, shape: tuple[int, ...], mesh: Mesh) -> DTensor:
    """A rank's expert rows (its own experts; FSDP's share of them when sharded) as a DTensor of the global shape
    on the ("ep", "edp") mesh. Shares storage with `value`, so DCP reads into it in place."""
    sharded = isinstance(value, DTensor)
    local = value.to_local() if sharded else value
    placements = [Shard(0), Shard(0) if sharded else Replicate()]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh.expert_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)  # fmt: skip


def _described(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh | None
               ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """(model state, optimizer state, what DCP sees): the last with the expert entries as global DTensors."""
    model_state = get_model_state_dict(model)
    optim_state = get_optimizer_state_dict(model, optimizer)
    shapes = _expert_shapes(model) if mesh is not None else {}
    seen_model = {k: _as_global(v, shapes[k], mesh) if k in shapes else v for k, v in model_state.items()}
    seen_state = {}
    for name, entry in optim_state["state"].items():
        if name in shapes:
            entry = {k: _as_global(v, shapes[name], mesh) if isinstance(v, Tensor) and v.ndim else v
                     for k, v in entry.items()}  # fmt: skip
        seen_state[name] = entry
    seen = {"model": seen_model, "optimizer": {"state": seen_state, "param_groups": optim_state["param_groups"]}}
    return model_state, optim_state, seen


def save_sharded(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 trainer_state: dict[str, Any], mesh: Mesh, keep: int) -> Path:  # fmt: skip
    """Write `step-<step>` from every rank (collective); rank 0 renames it into place and prunes to `keep`."""
    root = checkpoints.checkpoint_dir(run_dir)
    final = root / f"{checkpoints.STEP_PREFIX}{step:07d}"
    tmp = root / f"{checkpoints.TMP_PREFIX}{checkpoints.STEP_PREFIX}{step:07d}"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / RNG_DIR).mkdir(parents=True)
    dist.barrier()
    _, _, seen = _described(model, optimizer, mesh)
    dcp.save(seen, checkpoint_id=tmp / STATE_DIR)
    torch.save(checkpoints.rng_state(), tmp / RNG_DIR / f"rank-{rank:05d}.pt")
    if rank == 0:
        config = model.config
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config_dict(config, torch.float32), indent=2) + "\n")
        torch.save(trainer_state | {"world": mesh.dims.__dict__}, tmp / "trainer.pt")
    dist.barrier()  # every rank's files are written
    if rank == 0:
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        if final.exists():  # a re-run of the same step after a resume: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in checkpoints.complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_sharded(step_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh | None) -> None:
    """Fill model and optimizer (already split over this run's mesh, or one process: mesh None) from a sharded
    checkpoint saved at any world size, and restore this rank's RNG (rank 0's for a rank the save did not have)."""
    step_dir = Path(step_dir)
    model_state, optim_state, seen = _described(model, optimizer, mesh)
    # a fresh optimizer's template has state for every parameter; the saved one only for those that ever had a
    # gradient (e.g. the indexer's when it is not trained): those keep their fresh state (AdamW skips them)
    saved = dcp.FileSystemReader(step_dir / STATE_DIR).read_metadata().state_dict_metadata
    seen["optimizer"]["state"] = {
        name: entry for name, entry in seen["optimizer"]["state"].items()
        if all(f"optimizer.state.{name}.{key}" in saved for key in entry)
    }  # fmt: skip
    dcp.load(seen, checkpoint_id=step_dir / STATE_DIR, no_dist=mesh is None)
    shapes = _expert_shapes(model) if mesh is not None else {}
    for name in shapes:  # the global views alias the local rows; copy in case a view was not in place
        _local(model_state[name]).copy_(seen["model"][name].to_local())
        for key, value in optim_state["state"].get(name, {}).items():
            if isinstance(value, Tensor) and value.ndim:
                _local(value).copy_(seen["optimizer"]["state"][name][key].to_local())
    for name, value in seen["model"].items():
        if name not in shapes:
            model_state[name] = value
    for name, entry in seen["optimizer"]["state"].items():
        if name not in shapes:
            optim_state["state"][name] = entry
    set_model_state_dict(model, model_state)
    set_optimizer_state_dict(model, optimizer, optim_state)
    rank = dist.get_rank() if mesh is not None else 0
    rng = step_dir / RNG_DIR / f"rank-{rank:05d}.pt"
    if not rng.exists():
        rng = step_dir / RNG_DIR / "rank-00000.pt"
    checkpoints.set_rng_state(torch.load(rng, weights_only=False))


def _local(value: Tensor) -> Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
