"""Command-line entry point: ``genomelm {data,train,eval,probe,track,variants,embed,plan,export} ...``.

Each stage owns its argument parsing in ``genomelm.<stage>.command.main(argv)``; this module only
dispatches, and imports a stage lazily so ``genomelm data`` never pays for importing torch models.
"""

from __future__ import annotations

import importlib
import sys

STAGES = {
    "data": ("genomelm.data.command", "FASTA or hg38 chromosomes -> token windows"),
    "train": ("genomelm.train.command", "fine-tune the model on prepared windows"),
    "eval": ("genomelm.eval.command", "held-out loss per position bucket, before and after training"),
    "probe": ("genomelm.eval.probe", "copy probe: how far back the model retrieves a copied segment"),
    "track": (
        "genomelm.eval.tracks",
        "per-base loss tracks (bigWig, bedGraph) before/after, long-context gain",
    ),
    "variants": ("genomelm.eval.variants", "zero-shot variant effects of a VCF: log-likelihood ratios"),
    "embed": ("genomelm.eval.embed", "hidden states of windows or regions (safetensors, npy)"),
    "plan": (
        "genomelm.train.plan_command",
        "will a run fit the GPUs, and how fast: traced from the real code",
    ),
    "export": (
        "genomelm.parallel.export",
        "sharded training checkpoint -> Hugging Face folder, layer by layer",
    ),
}


def usage() -> str:
    lines = ["usage: genomelm <stage> [options]", "", "stages:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in STAGES.items()]
    lines.append("\n`genomelm <stage> --help` shows a stage's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"genomelm: unknown stage {stage!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(STAGES[stage][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
