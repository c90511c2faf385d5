"""The checkpoints of a training run: `Checkpointer(run_dir)` owns the folder `runs/<run>/checkpoints/`.

    checkpoints/
      step-0000100/                a checkpoint, complete or not (`steps`; the complete ones: `complete`)
      step-0000200/                the newest complete one (`latest`); `save` prunes to the newest `keep`
      .tmp-step-0000300[-<pid>]/   a write in progress, or one a kill left behind (`clean_interrupted_writes`)
      step-0000300.damaged/        a checkpoint a resume found damaged and set aside (`latest_verified`)
      .holds/step-0000200.<host>.<pid>   a reader's hold: pruning leaves that checkpoint (`checkpoint_holds`)

A step folder holds one of two layouts (`save` and `load` take either):
- one process (`save` without a mesh): `model/`, the model in Hugging Face layout (`genomelm.model.load_model`
  and transformers read it), and `trainer.pt`: the caller's trainer state (step, data order, run config,
  identity, ...) plus the optimizer state and the RNG state;
- sharded, a run of more than one process (`save` with the run's mesh, collective): `state/`, a
  torch.distributed.checkpoint (DCP) with keys `model.<name>` (every entry of `GlmForCausalLM.state_dict()`,
  at its global shape) and `optimizer.*` (AdamW state by parameter name, `get_optimizer_state_dict`). FSDP2
  parameters are DTensors already; a rank's own routed experts (expert parallel) are described to DCP as
  rows of the global [E, ...] tensor in expert order (`expert_rows`), so a checkpoint saved at one world
  size, ep, dp or placement of the experts loads at another. Beside it `config.json` (the model's Hugging
  Face config), `trainer.pt` (rank 0: the trainer state plus the mesh dims as "world") and
  `rng/rank-00000.pt` (each rank's RNG state and, for an optimizer with quantised moments, those moments as
  the rank keeps them: `exact_moments`); `genomelm eval` reads the model from `state/`
  (`load_sharded_model`), and after the last step the run may add `model/`, the Hugging Face layout
  (`genomelm.parallel.export`, setting `export_final`).
A step folder is complete when it holds `trainer.pt` and `model/config.json` or `state/.metadata`.

A reader of a live run (`genomelm eval` while the run trains) holds the checkpoint it reads, which `prune`
leaves until the hold is gone (`genomelm.parallel.checkpoint_holds`).

Every write goes to a temporary `.tmp-step-*` folder (one process: suffixed with its pid; sharded: one name,
which every rank writes into), whose files are fsynced before it is renamed into place, so a kill -9 at any
moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from genomelm.data.errors import space_checked
from genomelm.model.checkpoint import CONFIG_FILE, hf_config_dict, save_model

from .checkpoint_holds import held
from .expert import ExpertShard, expert_shard
from .expert_rows import ExpertRows, expert_rows, placed_experts
from .mesh import Mesh

CHECKPOINTS_DIR = "checkpoints"  # in the run folder
STEP_PREFIX = "step-"  # step-0000100: the checkpoint after optimizer step 100
TMP_PREFIX = ".tmp-"  # a write in progress
DAMAGED_SUFFIX = ".damaged"  # step-0000200.damaged: a checkpoint whose files failed their checksums
MODEL_DIR = "model"  # the Hugging Face layout
TRAINER_FILE = "trainer.pt"
STATE_DIR = "state"  # the DCP checkpoint of a sharded run
METADATA_FILE = ".metadata"  # written by dcp.save once every rank has written its shard
RNG_DIR = "rng"  # rank-00000.pt, ... of a sharded run
CHECKSUMS_DIR = "checksums"  # rank-00000.json, ...: size and xxh3-128 of every file each writer wrote
READ_BYTES = 8 << 20  # the hash is fed in pieces of this size
SPACE_ADVICE = (
    "the run's newest checkpoint, if any, is intact: free space or lower keep_checkpoints, and resume"
)


class DamagedCheckpoints(ValueError):
    """Every checkpoint of a run is damaged; the message names the files and the choices."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


