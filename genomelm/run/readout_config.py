"""The settings groups of the evaluation and the read-outs, part of the run configuration
(`genomelm.run.config`): `eval` and `probe` (`genomelm eval`, `genomelm probe`, held-out eval during
training), `track`, `variants` and `embed` (the genomics read-outs). Each checks its own values."""

from __future__ import annotations

from dataclasses import dataclass

from genomelm.run.setting_checks import check_choice, require

VARIANT_POSITIONS = ("end", "center")
EMBED_POOLS = ("mean", "base")
EMBED_DTYPES = ("fp32", "bf16")


@dataclass
class EvalConfig:
    """`genomelm eval`: held-out loss per position bucket."""

    bucket: int = 32768  # tokens per position bucket
    eval_windows: int = 0  # held-out windows to score (0 = all)
    # score only held-out windows whose last bucket predicts at least this share of far-copy bases (a fact of
    # the sequence: genomelm.data.far_copy), where long context can pay; 0: every window
    eval_far_copies: float = 0.0
    context_cut: bool = True  # also score the last bucket with only the preceding bucket as context
    heldout: str | None = None  # prepared folders to evaluate, comma separated (default: the run's data)
    eval_every: int = (
        0  # during training: score `eval_windows` held-out windows every this many steps (0: off)
    )

    def validate(self) -> None:
        require(self.bucket >= 1, f"bucket={self.bucket}: give tokens per bucket >= 1")
        require(self.eval_windows >= 0, f"eval_windows={self.eval_windows}: give windows >= 0 (0 = all)")
        require(
            0 <= self.eval_far_copies <= 1,
            f"eval_far_copies={self.eval_far_copies}: give a share of bases in [0, 1] (0: every window)",
        )
        require(
            self.eval_every >= 0, f"eval_every={self.eval_every}: give steps >= 0 (0: no eval in training)"
        )


@dataclass
class TrackConfig:
    """`genomelm track`: per-base loss tracks (bigWig, bedGraph) of held-out windows or regions."""

    context_cut_tokens: int = 0  # the long-context gain's short context, tokens (0: the bucket size)
    track_bin: int = 1  # bases averaged per track value (1: per base)

    def validate(self) -> None:
        require(self.context_cut_tokens >= 0, f"context_cut_tokens={self.context_cut_tokens}: give >= 0")
        require(self.track_bin >= 1, f"track_bin={self.track_bin}: give bases per value >= 1")


@dataclass
class VariantConfig:
    """`genomelm variants`: zero-shot variant effects of a VCF's records."""

    vcf: str | None = None  # the VCF (.vcf or .vcf.gz) to score
    fasta: str | None = None  # the reference (any format `genomelm data` reads); default: the run's source
    variant_context: int = 0  # tokens of the window scored around each variant (0: the run's SEQ)
    variant_position: str = "end"  # where the variant sits in its window: "end" or "center"
    skip_mismatch: bool = False  # count and list REF alleles that differ from the reference, not stop
    contig_map: str | None = None  # a two-column file: VCF contig name, reference record name

    def validate(self) -> None:
        check_choice("variant_position", self.variant_position, VARIANT_POSITIONS)
        require(self.variant_context >= 0, f"variant_context={self.variant_context}: give tokens >= 0")


@dataclass
class EmbedConfig:
    """`genomelm embed`: hidden states of held-out windows or regions."""

    embed_layer: int = -1  # decoder layer whose output is taken (-1: the last, as the head sees it)
    embed_pool: str = "mean"  # "mean" (one vector per window or region) or "base" (one per base)
    embed_dtype: str = "fp32"  # "fp32" or "bf16"

    def validate(self) -> None:
        check_choice("embed_pool", self.embed_pool, EMBED_POOLS)
        check_choice("embed_dtype", self.embed_dtype, EMBED_DTYPES)


@dataclass
class ProbeConfig:
    """`genomelm probe`: the copy probe."""

    probe_length: int = 200  # bases per planted segment
    probe_distances: str = "1k,4k,16k,64k,256k,1M"  # distances from the first copy to the second (<= seq)
    probe_windows: int = 4  # held-out windows probed (0 = all)

    def validate(self) -> None:
        require(self.probe_length >= 2, f"probe_length={self.probe_length}: give at least 2 bases")
        require(self.probe_windows >= 0, f"probe_windows={self.probe_windows}: give windows >= 0 (0 = all)")
