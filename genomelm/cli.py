"""Command-line entry point: ``genomelm {data,train,eval,probe,track,variants,embed,plan,export} ...``.

Each stage owns its argument parsing in ``genomelm.commands.<stage>.main(argv)``; this module only
dispatches, and imports a stage lazily so ``genomelm data`` never pays for importing torch models. A failure a
stage does not report itself still ends as one line and an exit status (`genomelm.run.failures`); with
``--debug`` anywhere on the command line (or GENOMELM_DEBUG=1) its traceback is printed too.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

STAGES = {
    "data": ("genomelm.commands.data", "FASTA or hg38 chromosomes -> token windows"),
    "train": ("genomelm.commands.train", "fine-tune the model on prepared windows"),
    "eval": ("genomelm.commands.eval", "held-out loss per position bucket, before and after training"),
    "probe": ("genomelm.commands.probe", "copy probe: how far back the model retrieves a copied segment"),
    "track": (
        "genomelm.commands.track",
        "per-base loss tracks (bigWig, bedGraph) before/after, long-context gain",
    ),
    "variants": ("genomelm.commands.variants", "zero-shot variant effects of a VCF: log-likelihood ratios"),
    "embed": ("genomelm.commands.embed", "hidden states of windows or regions (safetensors, npy)"),
    "plan": (
        "genomelm.commands.plan",
        "will a run fit the GPUs, and how fast: traced from the real code",
    ),
    "export": (
        "genomelm.commands.export",
        "sharded training checkpoint -> Hugging Face folder, layer by layer",
    ),
}


def usage() -> str:
    lines = ["usage: genomelm <stage> [options]", "", "stages:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in STAGES.items()]
    lines.append("\n`genomelm <stage> --help` shows a stage's options; --debug prints a failure's traceback.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [arg for arg in argv if arg != "--debug"]
        os.environ["GENOMELM_DEBUG"] = "1"  # the ranks a stage launches inherit it
    if os.environ.get("GENOMELM_DEBUG", "") in ("", "0"):
        from genomelm.run.failures import one_line_warning

        warnings.formatwarning = one_line_warning
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"genomelm: unknown stage {stage!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(STAGES[stage][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        print(f"genomelm {stage}: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last place a failure becomes one line, not a traceback
        from genomelm.run.failures import report_failure

        return report_failure(f"genomelm {stage}", exc)


if __name__ == "__main__":
    sys.exit(main())
