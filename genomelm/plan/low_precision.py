"""What `expert_precision` (fp8_rowwise, mxfp8: torchao's quantised grouped GEMMs of the routed experts,
`genomelm.model.expert_precision`) changes in the plan. The step is traced in bf16 (the CPU would run the
emulation, fp32 copies and all), and the low precision counted here:

- the grouped GEMM's rate: `grouped_gemm_bf16` x the kernel's speed-up (`rates.EXPERT_GEMM_GAINS`, with its
  range) / the FLOPs the alignment adds (each local expert's rows padded to a multiple of 16 or 32: half a
  block of zero rows each, expected, over the mean rows a rank's chunk brings);
- the bytes torchao and the alignment move (`expert_quantisation`), per MoE layer and chunk of the busiest
  rank: its local experts' weights quantised anew by each GEMM call that takes them (the forward, the
  recompute, the input gradient: E/ep x 3 x hidden x intermediate values, read in bf16 and written in fp8,
  3 B each; torchao keeps no quantised copy between calls), and per routed row the operands of the three
  passes quantised (forward and recompute: the two GEMMs' inputs, hidden + intermediate; backward: the
  output gradients row-wise for the input gradients and, with the inputs, column-wise for the weight
  gradients, 3 hidden + 5 intermediate; 3 B each), and `_aligned`'s copies around each grouped linear (a
  zero buffer, the rows copied in, the output rows gathered back; the backward's reverse: 10 hidden + 14
  intermediate B per row in the forward, 10 hidden + 16 intermediate in the backward);
- the MoE's transient (`transient_bytes`): the fp8 copy of the largest weight (gate_up) and of the chunk's
  widest operand row-wise and column-wise, beside its padded bf16 copy.

The GEMM's own operand reads stay counted at bf16 (compute-bound at our shape), and the fp8 scales (1/32
B per value for MXFP8, one fp32 per row for rowwise) are left out.
"""

from __future__ import annotations

import dataclasses

from genomelm.model import ModelConfig
from genomelm.model.expert_precision import ALIGN
from genomelm.plan import rates, roofline
from genomelm.plan.layouts import Layout
from genomelm.plan.rates import Peaks

WHERE = (
    "genomelm/model/expert_precision.py (torchao's quantisation and the aligned copies; not traced, counted)"
)


def chunk_rows(model_config: ModelConfig, tokens: int, chunk_tokens: int) -> int:
    """Routed rows one rank's MoE chunk brings to its experts at the mean (the chunk's tokens x top-k)."""
    return min(tokens, chunk_tokens) * model_config.num_experts_per_tok


def padding_share(model_config: ModelConfig, layout: Layout, precision: str, rows: float) -> float:
    """The grouped GEMM's rows the alignment adds over `rows`: half a block of zero rows per local expert."""
    if precision == "bf16":
        return 0.0
    return model_config.n_routed_experts / layout.ep * (ALIGN[precision] - 1) / 2 / rows


def expert_peaks(
    p: Peaks, model_config: ModelConfig, layout: Layout, precision: str, tokens: int, chunk_tokens: int
) -> Peaks:
    """`p` with the routed experts' grouped GEMM at `precision`'s rate: bf16's x the kernel's speed-up at
    `p.case`'s end / (1 + the alignment's padding share)."""
    if precision == "bf16":
        return p
    gain = rates.expert_gemm_gain(precision, p.name, p.case)
    padding = padding_share(model_config, layout, precision, chunk_rows(model_config, tokens, chunk_tokens))
    compute = dict(p.compute)
    compute["grouped_gemm_bf16"] *= gain / (1 + padding)
    return dataclasses.replace(p, compute=compute)


def expert_quantisation(
    model_config: ModelConfig,
    layout: Layout,
    precision: str,
    tokens: int,
    chunk_tokens: int,
    p: Peaks,
    scale: float,
    recompute: bool = True,
) -> list[roofline.CostedClass]:
    """The quantisation and alignment bytes of a window (module docstring), over every MoE layer, at a rank
    receiving `scale` x the mean rows: the forward's, the recompute's (nothing without `recompute`) and the
    backward's class (memory-bound, eight kernels per grouped linear and pass counted for launches). None in
    bf16."""
    if precision == "bf16":
        return []
    c = model_config
    moe_layers = sum(t == "sparse" for t in c.mlp_layer_types)
    chunks = -(-tokens // chunk_tokens)
    d, i = c.hidden_size, c.moe_intermediate_size
    weights = c.n_routed_experts / layout.ep * 3 * d * i * 3 * chunks  # one quantisation per chunk
    rows = tokens * c.num_experts_per_tok * scale
    forward = weights + rows * (3 * (d + i) + 10 * d + 14 * i)
    backward = weights + rows * (3 * (3 * d + 5 * i) + 10 * d + 16 * i)
    count = 16 * chunks * moe_layers  # two grouped linears, ~8 kernels each
    classes = []
    passes = (
        ("", forward, False),
        ("", forward if recompute else 0.0, True),
        ("backward of ", backward, False),
    )
    for name, moved, again in passes:
        moved *= moe_layers
        seconds = moved / p.memory + (count * p.launch_s if moved else 0.0)
        where = f"{name}{WHERE}"
        classes.append(
            roofline.CostedClass(
                f"torchao quantise {precision} @ {where}{' (recompute)' if again else ''}",
                "torchao quantise",
                "memory",
                where,
                count if moved else 0,
                0.0,
                moved,
                seconds,
                "memory",
                0.0,
                "memory",
                seconds if again else 0.0,
            )
        )
    return classes


def transient_bytes(model_config: ModelConfig, layout: Layout, precision: str, rows: float) -> float:
    """What a MoE chunk's low-precision GEMMs hold beyond bf16's, at `rows` routed rows: the fp8 copy of
    its local gate_up weights (E/ep x 2 intermediate x hidden, 1 B) and, of its widest operand (2
    intermediate: gate_up's output gradient), the padded bf16 copy (2 B) and the row-wise and column-wise
    fp8 ones (1 B each)."""
    if precision == "bf16":
        return 0.0
    c = model_config
    width = 2 * c.moe_intermediate_size
    padded = rows * (1 + padding_share(c, layout, precision, rows))
    return c.n_routed_experts / layout.ep * width * c.hidden_size + padded * width * (2 + 1 + 1)
