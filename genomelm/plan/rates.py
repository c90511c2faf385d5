"""What a GPU attains, op class by op class, each rate with its public source; and the links between GPUs.

`RATES` is the one table the roofline (`genomelm.plan.roofline`) costs every kernel, collective and host copy
by: a kernel's time is max(FLOPs / its class's attainable FLOP/s, bytes / attainable HBM bytes/s) + one
launch. The rates are measured figures from public benchmarks (a benchmark table, an issue, a kernel's
README), not datasheet peaks times one flat factor. Where nothing public measures a kernel of ours (the
Triton sparse MLA and indexer kernels), the best published kernel of the same kind is taken as its ceiling,
and its row says so (the mHC kernels are memory-bound: HBM's row); an estimate says how it was made.
`DATASHEET` keeps the vendors' dense peaks for one use only: MFU's and HFU's denominator.

Each rate is rated from a public measurement of the same kind of implementation (a Triton kernel of that kind,
a grouped GEMM at our rows per expert); where none exists, a stated assumption. Every row carries its spread:
the factors (pessimistic, optimistic) its value takes at the range's two ends (`CASES`: "low" is the fewest
tokens/s, "high" the most), from the spread of the measurements or, for an assumption, the low and high
values it states. For a rate a pessimistic factor is below 1; for a time, a pass count or a share of SMs
taken, above.

Links (`Links`): a collective inside a node runs on NVLink at the attainable bus bandwidth of its kind; a
ring across nodes runs over every NIC of each node it spans (NCCL opens one channel per NIC), so a group that
fills its nodes moves `nics_per_node` x the NIC rate, shared by the node's GPUs in the group and by the other
groups running the same collective through the node's NICs at once (the ep expert groups); an all-to-all
across nodes sends the share of its bytes bound for other nodes over the NICs and the rest over NVLink, at
once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU_KINDS = ("b200", "h200", "h100")
CASES = ("low", "expected", "high")  # the range: every rate at its pessimistic end, as given, optimistic


@dataclass(frozen=True)
class Rate:
    """One op class's rate on each GPU kind, in `unit`, and where the figure comes from."""

    key: str
    what: str
    b200: float
    h200: float
    h100: float
    unit: str  # "TFLOP/s", "TB/s", "GB/s", "us", "GiB" or "x" (a count or a fraction)
    source: str
    spread: tuple[float, float] = (1.0, 1.0)  # factors at the (pessimistic, optimistic) end of the range

    def on(self, gpu: str, case: str = "expected") -> float:
        """The rate on `gpu` in base units (FLOP/s, bytes/s, seconds, bytes or a number) at `case`'s end of
        the range (`CASES`)."""
        scale = {"TFLOP/s": 1e12, "TB/s": 1e12, "GB/s": 1e9, "us": 1e-6, "GiB": 2**30, "x": 1.0}[self.unit]
        factor = {"low": self.spread[0], "expected": 1.0, "high": self.spread[1]}[case]
        return getattr(self, gpu) * scale * factor


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
        "gemm_bf16",
        "dense bf16 GEMM (cuBLAS)",
        1745,
        794.5,
        794.5,
        "TFLOP/s",
        f"{MAMF} (bf16; H200 = H100); the best shape's: our shapes (M 32k, K and N 512-16k) down to 85%",
        (0.85, 1.0),
    ),
    Rate(
        "gemm_fp8",
        "dense fp8 GEMM (torch._scaled_mm)",
        3432.5,
        1453.4,
        1402.6,
        "TFLOP/s",
        f"{MAMF} (fp8); down to 85% as bf16's",
        (0.85, 1.0),
    ),
    Rate(
        "gemm_tf32",
        "dense tf32 GEMM (only where the code enables TF32; genomelm does not)",
        872,
        397,
        397,
        "TFLOP/s",
        "estimate: half the bf16 MAMF (TF32's dense peak is half bf16's)",
        (0.85, 1.0),
    ),
    Rate(
        "gemm_fp32",
        "fp32 matmul on CUDA cores (no TF32)",
        60,
        54,
        54,
        "TFLOP/s",
        "estimate: 80% of the datasheet fp32 (75 / 67 / 67), the share MAMF measures for bf16; 60-90%",
        (0.75, 1.12),
    ),
    Rate(
        "grouped_gemm_bf16",
        "routed experts' grouped GEMM (torch._grouped_mm; 4096 x 1536 and back; per 8,192-token chunk ~230 "
        "rows per expert from each rank: 8,192 x top-8 / 288, ~455 at a local expert of ep 2)",
        450,
        198,
        198,
        "TFLOP/s",
        "20% of the dense bf16 peak, 16-24%: torch._grouped_mm at small MoE widths and a few hundred to 2k "
        "rows per expert reaches 18-24% of H100's peak (ByteDance-Seed/VeOmni PR 460: 242 TFLOP/s at hidden "
        "2048 / FFN 768 / ~2k rows, 181 at FFN 512; pytorch/pytorch issue 163425 on DeepSeek-V3 shapes); the "
        "large balanced groups of pytorch PRs 156203 / 170802 (1,313 TFLOP/s on B200) are not our shape",
        (0.8, 1.2),
    ),
    Rate(
        "sparse_mla_fwd",
        "sparse MLA forward (our Triton kernel: gathered top-k latent rows, 64 heads sharing them)",
        271,
        119,
        119,
        "TFLOP/s",
        "meta-pytorch/attention-gym PR 239: a Triton selected-attention (top-k gathered keys) forward, "
        "270.86 TFLOP/s on B200 (80 before its tuning: pessimistic half); H200 / H100 scaled by the bf16 "
        "peaks; optimistic: half the best CUDA kernel's (deepseek-ai/FlashMLA sparse prefill: 1,450 on "
        "B200, 640 on H800)",
        (0.5, 2.67),
    ),
    Rate(
        "sparse_mla_bwd",
        "sparse MLA backward (our Triton kernel; its fp32 atomic adds into d latent at the atomics rate)",
        262,
        115,
        100,
        "TFLOP/s",
        "tile-ai/tilelang examples/deepseek_v32 README: a DSL (not library) sparse_mla_bwd at ~100 TFLOP/s "
        "on H800, ~115 on H200; B200 scaled by the bf16 peaks (2,250 / 989); pessimistic: no gain over "
        "H200 on B200 (0.44); optimistic: half the SM100 CuTe kernel's 820 (Dao-AILab/flash-attention PR "
        "2621)",
        (0.44, 1.56),
    ),
    Rate(
        "indexer",
        "lightning indexer scores (our Triton kernel, bf16)",
        872,
        397,
        397,
        "TFLOP/s",
        "assumption, nothing public measures an indexer kernel: half the bf16 MAMF (a Triton GEMM whose "
        "ReLU-weighted reduction over 32 heads is its epilogue), 30-70% of it",
        (0.6, 1.4),
    ),
    Rate(
        "kda_fwd",
        "fla chunk_kda forward (64 heads x 128, bf16)",
        71,
        54,
        54,
        "TFLOP/s",
        "inclusionAI/cuLA BENCHMARK_H200.md (fla 0.5.0): 6.94 ms for 2 x 16,384 tokens, BENCHMARK.md GB200: "
        "5.33 ms, as TFLOP/s by kda_chunk.chunk_kda_flops; H100 taken as H200 (same SMs); +-15% for our "
        "fla and shapes",
        (0.85, 1.15),
    ),
    Rate(
        "kda_bwd",
        "fla chunk_kda backward (its FLOPs reckoned at twice the forward's)",
        46,
        35,
        35,
        "TFLOP/s",
        "inclusionAI/cuLA PR 54 (SM10x): forward + backward 10.9 ms at 16,384 tokens, 64 heads: the backward "
        "~3.1x the forward's time; H200 and H100 the forward's rate x 2 / 3.1; +-15%",
        (0.85, 1.15),
    ),
    Rate(
        "memory",
        "memory-bound kernels (elementwise, copies, norms): HBM attained",
        6.52,
        4.3,
        3.01,
        "TB/s",
        "NVIDIA/cutlass PR 2917 (CuTe RMSNorm on B200: 6,517 GB/s); Dao-AILab/quack blog (softmax on H100: "
        "3.01 TB/s, 90%); H200 estimated at 90% of 4.8. Eager PyTorch kernels fall below these: to 75%",
        (0.75, 1.0),
    ),
    Rate(
        "atomics",
        "fp32 atomic adds into rows scattered over a buffer (the sparse MLA backward's d latent), bytes "
        "read-modify-written",
        6.08,
        3.65,
        2.54,
        "TB/s",
        "pytorch/FBGEMM PR 3993: scatter_add along the first dim (row-wise fp32 atomics) at 2,536 GB/s on "
        "H100, 76% of its HBM; B200 and H200 at 76% of theirs; pessimistic half (contention: neighbouring "
        "queries and several head blocks add into the same rows at once; pytorch/pytorch PR 182675), "
        "optimistic the memory rate",
        (0.5, 1.07),
    ),
    Rate(
        "topk_passes",
        "passes of torch.topk over its input (radix select, then the gather)",
        5,
        5,
        5,
        "x",
        "CUDA's radix top-k (pytorch/pytorch PR 71081, aten/src/ATen/native/cuda/TensorTopK.cu; its design "
        "as intel/torch-xpu-ops PR 3325 describes it: 8-bit digits, 4 passes for 32-bit keys, then the "
        "gather); "
        "optimistic 3 (passes hitting L2), pessimistic 9 (2-bit digits of the single-block path)",
        (1.8, 0.6),
    ),
    Rate(
        "launch",
        "one eager op: launch + PyTorch dispatch",
        7,
        7,
        7,
        "us",
        "flagos-ai/FlagGems issue 4812 (~7 us per eager tiny op); meta-pytorch/tritonbench PR 1017 (bare "
        "cuLaunchKernel 3.0 us on GB200: optimistic); pessimistic 10.5",
        (1.5, 0.43),
    ),
    Rate(
        "comm_sm_share",
        "compute slowed while a collective runs beside it (NCCL's kernels take SMs and HBM bandwidth)",
        0.1,
        0.1,
        0.1,
        "x",
        "assumption: NCCL runs one CTA per channel (up to 16-32 on NVLink + IB) of a B200's 148 SMs (H100's "
        "132), and its copies share HBM: the compute that overlaps a collective slowed 10%, 5-20%",
        (2.0, 0.5),
    ),
    Rate(
        "nvlink_ring",
        "NVLink all-gather / reduce-scatter / all-reduce bus bandwidth, 8 GPUs",
        720,
        360,
        360,
        "GB/s",
        "NVIDIA/nccl-tests issue 326 (8 x H100: ~360 GB/s busbw, 'exactly what we'd expect'); B200: NCCL's "
        "topology model maxBw 721.8 (NVIDIA/nccl issue 1807), an estimate; down to 85%",
        (0.85, 1.0),
    ),
    Rate(
        "nvlink_all_to_all",
        "NVLink all-to-all per GPU, 8 GPUs (expert dispatch / combine)",
        726,
        330,
        330,
        "GB/s",
        "deepseek-ai/DeepEP README v2: 726 GB/s on SM100, EP 8 (a ceiling for NCCL's all-to-all: down to "
        "70%); H100 and H200 estimated under the 380 GB/s one-way p2p NVIDIA/nccl issue 1264 measures",
        (0.7, 1.0),
    ),
    Rate(
        "nic_ring",
        "one 400 Gb/s NDR NIC in a ring across nodes",
        47,
        47,
        47,
        "GB/s",
        "NVIDIA/nccl-tests issue 290: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'; down to 40",
        (0.85, 1.02),
    ),
    Rate(
        "nic_all_to_all",
        "one 400 Gb/s NIC in an all-to-all across nodes (RDMA)",
        50,
        50,
        50,
        "GB/s",
        "deepseek-ai/DeepEP docs/legacy.md (H800, CX7): 43 / 58 / 51 GB/s per GPU at EP 16 / 32 / 64",
        (0.86, 1.16),
    ),
    Rate(
        "pcie",
        "PCIe Gen5 x16 per direction: host copies (pinned), and GPU-direct NIC traffic through the same "
        "switch port",
        50,
        50,
        50,
        "GB/s",
        "NVIDIA/nvbandwidth issue 24 (H100: device-to-host 52.8, host-to-device 35.2 GB/s by SM copy: "
        "pessimistic); copy-engine pinned ~55 (optimistic); Gen5 x16 ~63 raw",
        (0.7, 1.1),
    ),
    Rate(
        "host_memory",
        "host DRAM bandwidth of one node (two sockets), shared by its GPUs' host work",
        430,
        430,
        430,
        "GB/s",
        "estimate, no measured STREAM of a DGX host found: DGX H100's 16 channels of DDR5-4800 (614 GB/s) at "
        "the ~70% STREAM reaches on such hosts (50-85%); DGX B200's host taken as the same",
        (0.7, 1.2),
    ),
    Rate(
        "context_gib",
        "device memory outside PyTorch's allocator: the CUDA context, cuBLAS / NCCL workspaces and buffers",
        4.5,
        4.5,
        4.5,
        "GiB",
        "assumption, 3-6 GiB: the CUDA context and module images (~0.5-1 GiB), cuBLAS workspaces, NCCL's "
        "buffers (NCCL_BUFFSIZE 4 MiB x channels x peers, per communicator: the run has several)",
        (1.33, 0.67),
    ),
    Rate(
        "fragmentation",
        "allocator fragmentation: reserved over allocated bytes at the peak, less one",
        0.06,
        0.06,
        0.06,
        "x",
        "assumption, 3-12%: PyTorch's caching allocator rounds and splits blocks, and GB-sized transients "
        "(7-15 GB MoE and FSDP buffers) leave holes that expandable_segments only partly closes",
        (2.0, 0.5),
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

    def ring_bytes_per_s(self, ranks: int, sharing: int = 1) -> float:
        """A ring collective over `ranks` ranks: NVLink inside a node; across nodes, the NICs of each node
        (a group of consecutive ranks fills every node it spans but the last), at most NVLink's, shared by
        the `sharing` groups that run the same collective on each node at once (every ep-th rank's expert
        group: ep of them on a node, all through its NICs)."""
        if ranks <= self.gpus_per_node:
            return self.nvlink_ring
        return min(self.nvlink_ring, self.nic * self.nics_per_node / max(sharing, 1))

    def seconds(self, kind: str, moved: float, ranks: int, sharing: int = 1) -> float:
        """Seconds for one rank to move `moved` bytes in a collective of `kind` over `ranks` ranks: an
        all-to-all (`all_to_all_seconds`), else a ring (`ring_bytes_per_s`, `sharing` groups per node)."""
        if ranks <= 1:
            return 0.0
        if kind == "all_to_all":
            return self.all_to_all_seconds(moved, ranks)
        return moved / self.ring_bytes_per_s(ranks, sharing)

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


TORCHAO_MOE = "pytorch/ao torchao/prototype/moe_training README"
# The routed experts' grouped GEMM under `expert_precision` (fp8_rowwise, mxfp8): its kernel's speed-up over
# torch._grouped_mm in bf16 at our shape, the `grouped_gemm_bf16` rate times it; the operands' quantisation
# and alignment copies are counted apart (`genomelm.plan.timing.expert_quantisation`), as the published
# fwd + bwd figures amortise them over 16k+ rows per expert where ours have ~455. A GPU without the kernel: 0.
EXPERT_GEMM_GAINS: dict[str, Rate] = {
    "mxfp8": Rate(
        "grouped_gemm_mxfp8",
        "routed experts' grouped GEMM in MXFP8 (torchao `_to_mxfp8_then_scaled_grouped_mm`), over bf16's",
        1.15,
        0.0,
        0.0,
        "x",
        f"{TORCHAO_MOE}: fwd + bwd over bf16 torch._grouped_mm on B200 1.15-1.3x at DeepSeek-V3 671B "
        "shapes, 1.4-1.8x at Llama 4's; at M 128,000, N 2,048, K 7,168: 1.045x with 1 group, 1.51x with 2, "
        "1.42x with 4, 1.37x with 8; torchao's MXFP8 expert parallel training tutorial: +10% tokens/s on "
        "one 8 x B200 node (DeepSeek-V3 16B), +25% across nodes. Our groups are small (~455 rows per local "
        "expert per chunk): 1.15x, 1.0-1.3x. Blackwell only (no kernel on H100 / H200)",
        (1.0 / 1.15, 1.3 / 1.15),
    ),
    "fp8_rowwise": Rate(
        "grouped_gemm_fp8_rowwise",
        "routed experts' grouped GEMM in FP8 rowwise (torchao `_to_fp8_rowwise_then_scaled_grouped_mm`), "
        "over bf16's",
        1.1,
        1.1,
        1.1,
        "x",
        "assumption: no public grouped-GEMM figure; dense torchao float8 rowwise training gives +10.5% "
        "tokens/s on Llama 3 8B on 8 x H100 (pytorch/ao PR 1793): 1.1x, 1.0-1.25x",
        (1.0 / 1.1, 1.25 / 1.1),
    ),
}


def expert_gemm_gain(precision: str, gpu: str, case: str = "expected") -> float:
    """The expert grouped GEMM's speed-up under `precision` on `gpu` at `case`'s end (`EXPERT_GEMM_GAINS`;
    bf16: 1); ValueError where the GPU has no kernel for it."""
    if precision == "bf16":
        return 1.0
    gain = EXPERT_GEMM_GAINS[precision].on(gpu, case)
    if gain <= 0:
        raise ValueError(
            f"expert_precision={precision} has no kernel on {gpu} (MXFP8 needs a Blackwell GPU): set "
            "expert_precision=fp8_rowwise or bf16"
        )
    return gain


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
    atomics: float = 0.0  # bytes/s of scattered fp32 atomic adds (read-modify-write)
    topk_passes: float = 1.0  # passes of a top-k over its input
    comm_sm_share: float = 0.0  # the slowdown of compute that overlaps a collective
    case: str = "expected"  # the end of the range these rates are (`CASES`)

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
    case: str = "expected",
) -> Peaks:
    """`gpu`'s attainable rates from `RATES` at `case`'s end of the range (`CASES`); the links overridden
    where given (GB/s, NVLink's ring and all-to-all alike: as given, at every end)."""
    if gpu not in GPU_KINDS:
        raise ValueError(f"gpu must be one of {list(GPU_KINDS)}, not {gpu!r}")
    if case not in CASES:
        raise ValueError(f"case must be one of {list(CASES)}, not {case!r}")
    values = {row.key: row.on(gpu, case) for row in RATES}
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
        atomics=values["atomics"],
        topk_passes=values["topk_passes"],
        comm_sm_share=values["comm_sm_share"],
        case=case,
    )


def rates_table() -> str:
    """`DATASHEET` and `RATES` as markdown tables (docs/planner.md's)."""
    rows = ["| op class | B200 | H200 | H100 | unit | range (x) | source |", "|---|---|---|---|---|---|---|"]
    rows += [
        f"| {r.what} | {r.b200:g} | {r.h200:g} | {r.h100:g} | {r.unit} | {r.spread[0]:g} - {r.spread[1]:g} | "
        f"{r.source} |"
        for r in RATES
    ]
    rows += ["", "| datasheet peak (MFU's denominator only) | B200 | H200 | H100 | unit | source |"]
    rows += ["|---|---|---|---|---|---|"]
    rows += [
        f"| {r.what} | {r.b200:g} | {r.h200:g} | {r.h100:g} | {r.unit} | {r.source} |" for r in DATASHEET
    ]
    return "\n".join(rows)