def _listed(damaged: list[tuple[Path, list[str]]], most: int = 6) -> str:
    """The damaged checkpoints' problems, the first `most` of them."""
    problems = [problem for _, found in damaged for problem in found]
    more = f" and {len(problems) - most} more" if len(problems) > most else ""
    return "; ".join(problems[:most]) + more


def _free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... when it exists."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


@contextmanager
def dcp_failures() -> Iterator[None]:
    """torch.distributed.checkpoint reports failures as a CheckpointException, a BaseException (past every
    `except Exception`) holding each rank's error: raised here as the lowest rank's own exception (a full
    disk's OSError stays one), with a note naming the ranks that failed."""
    try:
        yield
    except CheckpointException as exc:
        rank = min(exc.failures)
        first = exc.failures[rank][0]
        if not isinstance(first, Exception):
            raise RuntimeError(str(exc)) from exc
        first.add_note(f"torch.distributed.checkpoint failed on ranks {sorted(exc.failures)}")
        raise first from exc


def _collective_device() -> torch.device:
    """Where this process group's collectives take tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What this process holds of the model and the optimizer state, in bytes (a checkpoint's share)."""
    tensors = [*model.state_dict().values()]
    tensors += [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, Tensor)]
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def file_checksum(path: Path) -> dict[str, Any]:
    """{"size": bytes, "xxh3_128": hex digest} of a file (xxhash, as the data stage's checks: ~20x BLAKE2b, so
    the check runs at the speed the file is read)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while piece := handle.read(READ_BYTES):
            digest.update(piece)
    return {"size": Path(path).stat().st_size, "xxh3_128": digest.hexdigest()}


def write_checksums(step_dir: Path, files: list[Path], name: str) -> None:
    """Record the checksums of `files` (inside `step_dir`) as `checksums/<name>.json`, written atomically."""
    folder = Path(step_dir) / CHECKSUMS_DIR
    folder.mkdir(exist_ok=True)
    entries = {str(p.relative_to(step_dir)): file_checksum(p) for p in sorted(files)}
    tmp = folder / f".{name}.json.tmp"
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(tmp, folder / f"{name}.json")


def recorded_checksums(step_dir: Path) -> dict[str, dict[str, Any]] | None:
    """Every file's recorded checksum, by path inside `step_dir`; None for a checkpoint written without
    them."""
    folder = Path(step_dir) / CHECKSUMS_DIR
    if not folder.is_dir():
        return None
    entries: dict[str, dict[str, Any]] = {}
    for part in sorted(folder.glob("*.json")):
        try:
            entries |= json.loads(part.read_text())
        except (OSError, ValueError):
            entries[str(part.relative_to(step_dir))] = {"unreadable": True}
    return entries


def verify_checkpoint(
    step_dir: Path, share: tuple[int, int] = (0, 1), prefix: str = "", skip: str | None = None
) -> list[str]:
    """What is wrong with the files of a checkpoint against their recorded checksums (empty: nothing), each
    naming the file; `share` (i, n): only every n-th file from the i-th (the ranks split the reading);
    `prefix`: only the files under it (e.g. "model/"); `skip`: not those under it."""
    recorded = recorded_checksums(step_dir)
    if recorded is None:
        return []
    names = sorted(
        name for name in recorded if name.startswith(prefix) and not (skip and name.startswith(skip))
    )
    problems = []
    for name in names[share[0] :: share[1]]:
        path, expected = Path(step_dir) / name, recorded[name]
        if expected.get("unreadable"):
            problems.append(f"{path}: unreadable checksum record")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{path}: {path.stat().st_size:,} bytes, {expected['size']:,} written")
        elif file_checksum(path)["xxh3_128"] != expected.get("xxh3_128"):
            problems.append(f"{path}: its bytes differ from those written (xxh3-128 mismatch)")
    return problems


def is_sharded(step_dir: Path) -> bool:
    """Whether a step folder holds a complete DCP state (the sharded layout)."""
    return (Path(step_dir) / STATE_DIR / METADATA_FILE).exists()


def step_of(path: Path) -> int | None:
    """The step of a `step-<digits>` folder name; None for any other name."""
    digits = Path(path).name[len(STEP_PREFIX) :]
    return int(digits) if Path(path).name.startswith(STEP_PREFIX) and digits.isdigit() else None


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy, Python (and CUDA, when there is one) random states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def exact_moments(
    optimizer: torch.optim.Optimizer, world: dict[str, int], held: dict[int, list[int]] | None = None
) -> dict[str, Any]:
    """{"exact_moments": ...} for an optimizer whose state dict does not give its quantised moments back
    exactly (`genomelm.train.lowbit.LowBitAdamW.exact_state`), with the layout it holds them for (`world`:
    the mesh dims, {} in one process; `held`: the experts of each placed expert parameter, by position);
    {} for any other."""
    exact = getattr(optimizer, "exact_state", None)
    return (
        {"exact_moments": {"world": world, "held": held or {}, "state": exact()}} if exact is not None else {}
    )


def load_exact_moments(
    optimizer: torch.optim.Optimizer,
    saved: dict[str, Any],
    world: dict[str, int],
    held: dict[int, list[int]] | None = None,
) -> None:
    """After the optimizer's state dict is loaded: put back the `exact_moments` that `saved` holds for these
    mesh dims, of every parameter whose rows hold the same experts as then (another layout, or a parameter
    whose experts moved, keeps the state dict's requantised moments)."""
    exact = saved.get("exact_moments")
    if exact is None or exact["world"] != world or not hasattr(optimizer, "load_exact_state"):
        return
    then, now = exact.get("held", {}), held or {}
    optimizer.load_exact_state({i: e for i, e in exact["state"].items() if then.get(i) == now.get(i)})


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (the CUDA states only where there are GPUs)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """The checkpoints of the run in `run_dir` (see the module docstring). `save` and `load` take either
    layout: the sharded one under a mesh, the one-process one without."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR

    # ------------------------------------------------------------------------------------------- the folder
    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step:07d}"

    def steps(self) -> list[Path]:
        """Every `step-<digits>` folder, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and step_of(p) is not None]
        return sorted(found, key=step_of)

    def complete(self) -> list[Path]:
        """The complete checkpoints of either layout, oldest first."""
        return [p for p in self.steps() if self._is_complete(p)]

    @staticmethod
    def _is_complete(step_dir: Path) -> bool:
        return (step_dir / TRAINER_FILE).exists() and (
            (step_dir / MODEL_DIR / CONFIG_FILE).exists() or is_sharded(step_dir)
        )

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.complete()
        return found[-1] if found else None

    def latest_verified(
        self,
        share: tuple[int, int] = (0, 1),
        gather: Callable[[list[str]], list[str]] | None = None,
        set_aside: bool = False,
    ) -> Path | None:
        """The newest checkpoint whose files all match their checksums, or None when the run has none. A
        damaged one (changed, missing or truncated files; a step folder without its trainer state or model) is
        skipped for the one before it with a warning naming the files, and with `set_aside` (one rank only)
        renamed `step-N.damaged` once the choice is made, so it never sorts newest again. `DamagedCheckpoints`
        when every one is damaged: continuing would start the run over on top of its history.

        `share`: this rank's part of the files to read; `gather`: joins the ranks' problem lists (every rank
        then makes the same choice)."""
        damaged: list[tuple[Path, list[str]]] = []
        chosen = None
        for step_dir in reversed(self.steps()):
            # a sharded checkpoint's Hugging Face copy is optional (a missing one is written again at the end)
            skip = f"{MODEL_DIR}/" if is_sharded(step_dir) else None
            problems = verify_checkpoint(step_dir, share, skip=skip) if self._is_complete(step_dir) else []
            if not self._is_complete(step_dir) and share[0] == 0:
                problems = [f"{step_dir}: incomplete (no {TRAINER_FILE}, or no model/state in it)"]
            problems = gather(problems) if gather is not None else problems
            if not problems:
                chosen = step_dir
                break
            damaged.append((step_dir, problems))
        if damaged and chosen is None:
            raise DamagedCheckpoints(
                f"every checkpoint of {self.run_dir} is damaged, so resume=auto would start the run over on "
                f"top of its history: {_listed(damaged)}. Restore those files (from a backup or the "
                "storage's snapshots) and run again, or start a new run beside it: resume=never "
                "run=<new name>"
            )
        for step_dir, problems in damaged:
            if share[0] == 0:  # every rank found the same (`gather`): one says it
                warnings.warn(
                    f"{step_dir} is damaged, falling back to the checkpoint before it"
                    + (f" (set aside as {step_dir.name}{DAMAGED_SUFFIX})" if set_aside else "")
                    + f": {'; '.join(problems)}",
                    stacklevel=2,
                )
            if set_aside:
                os.rename(step_dir, _free_name(step_dir.with_name(step_dir.name + DAMAGED_SUFFIX)))
        return chosen

    def latest_bytes(self) -> int:
        """The bytes of the newest complete checkpoint (0 without one; a sharded one less its optional Hugging
        Face copy): about what the next one needs, headers and trainer state included."""
        latest = self.latest()
        if latest is None:
            return 0
        copy = latest / MODEL_DIR if is_sharded(latest) else None
        files = [p for p in latest.rglob("*") if p.is_file() and (copy is None or copy not in p.parents)]
        return sum(p.stat().st_size for p in files)

    def clean_interrupted_writes(self) -> list[Path]:
        """Remove the temporary folders of writes a kill interrupted; returns what was removed. Call it on one
        process, before any save."""
        found = self.root.glob(f"{TMP_PREFIX}*") if self.root.is_dir() else []
        removed = [path for path in found if path.is_dir()]  # a file of such a name is not ours: `blocked`
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def blocked(self, after: int, last: int) -> list[tuple[Path, str]]:
        """What stands where a run at step `after` would write its checkpoints up to step `last` (any step in
        between: a stop saves the step it stopped after), as (path, what it blocks): `checkpoints` itself, a
        `step-N` or a `.tmp-` name that is not a folder (a kill leaves folders, which are replaced or
        removed; nothing here writes a file of those names)."""
        if self.root.exists() and not self.root.is_dir():
            return [(self.root, "the checkpoints folder")]
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.iterdir()):
            step = step_of(path)
            try:
                if stat.S_ISDIR(path.stat().st_mode):
                    continue
            except FileNotFoundError:  # gone since the listing (another rank set a damaged one aside)
                continue
            if step is not None and after < step <= last:
                found.append((path, f"the checkpoint of step {step}"))
            elif path.name.startswith(TMP_PREFIX):
                found.append((path, "a checkpoint's temporary folder"))
        return found

    def prune(self, keep: int) -> list[Path]:
        """Remove all but the newest `keep` complete checkpoints (none with keep 0), leaving those a reader
        holds (`genomelm.parallel.checkpoint_holds`); returns what it removed. Each is renamed aside first and
        its holds looked at again: a reader holds before it looks the checkpoint up, so one sees the other."""
        removed = []
        for path in self.complete()[:-keep] if keep > 0 else []:
            if held(path):
                continue
            aside = path.with_name(f"{TMP_PREFIX}pruned-{path.name}")
            os.rename(path, aside)
            if held(path):
                os.rename(aside, path)
                continue
            shutil.rmtree(aside, ignore_errors=True)
            removed.append(path)
        return removed

    def _publish(self, tmp: Path, final: Path, keep: int) -> None:
        """fsync every file of `tmp`, rename it to `final` (replacing a checkpoint of the same step: a step
        run again after a resume), prune to `keep`."""
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        self.prune(keep)

    # ---------------------------------------------------------------------------------- either layout
    is_sharded = staticmethod(is_sharded)

    @staticmethod
    def read_trainer_state(step_dir: Path) -> dict[str, Any]:
        """The `trainer.pt` of a step folder of either layout."""
        return torch.load(Path(step_dir) / TRAINER_FILE, weights_only=False)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        mesh: Mesh | None = None,
        keep: int = 0,
    ) -> Path:
        """Write `step-<step>` atomically and prune to the newest `keep` complete checkpoints (0: all);
        returns the step folder. With a `mesh`, the sharded layout (collective: every rank calls it); without,
        the one-process layout (that one process calls it)."""
        if mesh is not None:
            return self.save_sharded(step, model, optimizer, trainer_state, mesh, keep)
        return self.save_one_process(step, model, optimizer, trainer_state, keep)

    def load(
        self,
        step_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        mesh: Mesh | None = None,
    ) -> None:
        """Continue from the checkpoint `step_dir` (`trainer_state`: its `read_trainer_state`): a sharded one
        fills model and optimizer and this rank's RNG (`load_sharded`; mesh None in one process); a
        one-process one the optimizer and the RNG, its model being the one read from `step_dir / "model"`."""
        if is_sharded(step_dir):
            self.load_sharded(step_dir, model, optimizer, mesh)
        else:
            optimizer.load_state_dict(trainer_state["optimizer"])
            load_exact_moments(optimizer, trainer_state, {})
            set_rng_state(trainer_state["rng"])

    # ------------------------------------------------------------------------------------- one process
    def save_one_process(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        keep: int = 0,
    ) -> Path:
        """The one-process layout: the model, and `trainer_state` plus the optimizer state ("optimizer") and
        this process's RNG state ("rng")."""
        state = trainer_state | {"optimizer": optimizer.state_dict(), "rng": rng_state()}
        state |= exact_moments(optimizer, {})
        return self._write_one_process(step, model, state, keep, state_bytes(model, optimizer))

    def _write_one_process(
        self, step: int, model: nn.Module, state: dict[str, Any], keep: int, needed: int
    ) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.step_dir(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        needed = max(needed, self.latest_bytes())
        with space_checked(tmp, needed, "the checkpoint", SPACE_ADVICE, remove=tmp):
            save_model(model, tmp / MODEL_DIR)
            torch.save(state, tmp / TRAINER_FILE)
            write_checksums(tmp, [p for p in tmp.rglob("*") if p.is_file()], "rank-00000")
        self._publish(tmp, final, keep)
        return final

    # ------------------------------------------------------------------------------------------ sharded
    def save_sharded(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        mesh: Mesh,
        keep: int = 0,
    ) -> Path:
        """The sharded layout, from every rank (collective: all must call it); rank 0 renames it into place
        once every rank has written its files."""
        final = self.step_dir(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / RNG_DIR).mkdir(parents=True)
        needed = torch.tensor([state_bytes(model, optimizer)], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(needed)  # the whole checkpoint, for the message of a full disk
        dist.barrier()
        _, _, seen = _described(model, optimizer, mesh)
        # on every rank (each removes what it can of the temporary folder: all fail together under DCP)
        needed = max(int(needed.item()), self.latest_bytes())
        with space_checked(tmp, needed, "the checkpoint", SPACE_ADVICE, remove=tmp):
            with dcp_failures():
                dcp.save(seen, checkpoint_id=tmp / STATE_DIR)
            mine = [tmp / RNG_DIR / f"rank-{rank:05d}.pt", *(tmp / STATE_DIR).glob(f"__{rank}_*.distcp")]
            held = placed_experts(model, optimizer)
            torch.save(rng_state() | exact_moments(optimizer, mesh.dims.__dict__, held), mine[0])
            if rank == 0:
                config = hf_config_dict(model.config, torch.float32)
                (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
                torch.save(trainer_state | {"world": mesh.dims.__dict__}, tmp / TRAINER_FILE)
                mine += [tmp / CONFIG_FILE, tmp / TRAINER_FILE, tmp / STATE_DIR / METADATA_FILE]
            write_checksums(tmp, mine, f"rank-{rank:05d}")  # each rank hashes what it wrote
        dist.barrier()  # every rank's files are written
        if rank == 0:
            self._publish(tmp, final, keep)
        dist.barrier()
        return final

    @staticmethod
    def load_sharded(
        step_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh | None
    ) -> None:
        """Fill model and optimizer (already split over this run's mesh, or one process: mesh None) from a
        sharded checkpoint saved at any world size, and restore this rank's RNG (rank 0's for a rank the save
        did not have)."""
        step_dir = Path(step_dir)
        model_state, optim_state, seen = _described(model, optimizer, mesh)
        # a fresh optimizer's template has state for every parameter; the saved one only for those that ever
        # had a gradient (e.g. the indexer's when it is not trained): those keep their fresh state (AdamW
        # skips them)
        saved = dcp.FileSystemReader(step_dir / STATE_DIR).read_metadata().state_dict_metadata
        seen["optimizer"]["state"] = {
            name: entry
            for name, entry in seen["optimizer"]["state"].items()
            if all(f"optimizer.state.{name}.{key}" in saved for key in entry)
        }
        with dcp_failures():
            dcp.load(seen, checkpoint_id=step_dir / STATE_DIR, no_dist=mesh is None)
        layouts = _expert_layouts(model) if mesh is not None else {}
        for name, value in seen["model"].items():  # the expert views read into the local rows in place
            if name not in layouts:
                model_state[name] = value
        for name, entry in seen["optimizer"]["state"].items():
            if name not in layouts:
                optim_state["state"][name] = entry
        set_model_state_dict(model, model_state)
        set_optimizer_state_dict(model, optimizer, optim_state)
        rank = dist.get_rank() if mesh is not None else 0
        rng = step_dir / RNG_DIR / f"rank-{rank:05d}.pt"
        if not rng.exists():
            rng = step_dir / RNG_DIR / "rank-00000.pt"
        own = torch.load(rng, weights_only=False)
        set_rng_state(own)
        if mesh is not None:
            load_exact_moments(optimizer, own, mesh.dims.__dict__, placed_experts(model, optimizer))


# --------------------------------------------------------------------------- DCP's view of a sharded model
def _expert_layouts(model: nn.Module) -> dict[str, ExpertShard]:
    """The expert-parallel parameters' shards (which expert each slot holds), by state-dict name."""
    layouts = {}
    for name, module in model.named_modules():
        shard = expert_shard(module)
        if shard is not None:
            for param_name, _ in module.named_parameters(recurse=False):
                layouts[f"{name}.{param_name}"] = shard
    return layouts


def _as_global(value: Tensor, shard: ExpertShard) -> ExpertRows:
    """A rank's expert rows (the experts it owns; FSDP's share of them when sharded) as rows of the global
    [E, ...] tensor in expert order. Shares storage with `value`, so DCP reads into it in place."""
    return expert_rows(value, shard.owned_experts, shard.num_experts)


def _model_view(
    model: nn.Module, mesh: Mesh | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, ExpertShard]]:
    """(model state, what DCP sees of it, the expert layouts): the expert entries seen in expert order."""
    model_state = get_model_state_dict(model)
    layouts = _expert_layouts(model) if mesh is not None else {}
    seen = {k: _as_global(v, layouts[k]) if k in layouts else v for k, v in model_state.items()}
    return model_state, seen, layouts


def _described(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state, what DCP sees): the last with the expert entries in expert order."""
    model_state, seen_model, layouts = _model_view(model, mesh)
    optim_state = get_optimizer_state_dict(model, optimizer)
    seen_state = {}
    for name, entry in optim_state["state"].items():
        if name in layouts:
            entry = {
                k: _as_global(v, layouts[name]) if isinstance(v, Tensor) and v.ndim else v
                for k, v in entry.items()
            }
        seen_state[name] = entry
    seen_optim = {"state": seen_state, "param_groups": optim_state["param_groups"]}
    seen = {"model": seen_model, "optimizer": seen_optim}
    return model_state, optim_state, seen


def load_sharded_model(step_dir: Path, model: nn.Module, mesh: Mesh | None) -> None:
    """Fill `model` (split over this run's mesh, or whole in one process: mesh None) with the weights of the
    sharded checkpoint `step_dir`, saved at any world size; the optimizer state is not read. Each rank reads
    only its shard (DCP reads the blocks a rank's DTensors hold), cast to the model's dtypes as read."""
    model_state, seen, layouts = _model_view(model, mesh)
    with warnings.catch_warnings():  # one process reading a checkpoint many wrote is what `mesh=None` asks
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        with dcp_failures():
            dcp.load({"model": seen}, checkpoint_id=Path(step_dir) / STATE_DIR, no_dist=mesh is None)
    for name, value in seen.items():
        if name not in layouts:  # the expert views read into the local rows in place
            model_state[name] = value
    set_model_state_dict(model, model_state)


def _local(value: Tensor) -> Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
