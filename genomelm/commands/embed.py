"""`genomelm embed CONFIG [key=value ...] [--before PATH | --after PATH]`: hidden states of held-out windows
or regions (`genomelm.eval.embed`), written to safetensors with their coordinates."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from genomelm.commands.scoring import check_scoring, parse_run_args
from genomelm.eval.embed import (
    INDEX,
    SET,
    TENSORS,
    EmbedError,
    Request,
    create_part,
    embed_on_rank,
    prepare_request,
    write_embeddings,
)
from genomelm.parallel.launch import is_output_rank
from genomelm.run.config import TrainConfig
from genomelm.run.failures import report_failure
from genomelm.run.launchers import on_rank_zero, on_ranks
from genomelm.run.models import model_pair

PROG = "genomelm embed"


def embed(config: TrainConfig, model: str, role: str) -> tuple[Request, dict[str, Path]]:
    """`genomelm embed`: check the inputs (nothing written on a bad one), run the forward (on the mesh with
    dp, cp or ep above 1), write the set into results/<run>/embeddings/. Returns the request and the files."""
    request = prepare_request(config, model, role)
    folder = config.results_path / SET
    # the context cut is eval's: nothing here scores it, so its window length is not checked
    scoring = config.replace(context_cut=False)
    check_scoring(scoring)  # before the part file: a refused run writes nothing
    if config.embed.embed_pool == "base":
        request = on_rank_zero(config, functools.partial(create_part, folder, config, request))
    try:
        result = on_ranks(embed_on_rank, scoring, request)
        if not is_output_rank():  # launcher=env: rank 0 writes the set
            return request, {}
        print(f"  {result['seconds']:.1f} s", flush=True)
        paths = write_embeddings(folder, config, request, result["embedding"])
    finally:
        if request.part is not None and is_output_rank():
            Path(request.part).unlink(missing_ok=True)  # moved into the set, or a failed run's
    return request, paths


def parse_args(argv: list[str]):
    return parse_run_args(
        argv,
        prog="genomelm embed",
        description="Hidden states of held-out windows or regions (safetensors), of the model after "
        "training (--after, default: the newest checkpoint) or before it (--before PATH).",
        epilog="example: genomelm embed configs/train/demo.yaml region=NC_004353.4:1000001-1010000 "
        "embed_pool=base",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = TrainConfig.from_args(([args.config] if args.config else []) + args.overrides)
        if args.before and args.after:
            raise EmbedError("give --after PATH or --before PATH, not both: one model is embedded per run")
        role = "before" if args.before else "after"
        model = args.before or args.after or model_pair(config)[1]
        request, paths = embed(config, model, role)
    except Exception as exc:  # noqa: BLE001 - every failure is one line with its exit status
        return report_failure(PROG, exc)
    if not paths:  # launcher=env, a rank other than 0
        return 0
    pool = config.embed.embed_pool
    what = (
        f"[{len(request.items)}, {request.width}]"
        if pool == "mean"
        else f"{len(request.items)} x [bases, {request.width}]"
    )
    print(
        f"\n{len(request.items)} item(s), layer {request.layer} of {request.layers} (embed_layer="
        f"{config.embed.embed_layer}), {'mean over A/C/G/T bases' if pool == 'mean' else 'per base'}, "
        f"{config.embed.embed_dtype} {what}"
    )
    print(f"wrote {paths[TENSORS]} and {paths[INDEX]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
