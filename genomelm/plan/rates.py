"""What a GPU attains, op class by op class, each rate with its public source; and the links between GPUs.

`RATES` is the one table the roofline (`genomelm.plan.roofline`) costs every kernel, collective and host copy
by: a kernel's time is max(FLOPs / its class's attainable FLOP/s, bytes / attainable HBM bytes/s) + one
launch. The rates are measured figures from public benchmarks (a benchmark table, an issue, a kernel's
README), not datasheet peaks times one flat factor. Where nothing public measures a kernel of ours (the
Triton sparse MLA and indexer kernels), the best published kernel of the same kind is taken as its ceiling,
and its row says so (the mHC kernels are memory-bound: HBM's row); an estimate says how it was made.
`DATASHEET` keeps the vendors' dense peaks for one use only: MFU's and HFU's denominator.

Links (`Links`): a collective inside a node runs on NVLink at the attainable bus bandwidth of its kind; a
ring across nodes runs over every NIC of each node it spans (NCCL opens one channel per NIC), so a group that
fills its nodes moves `nics_per_node` x the NIC rate, shared by the node's GPUs in the group; an all-to-all
across nodes sends the share of its bytes bound for other nodes over the NICs and the rest over NVLink, at
once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU_KINDS = ("b200", "h200", "h100")


@dataclass(frozen=True)
class Rate:
    """One op class's rate on each GPU kind, in `unit`, and where the figure comes from."""

    key: str
    what: str
    b200: float
    h200: float
    h100: float
    unit: str  # "TFLOP/s", "TB/s", "GB/s" or "us"
    source: str

    def on(self, gpu: str) -> float:
        """The rate on `gpu` in base units: FLOP/s, bytes/s or seconds."""
        scale = {"TFLOP/s": 1e12, "TB/s": 1e12, "GB/s": 1e9, "us": 1e-6}[self.unit]
        return getattr(self, gpu) * scale


DATASHEET: tuple[Rate, ...] = (
    Rate(
        "bf16",
        "bf16 tensor cores, dense",
        2250,
        989,
        989,
        "TFLOP/s",
        "NVIDIA B200 / H200 / H100 SXM datasheets",
    ),
    Rate(
        "fp8",
        "fp8 tensor cores, dense",
        4500,
        1979,
        1979,
        "TFLOP/s",
        "NVIDIA datasheets (dense, no sparsity)",
    ),
    Rate("hbm", "HBM bandwidth", 8.0, 4.8, 3.35, "TB/s", "NVIDIA datasheets (HBM3e / HBM3e / HBM3)"),
    Rate(
        "nvlink",
        "NVLink per GPU per direction",
        900,
        450,
        450,
        "GB/s",
        "NVLink 5 (1.8 TB/s bidirectional) / NVLink 4 (900 GB/s bidirectional)",
    ),
)

