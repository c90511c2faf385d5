"""What a window's side-stream work leaves exposed, layer by layer: a small event model of the compute stream,
the link FSDP2's collectives share (all-gathers and reduce-scatters in the order they are issued) and the
PCIe copier, through the forward and the backward (a layer's recompute inside its backward), with the
dependencies the code has. Hand-written: no library models a training step's streams at this grain.

- Forward: FSDP2 gathers a layer as its forward starts, or `forward_prefetch` layers ahead (the
  `fsdp_prefetch` setting: each layer's pre-hook issues the next layers' gathers), when the host issues
  it; the host runs ahead of the GPU except at a sync: each MoE forward copies its split sizes to the host
  (`parallel/expert.py`, `_exchange_sizes`), so without prefetch the next layer's gather is issued only
  once the GPU reaches that layer's MoE, and hides behind its MoE work alone (prefetched, layer i+1's
  gather is issued with layer i's, behind all of layer i's work). A gathered layer's copy-out runs on the
  compute stream before the layer. The layer inputs go to the host on the copier's stream (they block
  nothing).
- Backward: FSDP2 prefetches max(1, `forward_prefetch`) layers ahead (one: its default; the setting's
  explicit backward prefetch beyond), the gathers issued as the previous layer's starts (after that layer's
  copy-out: FSDP2 holds 1 + that many gathered layers); the recompute reuses
  the forward's split sizes (no sync), so the host runs ahead, one layer ahead assumed: a layer's input comes
  back over PCIe (`HostCopier.to_device`, no prefetch of its own) from the start of the layer before, and
  the layer waits for it. Each layer's reduce-scatter is issued after its backward. The window ends when
  the last reduce-scatter is done.
- Compute that runs while a collective does is slowed by `comm_sm_share` (NCCL's kernels take SMs and HBM).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerWork:
    """One decoder layer's work in a window, seconds: the compute stream's forward, of it the part after the
    layer's host sync (`tail`: its MoE's work after the split sizes reach the host; 0 without a sync),
    recompute and backward; its FSDP2 all-gather (one per pass: forward, and backward with recompute) and
    copy-out; its reduce-scatter; its input's copy back from the host."""

    forward: float
    recompute: float
    backward: float
    tail: float = 0.0
    syncs: bool = False  # the forward copies a value to the host (a MoE layer under expert parallelism)
    gather: float = 0.0
    copy_out: float = 0.0
    reduce: float = 0.0
    host_in: float = 0.0


@dataclass
class Timeline:
    """The event model's result: the window's seconds, the compute stream's kernels' own seconds, and what
    the rest adds, by part (waiting, the copy-outs, the slowdown beside collectives: they sum to the
    difference)."""

    window_s: float
    compute_s: float
    exposed: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        return self.window_s - self.compute_s


def _overlap(busy: list[tuple[float, float]], spans: list[tuple[float, float]]) -> float:
    """Seconds of the `busy` spans that overlap `spans`, summed busy span by busy span. `spans` are the
    link's, FIFO: each starts once the one before it ends, so those a busy span overlaps are one run of them,
    found by bisection (the others would add exactly 0.0: the sum is the all-pairs one, bit for bit)."""
    ends = [end for _, end in spans]
    total = 0
    for a0, a1 in busy:
        part = 0
        for i in range(bisect_right(ends, a0), len(spans)):  # the first span that ends after a0
            b0, b1 = spans[i]
            if b0 >= a1:
                break
            part += max(0.0, min(a1, b1) - max(a0, b0))
        total += part
    return total


def simulate(
    layers: list[LayerWork],
    before: float = 0.0,
    between: float = 0.0,
    forward_prefetch: int = 0,
    comm_sm_share: float = 0.0,
) -> Timeline:
    """The window of `layers` (in forward order): `before` seconds of compute ahead of the first layer (the
    embedding), `between` after the last layer's forward and before the backward (head, loss and their
    backward). Link and copier are FIFO; times in seconds from the window's start."""
    compute = link = pcie = 0.0
    waits = {
        "forward all-gathers": 0.0,
        "backward all-gathers": 0.0,
        "inputs back from the host": 0.0,
        "reduce-scatters after the backward": 0.0,
    }
    comm_spans: list[tuple[float, float]] = []
    busy: list[tuple[float, float]] = []  # compute spans that can overlap a collective
    n = len(layers)
    compute += before
    host = 0.0  # when the host issues the next layer's forward
    gathered = [0.0] * n
    issued: set[int] = set()

    def gather(i: int, at: float) -> None:
        nonlocal link
        start = max(link, at)
        link = start + layers[i].gather
        gathered[i] = link
        comm_spans.append((start, link))

    for i, layer in enumerate(layers):
        for j in range(i, min(n, i + forward_prefetch + 1)):
            if j not in issued:
                gather(j, host)
                issued.add(j)
        start = max(compute, gathered[i])
        waits["forward all-gathers"] += start - compute
        body = start + layer.copy_out
        busy.append((body, body + layer.forward))
        compute = body + layer.forward
        if layer.syncs:  # the host waits for the GPU to reach the layer's sync
            host = max(host, compute - layer.tail)
    compute += between
    # the backward: gathers `behind` layers ahead, each issued after the previous layer's copy-out
    behind = max(1, forward_prefetch)
    gathered = [0.0] * n
    issued = set(range(max(0, n - behind), n))
    for j in reversed(range(max(0, n - behind), n)):
        gather(j, compute)
    ahead = compute  # the host one layer ahead: when the layer before (in backward order) started
    for i in reversed(range(n)):
        layer = layers[i]
        start = max(compute, gathered[i])
        waits["backward all-gathers"] += start - compute
        copied = start + layer.copy_out
        for j in reversed(range(max(0, i - behind), i)):
            if j not in issued:
                gather(j, copied)
                issued.add(j)
        back = max(pcie, ahead) + layer.host_in
        pcie = back
        body = max(copied, back)
        waits["inputs back from the host"] += body - copied
        ahead = start
        busy.append((body, body + layer.recompute + layer.backward))
        compute = body + layer.recompute + layer.backward
        # the reduce-scatter after the layer's backward, behind what the link has queued
        rs_start = max(link, compute)
        link = rs_start + layer.reduce
        comm_spans.append((rs_start, link))
    end = max(compute, link)
    waits["reduce-scatters after the backward"] = end - compute
    slowed = comm_sm_share * _overlap(busy, comm_spans)
    waits["compute slowed beside collectives"] = slowed
    waits["FSDP2 copy-outs (compute stream)"] = 2 * sum(x.copy_out for x in layers)
    own = before + between + sum(x.forward + x.recompute + x.backward for x in layers)
    return Timeline(end + slowed, own, waits)
