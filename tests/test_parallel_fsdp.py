"""FSDP2 over the mesh (gloo, 2 and 4 local processes, tiny model, real fly DNA): each layer's routed experts
are all-gathered once per pass and reduce-scattered once per step however many MoE chunks run, and the
gradients stay one process's; under bf16 FSDP the parameters the model declares fp32 reach the forward in fp32
with their exact values, as in one process under bf16 autocast."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_parallel_expert import EXPERT_PARAMS, fly_rows
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.parallel import launch

TIMEOUT_S = 240
LENGTH = 256  # tokens per rank (one window each)
CHUNK_TOKENS = 64  # 4 MoE chunks per layer and pass
MOE_LAYERS = 3  # tiny: layers 1-3
LAYERS = 4
COLLECTIVES = {  # c10d ops (as `genomelm.plan.recording.OpCounter` sees them) -> kind
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
}


class Collectives(TorchDispatchMode):
    """Counts the all-gathers and reduce-scatters dispatched, by (group label, pass, kind); pass is "forward"
    or "backward" (a recompute runs inside the backward). Groups not in `labels` count under their name."""

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__()
        self.labels = labels
        self.counts: dict[tuple[str, str, str], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = COLLECTIVES.get(func._opname) if func.namespace == "c10d" else None
        if kind is not None:
            (group,) = [
                dist.ProcessGroup.unbox(leaf).group_name
                for leaf in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(leaf, torch.ScriptObject) and "ProcessGroup" in str(leaf)
            ]
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            key = (self.labels.get(group, group), phase, kind)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


def build() -> GlmForCausalLM:
    """The tiny preset, seeded (the same on every rank), MoE chunks of CHUNK_TOKENS."""
    from genomelm.model import load_model

    torch.manual_seed(0)
    return load_model("tiny", options=RunOptions(moe_chunk_tokens=CHUNK_TOKENS))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole over its mesh (collective); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def fsdp_steps(dp: int, ep: int) -> list[dict[str, Any]]:
    """This rank's window (window = rank) through the trainer's FSDP model at dp x ep, forward and backward,
    once without and once with per-layer recompute: the loss, the whole gradients (this rank's experts) and
    the collectives by (group, pass, kind) of each."""
    from genomelm.parallel.mesh import ParallelDims
    from genomelm.parallel.training import ParallelRun
    from genomelm.train.memory import LayerRunner
    from genomelm.train.step import window_loss

    model = build()
    run = ParallelRun.from_environment(ParallelDims(dp=dp, ep=ep), "zigzag", True, "cpu")
    run.prepare(model, None, capacity_factor=8.0)
    labels = {
        run.mesh.world_mesh.get_group().group_name: "world",
        run.mesh.edp_mesh.get_group().group_name: "edp",
        run.mesh.ep_group.group_name: "ep",
    }
    rows = fly_rows(LENGTH, dist.get_rank())
    steps = []
    for recompute in (False, True):
        counter = Collectives(labels)
        with counter:
            loss, _ = window_loss(model, rows, LayerRunner(recompute, False), None)
            loss.backward()
        grads = {n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        steps.append({"loss": float(loss.detach()), "grads": grads, "counts": counter.counts})
    return steps


def one_process(windows: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the whole model on windows 0..windows-1 in turn, gradients summed over them."""
    from genomelm.train.step import window_loss

    model = build()
    losses = []
    for window in range(windows):
        loss, _ = window_loss(model, fly_rows(LENGTH, window), None, None)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_experts_gathered_once_per_layer_and_pass() -> None:
    """dp=4 x ep=2 (each EDP group: 2 ranks holding the same 4 experts), 4 MoE chunks per layer: per MoE
    layer one all-gather of its experts over the EDP group in the forward, one in the backward (recompute
    included) and one reduce-scatter; every other layer's parameters as before, one of each per layer (plus
    the root's). The loss and every gradient equal one process's."""
    dp, ep = 4, 2
    losses, reference = one_process(dp)
    results = launch(fsdp_steps, dp, dp, ep, timeout_s=TIMEOUT_S)
    once = {
        ("edp", "forward", "all_gather"): MOE_LAYERS,
        ("edp", "backward", "all_gather"): MOE_LAYERS,
        ("edp", "backward", "reduce_scatter"): MOE_LAYERS,
        ("world", "forward", "all_gather"): LAYERS + 1,  # + the root (embedding, norm, head)
        ("world", "backward", "all_gather"): LAYERS,  # the root stays gathered for the backward
        ("world", "backward", "reduce_scatter"): LAYERS + 1,
    }
    for rank, steps in enumerate(results):
        for recompute, step in zip((False, True), steps, strict=True):
            counts = {key: n for key, n in step["counts"].items() if key[0] in ("edp", "world")}
            assert counts == once, f"rank {rank}, recompute={recompute}: {counts}"
            assert step["loss"] == pytest.approx(losses[rank], rel=1e-5)
            assert step["grads"].keys() == reference.keys()
            for name, ref in reference.items():
                if name.endswith(EXPERT_PARAMS):  # rank r holds experts of EP rank r % ep
                    held = ref.shape[0] // ep
                    ref = ref[rank % ep * held : (rank % ep + 1) * held]
                scale = float(ref.abs().max())
                torch.testing.assert_close(step["grads"][name], ref, rtol=1e-5, atol=1e-5 * scale, msg=name)


def fp32_declared(config: ModelConfig) -> list[str]:
    """The parameters the model declares fp32: those a bf16 build keeps in fp32 (built on the meta device)."""
    model = GlmForCausalLM.from_config(config, dtype=torch.bfloat16, device="meta")
    return [name for name, param in model.named_parameters() if param.dtype == torch.float32]


class FirstReads(TorchDispatchMode):
    """The dtype and value of each watched parameter as the forward's first op on it reads it. What is
    watched: the tensors registered under the watched names as each decoder layer (and the root) starts its
    forward, i.e. after FSDP's pre-forward hook has registered the gathered parameters."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names
        self.watched: dict[int, tuple[str, torch.Tensor]] = {}  # the tensors are held: no id is reused
        self.reads: dict[str, tuple[torch.dtype, torch.Tensor]] = {}
        for module in [model, *model.layers]:
            module.register_forward_pre_hook(self.watch)

    def watch(self, _module: nn.Module, _args: Any) -> None:
        for name in self.names:
            tensor = self.model.get_parameter(name)
            self.watched[id(tensor)] = (name, tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch._C._current_graph_task_id() == -1:  # the forward only
            for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
                name, _ = self.watched.get(id(leaf), (None, None))
                if name is not None and name not in self.reads:
                    self.reads[name] = (leaf.dtype, leaf.detach().clone())
        return func(*args, **kwargs)


def bf16_reads(names: list[str], parallel: bool) -> dict[str, Any]:
    """One bf16-autocast forward and backward of window `rank` (0 in one process): the first reads of `names`,
    the loss and the dtypes of their gradients. `parallel`: at dp=2 x ep=2 under FSDP with bf16 parameters
    (fp32 reduction), as `genomelm train precision=bf16` runs it; the collectives by group are counted too."""
    from genomelm.train.step import window_loss

    model = build()
    labels = {}
    rank = 0
    if parallel:
        from genomelm.parallel.mesh import ParallelDims
        from genomelm.parallel.training import ParallelRun

        run = ParallelRun.from_environment(ParallelDims(dp=2, ep=2), "zigzag", True, "cpu")
        run.prepare(model, torch.bfloat16, capacity_factor=8.0)
        labels = {run.mesh.world_mesh.get_group().group_name: "world", run.mesh.ep_group.group_name: "ep"}
        rank = run.rank
    reads, counter = FirstReads(model, names), Collectives(labels)
    with reads, counter, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = window_loss(model, fly_rows(LENGTH, rank), None, None)
    with counter:
        loss.backward()
    grad_dtypes = {name: model.get_parameter(name).grad.dtype for name in names}
    loss = float(loss.detach())
    return {"reads": reads.reads, "loss": loss, "grad_dtypes": grad_dtypes, "counts": counter.counts}


def test_bf16_fsdp_keeps_the_fp32_parameters_fp32() -> None:
    """Every parameter the model declares fp32 (router, KDA conv / A_log / dt_bias, mHC base / scale) is read
    by the forward under bf16 FSDP in the dtype and with the value it has in one process under bf16 autocast
    (fp32, the master weight itself), and its gradient is fp32. Cost: one all-gather more per layer and pass
    (the fp32 parameters' own group) and one reduce-scatter more per layer and step."""
    names = fp32_declared(ModelConfig.preset("tiny"))
    kinds = {re.sub(r"layers\.\d+\.", "", name) for name in names}
    assert kinds == {
        "attn_hc.base",
        "attn_hc.scale",
        "ffn_hc.base",
        "ffn_hc.scale",
        "self_attn.conv1d.weight",
        "self_attn.forget_gate.dt_bias",
        "self_attn.forget_gate.A_log",
        "mlp.gate.weight",
    }
    one = bf16_reads(names, parallel=False)
    assert sorted(one["reads"]) == sorted(names)
    for rank, got in enumerate(launch(bf16_reads, 2, names, True, timeout_s=TIMEOUT_S)):
        assert sorted(got["reads"]) == sorted(names)
        for name in names:
            dtype, value = got["reads"][name]
            want_dtype, want_value = one["reads"][name]
            assert dtype == want_dtype == torch.float32, f"rank {rank}: {name} read as {dtype}"
            assert torch.equal(value, want_value), name
            assert got["grad_dtypes"][name] == torch.float32, name
        if rank == 0:
            assert got["loss"] == pytest.approx(one["loss"], rel=1e-2)
        fp32_group = {key[1:]: n for key, n in got["counts"].items() if key[0] not in ("world", "ep")}
        assert fp32_group == {
            ("forward", "all_gather"): LAYERS,
            ("backward", "all_gather"): LAYERS,
            ("backward", "reduce_scatter"): LAYERS,
        }, got["counts"]


def sharding_variants(variants: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """This rank's window (window = rank) at dp=4 x ep=2 under bf16 FSDP (bf16 gathers, bf16 autocast,
    per-layer recompute), once per (fsdp_prefetch, reduce_dtype) variant on a freshly built model: the loss,
    this rank's gradient shards, and the dtypes each group's reduce-scatters ran in."""
    from genomelm.parallel.mesh import ParallelDims
    from genomelm.parallel.training import ParallelRun
    from genomelm.run.precision import fsdp_reduce_dtype
    from genomelm.train.memory import LayerRunner
    from genomelm.train.step import window_loss

    out = []
    for prefetch, reduce in variants:
        model = build()
        run = ParallelRun.from_environment(ParallelDims(dp=4, ep=2), "zigzag", True, "cpu")
        run.prepare(model, torch.bfloat16, 8.0, prefetch=prefetch, reduce_dtype=fsdp_reduce_dtype(reduce))
        labels = {
            run.mesh.world_mesh.get_group().group_name: "world",
            run.mesh.edp_mesh.get_group().group_name: "edp",
        }
        dtypes = ReduceDtypes(labels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = window_loss(model, fly_rows(LENGTH, dist.get_rank()), LayerRunner(True, False), None)
        with dtypes:
            loss.backward()
        shards = {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append({"loss": loss.detach().clone(), "grads": shards, "reduced": dtypes.seen})
    return out


class ReduceDtypes(TorchDispatchMode):
    """The (group label, dtype) pairs of the reduce-scatters dispatched; other groups under their name."""

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__()
        self.labels = labels
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d" and COLLECTIVES.get(func._opname) == "reduce_scatter":
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            (group,) = [
                dist.ProcessGroup.unbox(leaf).group_name
                for leaf in leaves
                if isinstance(leaf, torch.ScriptObject) and "ProcessGroup" in str(leaf)
            ]
            dtype = next(leaf.dtype for leaf in leaves if isinstance(leaf, torch.Tensor))
            self.seen.add((self.labels.get(group, "fp32 group"), dtype))
        return func(*args, **kwargs)


def test_prefetch_is_bit_equal_and_bf16_reduction_stays_close_in_fp32_shards() -> None:
    """dp=4 x ep=2, bf16 FSDP, recompute: with fsdp_prefetch=1 the loss and every gradient shard are
    bit-equal to no prefetch (the same gathers of the same values, issued earlier). With reduce_dtype=bf16
    the layers' and the experts' gradients are reduce-scattered in bf16 (the fp32-declared group still in
    fp32), each shard stays fp32, the forward is unchanged, and the gradients stay close to fp32
    reduction: on each rank the whole gradient within 1% in L2 norm (measured: 0.25%), every shard within 2%
    of its largest value (measured: 0.91%, where the ranks' contributions cancel; bf16 keeps 8 bits)."""
    variants = [(0, "fp32"), (1, "fp32"), (0, "bf16")]
    results = launch(sharding_variants, 4, variants, timeout_s=TIMEOUT_S)
    worst_shard, worst_norm = 0.0, 0.0
    for rank, (plain, prefetched, bf16) in enumerate(results):
        assert torch.equal(plain["loss"], prefetched["loss"]), rank
        assert plain["grads"].keys() == prefetched["grads"].keys() == bf16["grads"].keys()
        for name, grad in plain["grads"].items():
            assert torch.equal(grad, prefetched["grads"][name]), (rank, name)
            assert grad.dtype == bf16["grads"][name].dtype == torch.float32, name
            scale = float(grad.abs().max()) if grad.numel() else 0.0  # a shard may be all padding
            if scale:
                worst_shard = max(worst_shard, float((bf16["grads"][name] - grad).abs().max()) / scale)
        names = sorted(plain["grads"])
        fp32 = torch.cat([plain["grads"][n].flatten() for n in names])
        low = torch.cat([bf16["grads"][n].flatten() for n in names])
        worst_norm = max(worst_norm, float((low - fp32).norm() / fp32.norm()))
        assert torch.equal(plain["loss"], bf16["loss"])
        fp32_everywhere = {("world", torch.float32), ("edp", torch.float32), ("fp32 group", torch.float32)}
        assert plain["reduced"] == fp32_everywhere
        assert bf16["reduced"] == {
            ("world", torch.bfloat16),
            ("edp", torch.bfloat16),
            ("fp32 group", torch.float32),
        }
    print(f"bf16 reduction vs fp32: gradient L2 {worst_norm:.2e}, largest shard difference {worst_shard:.2e}")
    assert 0 < worst_norm <= 0.01 and worst_shard <= 0.02, (worst_norm, worst_shard)