MAMF = "stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS table"
RATES: tuple[Rate, ...] = (
    Rate(
        "gemm_bf16", "dense bf16 GEMM (cuBLAS)", 1745, 794.5, 794.5, "TFLOP/s", f"{MAMF} (bf16; H200 = H100)"
    ),
    Rate("gemm_fp8", "dense fp8 GEMM (torch._scaled_mm)", 3432.5, 1453.4, 1402.6, "TFLOP/s", f"{MAMF} (fp8)"),
    Rate(
        "gemm_tf32",
        "dense tf32 GEMM (only where the code enables TF32; genomelm does not)",
        872,
        397,
        397,
        "TFLOP/s",
        "estimate: half the bf16 MAMF (TF32's dense peak is half bf16's)",
    ),
    Rate(
        "gemm_fp32",
        "fp32 matmul on CUDA cores (no TF32)",
        60,
        54,
        54,
        "TFLOP/s",
        "estimate: 80% of the datasheet fp32 (75 / 67 / 67), the share MAMF measures for bf16",
    ),
    Rate(
        "grouped_gemm_bf16",
        "routed experts' grouped GEMM (torch._grouped_mm; 4096 x 1536 and back, ~36 experts, 200-2k rows)",
        700,
        350,
        350,
        "TFLOP/s",
        "estimate between measurements: 242 TFLOP/s (24%) at hidden 2048 / FFN 768 / ~2k rows per expert and "
        "181 at FFN 512 on H100 (ByteDance-Seed/VeOmni PR 460); 705 on H200 and 1,313 on B200 at balanced "
        "groups of 8k+ rows x 7168 (pytorch/pytorch PRs 156203, 170802); our shapes taken at ~35% of peak",
    ),
    Rate(
        "sparse_mla_fwd",
        "sparse MLA forward (our Triton kernel; ceiling: the best published sparse-MLA kernel)",
        1450,
        640,
        640,
        "TFLOP/s",
        "deepseek-ai/FlashMLA README, sparse prefill: 640 TFLOP/s on H800 (H100's compute), 1,450 on B200",
    ),
    Rate(
        "sparse_mla_bwd",
        "sparse MLA backward (our Triton kernel; ceiling: the best published kernel)",
        820,
        115,
        100,
        "TFLOP/s",
        "tile-ai/tilelang examples/deepseek_v32 README: sparse_mla_bwd ~100 TFLOP/s on H800, ~115 on H200; "
        "Dao-AILab/flash-attention PR 2621 (SM100 CuTe sparse MLA): backward 820 TFLOP/s",
    ),
    Rate(
        "indexer",
        "lightning indexer scores (our Triton kernel, bf16)",
        872,
        397,
        397,
        "TFLOP/s",
        "estimate, nothing public measures an indexer kernel: half the bf16 MAMF (a GEMM whose ReLU-weighted "
        "reduction over heads is its epilogue)",
    ),
    Rate(
        "kda_fwd",
        "fla chunk_kda forward (64 heads x 128, bf16)",
        71,
        54,
        54,
        "TFLOP/s",
        "inclusionAI/cuLA BENCHMARK_H200.md (fla 0.5.0): 6.94 ms for 2 x 16,384 tokens, BENCHMARK.md GB200: "
        "5.33 ms, as TFLOP/s by kda_chunk.chunk_kda_flops; H100 taken as H200 (same SMs)",
    ),
    Rate(
        "kda_bwd",
        "fla chunk_kda backward (its FLOPs reckoned at twice the forward's)",
        46,
        35,
        35,
        "TFLOP/s",
        "inclusionAI/cuLA PR 54 (SM10x): forward + backward 10.9 ms at 16,384 tokens, 64 heads: the backward "
        "~3.1x the forward's time; H200 and H100 the forward's rate x 2 / 3.1",
    ),
    Rate(
        "memory",
        "memory-bound kernels (elementwise, copies, norms): HBM attained",
        6.52,
        4.3,
        3.01,
        "TB/s",
        "NVIDIA/cutlass PR 2917 (CuTe RMSNorm on B200: 6,517 GB/s); Dao-AILab/quack blog (softmax on H100: "
        "3.01 TB/s, 90%); H200 estimated at 90% of 4.8. Eager PyTorch kernels can fall below these",
    ),
    Rate(
        "launch",
        "one eager op: launch + PyTorch dispatch",
        7,
        7,
        7,
        "us",
        "flagos-ai/FlagGems issue 4812 (~7 us per eager tiny op); meta-pytorch/tritonbench PR 1017 (bare "
        "cuLaunchKernel 3.0 us on GB200)",
    ),
    Rate(
        "nvlink_ring",
        "NVLink all-gather / reduce-scatter / all-reduce bus bandwidth, 8 GPUs",
        720,
        360,
        360,
        "GB/s",
        "NVIDIA/nccl-tests issue 326 (8 x H100: ~360 GB/s busbw, 'exactly what we'd expect'); B200: NCCL's "
        "topology model maxBw 721.8 (NVIDIA/nccl issue 1807), an estimate",
    ),
    Rate(
        "nvlink_all_to_all",
        "NVLink all-to-all per GPU, 8 GPUs (expert dispatch / combine)",
        726,
        330,
        330,
        "GB/s",
        "deepseek-ai/DeepEP README v2: 726 GB/s on SM100, EP 8 (a ceiling for NCCL's all-to-all); H100 and "
        "H200 estimated under the 380 GB/s one-way p2p NVIDIA/nccl issue 1264 measures",
    ),
    Rate(
        "nic_ring",
        "one 400 Gb/s NDR NIC in a ring across nodes",
        47,
        47,
        47,
        "GB/s",
        "NVIDIA/nccl-tests issue 290: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'",
    ),
    Rate(
        "nic_all_to_all",
        "one 400 Gb/s NIC in an all-to-all across nodes (RDMA)",
        50,
        50,
        50,
        "GB/s",
        "deepseek-ai/DeepEP docs/legacy.md (H800, CX7): 43 / 58 / 51 GB/s per GPU at EP 16 / 32 / 64",
    ),
    Rate(
        "pcie",
        "PCIe Gen5 x16 host copies, pinned, per direction",
        50,
        50,
        50,
        "GB/s",
        "NVIDIA/nvbandwidth issue 24 (H100: device-to-host 52.8, host-to-device 35.2 GB/s by SM copy); "
        "copy-engine pinned ~55; Gen5 x16 ~63 raw",
    ),
    Rate(
        "host_memory",
        "host DRAM bandwidth of one node (two sockets), shared by its GPUs' host work",
        430,
        430,
        430,
        "GB/s",
        "estimate, no measured STREAM of a DGX host found: DGX H100's 16 channels of DDR5-4800 (614 GB/s) at "
        "the ~70% STREAM reaches on such hosts; DGX B200's host taken as the same",
    ),
)


