"""fla's kernels as custom ops on fake tensors: what the simulation and the planner trace in place of fla.

fla's `chunk_kda` (with and without its in-kernel gate) and `causal_conv1d` cannot run on fake tensors (nor
fla on a CPU). `fla_stand_in` hands KDA stand-ins with fla's call signatures that check what fla checks of
their arguments and enter as `genomelm_simulation::` custom ops: their fake implementations give the outputs
and final state in the right shapes and dtypes, save the inputs (fla keeps its inputs for the backward and
recomputes the rest), and the backward is an op of its own (`chunk_kda_backward`), so a trace holds fla's
forward and backward as kernels. Each has a FLOP formula (`kda_chunk.chunk_kda_flops`; the backward twice
the forward, as that formula's docstring reckons) and a byte estimate (`<op>_bytes`, found by the
roofline), so the roofline costs KDA as fla runs it. What they do not know is fla's own workspace.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from genomelm.model.kda_chunk import chunk_kda_bytes as _kda_bytes
from genomelm.model.kda_chunk import chunk_kda_flops


@torch.library.custom_op("genomelm_simulation::chunk_kda", mutates_args=())
def _chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_kda` in the simulation: q, k, g [B, S, H, Dk], v [B, S, H, Dv], beta [B, S, H], state
    [B, H, Dk, Dv] fp32 -> (out like v, final state fp32). Fake tensors only."""
    raise RuntimeError("the chunk_kda stand-in runs on fake tensors only (the simulation, the planner)")


@_chunk_kda.register_fake
def _(q, k, v, g, beta, state):
    return torch.empty_like(v), torch.empty_like(state, dtype=torch.float32)