@dataclass(frozen=True)
class Links:
    """The links of one GPU: NVLink inside a node (bus bandwidth of a ring collective and of an all-to-all),
    the node's NICs, PCIe to the host; bytes/s per direction."""

    nvlink_ring: float
    nvlink_all_to_all: float
    nic: float  # one NIC, in a ring across nodes
    nic_all_to_all: float  # one NIC, in an all-to-all across nodes
    nics_per_node: int
    gpus_per_node: int
    pcie: float

    def ring_bytes_per_s(self, ranks: int) -> float:
        """A ring collective over `ranks` consecutive ranks: NVLink inside a node; across nodes, the NICs of
        each node (a group of consecutive ranks fills every node it spans but the last), at most NVLink's."""
        if ranks <= self.gpus_per_node:
            return self.nvlink_ring
        return min(self.nvlink_ring, self.nic * self.nics_per_node)

    def seconds(self, kind: str, moved: float, ranks: int) -> float:
        """Seconds for one rank to move `moved` bytes in a collective of `kind` over `ranks` consecutive
        ranks: an all-to-all (`all_to_all_seconds`), else a ring (`ring_bytes_per_s`)."""
        if ranks <= 1:
            return 0.0
        if kind == "all_to_all":
            return self.all_to_all_seconds(moved, ranks)
        return moved / self.ring_bytes_per_s(ranks)

    def all_to_all_seconds(self, moved: float, ranks: int) -> float:
        """An all-to-all in which one rank sends `moved` bytes to the other `ranks - 1` ranks in equal shares:
        those bound for its own node on NVLink, the rest on its share of the node's NICs, both at once."""
        if ranks <= 1:
            return 0.0
        local = min(ranks, self.gpus_per_node) - 1
        on_node = moved * local / (ranks - 1)
        off_node = moved - on_node
        nic_share = self.nic_all_to_all * self.nics_per_node / self.gpus_per_node
        return max(on_node / self.nvlink_all_to_all, off_node / nic_share if off_node else 0.0)


COLLECTIVE_FACTORS = {  # bytes one rank moves over its link per byte of the collective's full tensor, n ranks
    "all_gather": "(n-1)/n of the gathered output",
    "reduce_scatter": "(n-1)/n of the input",
    "all_to_all": "(n-1)/n of the exchanged tensor",
    "all_reduce": "2(n-1)/n of the tensor (ring: a reduce-scatter then an all-gather; NCCL's tree as much)",
}
COLLECTIVE_SOURCE = "NCCL's bus bandwidth factors (nccl-tests doc/PERFORMANCE.md)"


def ring_factor(kind: str, ranks: int) -> float:
    """Bytes one rank moves per byte of the collective's full tensor (`COLLECTIVE_FACTORS`)."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    if kind not in COLLECTIVE_FACTORS:
        raise ValueError(f"no ring factor for collective {kind!r}: one of {sorted(COLLECTIVE_FACTORS)}")
    return 2 * share if kind == "all_reduce" else share


@dataclass(frozen=True)
class Peaks:
    """What one device attains: FLOP/s by rate key (`RATES`: "gemm_bf16", "grouped_gemm_bf16",
    "sparse_mla_bwd", ...; a key it lacks falls back to the GEMM of the op's unit), HBM bytes/s, the launch
    cost (s), its links, and the datasheet dense bf16 peak (MFU's denominator only)."""

    name: str
    compute: dict[str, float]
    memory: float
    launch_s: float
    links: Links
    peak_bf16: float
    sources: dict[str, str] = field(default_factory=dict)  # rate key -> its source

    def resolved(self, key: str, unit: str) -> str:
        """`key` where the device has that rate, else a backward GEMM's forward rate ("gemm_bf16_backward" ->
        "gemm_bf16"), else the dense GEMM of `unit` ("bf16", "fp8", "tf32", "fp32")."""
        for candidate in (key, key.removesuffix("_backward")):
            if candidate in self.compute:
                return candidate
        return f"gemm_{unit}"

    def flops_rate(self, key: str, unit: str) -> float:
        """FLOP/s of rate `key` (`resolved`)."""
        return self.compute[self.resolved(key, unit)]


def rate(key: str) -> Rate:
    for row in RATES:
        if row.key == key:
            return row
    raise KeyError(f"no rate {key!r}: one of {[r.key for r in RATES]}")


def peaks(
    gpu: str,
    nvlink_gbs: float = 0.0,
    nic_gbs: float = 0.0,
    nics_per_node: int = 8,
    gpus_per_node: int = 8,
    pcie_gbs: float = 0.0,
) -> Peaks:
    """`gpu`'s attainable rates from `RATES`; the links overridden where given (GB/s, NVLink's ring and
    all-to-all alike)."""
    if gpu not in GPU_KINDS:
        raise ValueError(f"gpu must be one of {list(GPU_KINDS)}, not {gpu!r}")
    values = {row.key: row.on(gpu) for row in RATES}
    links = Links(
        nvlink_ring=nvlink_gbs * 1e9 or values["nvlink_ring"],
        nvlink_all_to_all=nvlink_gbs * 1e9 or values["nvlink_all_to_all"],
        nic=nic_gbs * 1e9 or values["nic_ring"],
        nic_all_to_all=nic_gbs * 1e9 or values["nic_all_to_all"],
        nics_per_node=nics_per_node,
        gpus_per_node=gpus_per_node,
        pcie=pcie_gbs * 1e9 or values["pcie"],
    )
    compute = {key: v for key, v in values.items() if rate(key).unit == "TFLOP/s"}
    return Peaks(
        name=gpu,
        compute=compute,
        memory=values["memory"],
        launch_s=values["launch"],
        links=links,
        peak_bf16=DATASHEET[0].on(gpu),
        sources={row.key: row.source for row in RATES},
    )


def rates_table() -> str:
    """`DATASHEET` and `RATES` as markdown tables (docs/planner.md's)."""
    rows = ["| op class | B200 | H200 | H100 | unit | source |", "|---|---|---|---|---|---|"]
    rows += [f"| {r.what} | {r.b200:g} | {r.h200:g} | {r.h100:g} | {r.unit} | {r.source} |" for r in RATES]
    rows += ["", "| datasheet peak (MFU's denominator only) | B200 | H200 | H100 | unit | source |"]
    rows += ["|---|---|---|---|---|---|"]
    rows += [
        f"| {r.what} | {r.b200:g} | {r.h200:g} | {r.h100:g} | {r.unit} | {r.source} |" for r in DATASHEET
    ]
    return "\n".join(rows)