@torch.library.custom_op("genomelm_simulation::chunk_kda_gate", mutates_args=())
def _chunk_kda_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_kda` with its in-kernel gate (`use_gate_in_kernel=True`) in the simulation: as
    `_chunk_kda` with g the raw gate input, plus A_log [H] and dt_bias [H*Dk] (fp32, given gradients)."""
    raise RuntimeError("the chunk_kda stand-in runs on fake tensors only (the simulation, the planner)")


@_chunk_kda_gate.register_fake
def _(q, k, v, g, beta, state, A_log, dt_bias):
    return torch.empty_like(v), torch.empty_like(state, dtype=torch.float32)


@torch.library.custom_op("genomelm_simulation::chunk_kda_backward", mutates_args=())
def _chunk_kda_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's `chunk_kda` backward in the simulation: the forward's inputs and the output's gradient -> the
    gradients of q, k, v, g, beta and the initial state. Fake tensors only."""
    raise RuntimeError("the chunk_kda stand-in runs on fake tensors only (the simulation, the planner)")


@_chunk_kda_backward.register_fake
def _(q, k, v, g, beta, state, grad_out):
    return tuple(torch.empty_like(t) for t in (q, k, v, g, beta, state))


def _saves_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # fla keeps its inputs for the backward (and recomputes the rest)


def _input_shaped_grads(ctx, *grads):
    return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def _chunk_kda_grads(ctx, grad_out, grad_state):
    """The delta rule's gradients through `chunk_kda_backward`; the in-kernel gate's A_log and dt_bias (tiny)
    as empty tensors of their shapes."""
    saved = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(saved[2])
    return _chunk_kda_backward(*saved[:6], grad_out) + tuple(torch.empty_like(t) for t in saved[6:])


_chunk_kda.register_autograd(_chunk_kda_grads, setup_context=_saves_inputs)
_chunk_kda_gate.register_autograd(_chunk_kda_grads, setup_context=_saves_inputs)


@register_flop_formula(
    [torch.ops.genomelm_simulation.chunk_kda, torch.ops.genomelm_simulation.chunk_kda_gate]
)
def _chunk_kda_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """The forward's FLOPs (`kda_chunk.chunk_kda_flops`)."""
    batch, seq, heads, dk = q_shape
    return chunk_kda_flops(batch, seq, heads, dk, v_shape[-1])


@register_flop_formula(torch.ops.genomelm_simulation.chunk_kda_backward)
def _chunk_kda_backward_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """Twice the forward's: fla's backward recomputes the chunks' states and runs the transposed products
    (`kda_chunk.chunk_kda_flops`: "a backward is about twice this")."""
    batch, seq, heads, dk = q_shape
    return 2 * chunk_kda_flops(batch, seq, heads, dk, v_shape[-1])


def chunk_kda_bytes(q, k, v, g, beta, state) -> int:
    """HBM bytes of one forward (`kda_chunk.chunk_kda_bytes` at the op's shapes and q's dtype)."""
    batch, seq, heads, dk = q.shape
    return _kda_bytes(batch, seq, heads, dk, v.shape[-1], q.element_size())


def chunk_kda_gate_bytes(q, k, v, g, beta, state, A_log, dt_bias) -> int:
    """As `chunk_kda_bytes` (the gate's parameters are a few KiB)."""
    return chunk_kda_bytes(q, k, v, g, beta, state)


def chunk_kda_backward_bytes(q, k, v, g, beta, state, grad_out) -> int:
    """Twice a forward's: the inputs and the output's gradient read, the recomputed score blocks written
    and read, every input's gradient written."""
    return 2 * chunk_kda_bytes(q, k, v, g, beta, state)


def _chunk_kda_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stand-in with `fla.ops.kda.chunk_kda`'s keyword arguments (as `kda_chunk.fla_kda` calls it),
    checking what fla itself checks of them."""
    if initial_state is None:
        batch, _, heads, dk = k.shape
        initial_state = k.new_zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32)
    if initial_state.dtype != torch.float32:
        raise ValueError("fla's chunk_kda takes an fp32 initial state")
    if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"fla's safe_gate takes a lower bound in [-5, 0), got {lower_bound}")
    if use_gate_in_kernel:
        if A_log is None or dt_bias is None or not safe_gate:
            raise ValueError("the in-kernel gate is called with A_log, dt_bias and safe_gate here")
        return _chunk_kda_gate(q, k, v, g, beta, initial_state, A_log, dt_bias)
    return _chunk_kda(q, k, v, g, beta, initial_state)


@torch.library.custom_op("genomelm_simulation::causal_conv1d", mutates_args=())
def _causal_conv1d(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor) -> torch.Tensor:
    """fla's `causal_conv1d` in the simulation: x [B, S, C], weight [C, K], initial_state [B, C, K] -> y
    like x. Fake tensors only."""
    raise RuntimeError("the causal_conv1d stand-in runs on fake tensors only (the simulation, the planner)")


@_causal_conv1d.register_fake
def _(x, weight, initial_state):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_causal_conv1d.register_autograd(_input_shaped_grads, setup_context=_saves_inputs)


def _causal_conv1d_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor,
    activation: str | None = None,
    backend: str = "triton",
) -> tuple[torch.Tensor, None]:
    """The stand-in with `fla.modules.causal_conv1d.causal_conv1d`'s arguments (as `KDAttention` calls it)."""
    if activation != "silu" or initial_state.shape != (x.shape[0], x.shape[2], weight.shape[1]):
        raise ValueError(f"causal_conv1d: activation {activation}, state {tuple(initial_state.shape)}")
    return _causal_conv1d(x, weight, initial_state), None


@contextmanager
def fla_stand_in() -> Iterator[None]:
    """`fla_chunk_kda()` and `fla_causal_conv1d()` return the stand-ins (as if fla were installed) while
    inside."""
    from genomelm.model import kda, kda_chunk

    stand_ins = {"fla_chunk_kda": lambda: _chunk_kda_call, "fla_causal_conv1d": lambda: _causal_conv1d_call}
    with ExitStack() as stack:
        for module in (kda, kda_chunk):
            for name, stand_in in stand_ins.items():
                stack.enter_context(replaced(module, name, stand_in))
        yield


@contextmanager
def replaced(
    owner: Any, name: str, value: Any
) -> Iterator[None]:  # the simulation's other stand-ins use it too
    """`owner.name` is `value` while inside, then as it was (an attribute of `owner`'s own restored as
    stored, a staticmethod as one; an inherited one by removing the replacement)."""
    own = name in vars(owner)
    saved = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)
