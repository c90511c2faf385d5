"""`genomelm export` (sharded DCP checkpoint -> Hugging Face folder) and `load_rank_shard` (a Hugging Face
folder -> this rank's part of a sharded model), on checkpoints written by 2 gloo ranks with FSDP2."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from genomelm.cli import main as cli_main
from genomelm.model import load_model, save_model
from genomelm.model.checkpoint import INDEX_FILE, hf_config_dict
from genomelm.model.hf_names import official_tensors
from genomelm.parallel import launch
from genomelm.parallel.export import ExportError, export_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CODES = {"A": 1, "C": 2, "G": 3, "T": 4}
TIMEOUT_S = 120
STEP = "step-0000004"


def reference_model() -> torch.nn.Module:
    """The `tiny` preset with every tensor randomised (no ones and zeros to hide mix-ups), fp32."""
    from model_helpers import randomise_

    torch.manual_seed(0)
    model = load_model("tiny")
    randomise_(model, seed=0)
    return model


def fly_ids(length: int) -> torch.Tensor:
    """[1, S] token ids of real fly DNA (chr4 from 300 kb)."""
    from Bio import SeqIO

    with gzip.open(ROOT / "data" / "dmel_chr4.fa.gz", "rt") as handle:
        bases = str(next(SeqIO.parse(handle, "fasta")).seq[300_000 : 300_000 + length]).upper()
    return torch.tensor([[CODES.get(b, 5) for b in bases]])


def save_on_rank(step_dir: str, weights: dict[str, torch.Tensor]) -> None:
    """Shard `tiny` holding `weights` with FSDP2 over the group, take an optimizer step with lr 0 (so there is
    optimizer state) and save model and optimizer with DCP, as training does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from genomelm.parallel.launch import is_output_rank

    model = load_model("tiny")
    model.load_state_dict(weights)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    state = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
    state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=f"{step_dir}/state")
    if is_output_rank():
        (Path(step_dir) / "config.json").write_text(json.dumps(hf_config_dict(model.config, torch.float32)))
        torch.save({"step": 4}, Path(step_dir) / "trainer.pt")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A run folder whose newest complete checkpoint was written by 2 FSDP2 ranks (plus an older
    incomplete save that export must skip)."""
    run = tmp_path_factory.mktemp("run")
    (run / "checkpoints" / "step-0000009" / "state").mkdir(parents=True)  # no .metadata: interrupted
    (run / "checkpoints" / ".tmp-step-0000010").mkdir()
    launch(
        save_on_rank, 2, str(run / "checkpoints" / STEP), reference_model().state_dict(), timeout_s=TIMEOUT_S
    )
    return run


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# ------------------------------------------------------------------------------------------------- export
def test_export_fp32_equals_the_model_and_transformers_agrees(sharded_run, tmp_path, capsys):
    from transformers import Glm5NextForConditionalGeneration

    out = tmp_path / "hf"
    assert (
        cli_main(["export", str(sharded_run), str(out), "--dtype", "fp32", "--max-shard-bytes", "20000"]) == 0
    )
    assert f"checkpoints/{STEP}" in capsys.readouterr().out
    shards = sorted(path.name for path in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left

    want = reference_model()
    ours = load_model(out).eval()
    assert_same_tensors(ours.state_dict(), want.state_dict())

    theirs = Glm5NextForConditionalGeneration.from_pretrained(out).eval()
    ids = fly_ids(192)
    with torch.no_grad():
        logits = theirs(input_ids=ids).logits[:, :-1].float()
    their_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(ours.token_logprobs(ids), their_logprobs, rtol=0, atol=1e-4)
    assert their_logprobs.mean() < -0.5  # a live model, not one that predicts everything perfectly


def test_export_bf16_by_default_keeps_the_fp32_parameters(sharded_run, tmp_path):
    from safetensors import safe_open

    step = sharded_run / "checkpoints" / STEP
    out = tmp_path / "hf16"
    assert export_checkpoint(step, out) == step
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    got = load_model(out, dtype=torch.bfloat16).state_dict()
    want = reference_model().state_dict()
    fp32 = {name for name, tensor in got.items() if tensor.dtype == torch.float32}
    assert {
        "layers.1.mlp.gate.weight",
        "layers.1.mlp.gate.e_score_correction_bias",
        "layers.0.attn_hc.base",
        "layers.0.self_attn.conv1d.weight",
    } <= fp32
    assert got["embed_tokens.weight"].dtype == torch.bfloat16
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), name
    # on disk too: the router stays fp32, the experts are bf16
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    dtypes = {}
    for key in (
        "model.language_model.layers.1.mlp.gate.weight",
        "model.language_model.layers.1.mlp.experts.3.up_proj.weight",
    ):
        with safe_open(out / weight_map[key], framework="pt") as handle:
            dtypes[key.split(".")[-2]] = handle.get_tensor(key).dtype
    assert dtypes == {"gate": torch.float32, "up_proj": torch.bfloat16}
    from transformers import Glm5NextForConditionalGeneration

    theirs = Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(theirs.lm_head.weight, want["lm_head.weight"].to(torch.bfloat16))


def test_export_errors_name_the_folder_and_the_fix(sharded_run, tmp_path, capsys):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert cli_main(["export", str(empty), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "holds no complete checkpoint" in err and str(empty) in err

    old = tmp_path / "old-run" / "checkpoints" / "step-0000002"
    save_model(load_model("tiny"), old / "model")
    (old / "trainer.pt").write_bytes(b"")
    with pytest.raises(ExportError, match=rf"already in Hugging Face layout at {old / 'model'}"):
        export_checkpoint(tmp_path / "old-run", tmp_path / "out")
    with pytest.raises(ExportError, match="already in Hugging Face layout"):
        export_checkpoint(old, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["export", str(sharded_run), str(out)]) == 2
    assert "force=true" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert cli_main(["export", str(sharded_run), str(out), "force=true"]) == 0
    assert not (out / "keep.txt").exists() and (out / INDEX_FILE).exists()


def test_export_refuses_a_checkpoint_that_lacks_tensors(sharded_run, tmp_path):
    step = tmp_path / "run" / "checkpoints" / STEP
    step.mkdir(parents=True)
    (step / "state").symlink_to(sharded_run / "checkpoints" / STEP / "state")
    raw = json.loads((sharded_run / "checkpoints" / STEP / "config.json").read_text())
    raw["text_config"]["attention_bias"] = True  # the config asks for biases the checkpoint does not hold
    (step / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ExportError, match=r"missing \d+ tensor\(s\) \['model\.layers\.3\.self_attn\..*bias"):
        export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------------------------------- load_rank_shard
def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    from genomelm.model.moe import Experts

    return [module for module in model.modules() if isinstance(module, Experts)]


def slice_experts_(model: torch.nn.Module, held: range) -> None:
    """Expert parallelism as `genomelm.parallel.expert` lays it out: each `Experts` keeps the rows `held` (an
    `ExpertShard` without a process group: only the layout matters to loading)."""
    from genomelm.parallel.expert import ExpertShard

    for module in experts_of(model):
        module.expert_shard = ExpertShard(None, 1, 0, module.num_experts, held)
        for leaf in ("gate_up_proj", "down_proj"):
            full = getattr(module, leaf)
            shape = (len(held), *full.shape[1:])
            setattr(module, leaf, torch.nn.Parameter(torch.empty(shape, dtype=full.dtype, device="meta")))


def load_on_rank(folder: str, held: range | None) -> torch.nn.Module:
    """`tiny` built on meta (with `held`: each `Experts` keeps only those experts, the same on every rank, as
    the ranks of one expert-parallel slot), FSDP2-sharded over the group, allocated, this rank's part
    loaded."""
    from torch.distributed.fsdp import fully_shard

    from genomelm.model import GlmForCausalLM, ModelConfig
    from genomelm.parallel.rank_loading import load_rank_shard

    model = GlmForCausalLM.from_config(ModelConfig.preset("tiny"), device="meta")
    if held is not None:
        slice_experts_(model, held)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    load_rank_shard(model, folder)
    return model


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict, whole (DTensors gathered from all ranks)."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    assert isinstance(state["layers.1.mlp.experts.gate_up_proj"], DTensor)
    return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in state.items()}


def load_both_on_rank(
    folder: str, held: range, ids: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """(whole model's tensors, expert-sliced model's tensors, the whole model's FSDP2 log-probs of `ids`)."""
    model = load_on_rank(folder, None)
    return gathered(model), gathered(load_on_rank(folder, held)), model.token_logprobs(ids)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    save_model(reference_model(), folder, max_shard_bytes=20_000)
    return folder


def test_load_rank_shard_under_fsdp2_equals_the_whole_model(hf_folder):
    """Rank 1 holds rows 2..3 of the FSDP2 shard of experts 2..5: it must read experts 4 and 5. The loaded
    FSDP2 model also runs: its log-probabilities on fly DNA equal the single-process model's."""
    reference = reference_model()
    want = reference.state_dict()
    held = range(2, 6)
    sliced = want | {n: t[2:6] for n, t in want.items() if ".mlp.experts." in n}
    ids = fly_ids(128)
    results = launch(load_both_on_rank, 2, str(hf_folder), held, ids, timeout_s=TIMEOUT_S)
    for whole, expert_parallel, logprobs in results:
        assert_same_tensors(whole, want)
        assert_same_tensors(expert_parallel, sliced)
        torch.testing.assert_close(logprobs, reference.token_logprobs(ids), rtol=0, atol=1e-5)


def test_load_rank_shard_reads_only_the_held_experts(hf_folder, monkeypatch):
    from genomelm.model import GlmForCausalLM, ModelConfig
    from genomelm.model.checkpoint import CheckpointReader
    from genomelm.parallel.rank_loading import load_rank_shard

    asked: list[list[int] | None] = []
    read = CheckpointReader.read

    def recording_read(self, names, experts=None, dtypes=None):
        if any(".experts." in name for name in names):
            asked.append(experts)
        return read(self, names, experts, dtypes)

    monkeypatch.setattr(CheckpointReader, "read", recording_read)
    model = GlmForCausalLM.from_config(ModelConfig.preset("tiny"), dtype=torch.bfloat16, device="meta")
    slice_experts_(model, range(5, 8))
    model.to_empty(device="cpu")
    load_rank_shard(model, hf_folder)
    want = reference_model().state_dict()
    for name, tensor in model.state_dict().items():
        expected = want[name][5:8] if ".mlp.experts." in name else want[name]
        assert torch.equal(tensor, expected.to(tensor.dtype)), name
    assert asked == [[5, 6, 7]] * 2 * len(experts_of(model))


def save_and_load_with_the_trainer_on_rank(run_dir: str, weights: dict[str, torch.Tensor], hf: str) -> bool:
    """The trainer's own layout (dp=2, ep=2: each rank its 4 experts, FSDP2 over the rest): `save_sharded` the
    model holding `weights` into the run folder `run_dir`; then build `tiny` on meta, split it the same way
    and `load_rank_shard` it from
    `hf`. Whether every local shard equals the saved model's."""
    from torch.distributed.tensor import DTensor

    from genomelm.model import GlmForCausalLM, ModelConfig
    from genomelm.parallel.checkpoint import Checkpointer
    from genomelm.parallel.mesh import ParallelDims
    from genomelm.parallel.rank_loading import load_rank_shard
    from genomelm.parallel.training import ParallelRun

    run = ParallelRun.from_environment(ParallelDims(dp=2, ep=2), "zigzag", True, "cpu")
    model = load_model("tiny")
    model.load_state_dict(weights)
    run.prepare(model, None, 8.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    Checkpointer(run_dir).save(4, model, optimizer, {"step": 4}, run.mesh, keep=2)
    loaded = GlmForCausalLM.from_config(ModelConfig.preset("tiny"), device="meta")
    run.prepare(loaded, None, 8.0)
    loaded.to_empty(device="cpu")
    load_rank_shard(loaded, hf)

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    return all(
        torch.equal(local(a), local(b))
        for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True)
    )


@pytest.mark.slow
def test_export_and_rank_loading_with_the_trainers_expert_parallel_layout(hf_folder, tmp_path):
    want = reference_model().state_dict()
    run = tmp_path / "run"
    assert launch(
        save_and_load_with_the_trainer_on_rank, 2, str(run), want, str(hf_folder), timeout_s=TIMEOUT_S
    ) == [True, True]
    export_checkpoint(run, tmp_path / "hf", torch.float32)
    assert_same_tensors(load_model(tmp_path / "hf").state_dict(), want)


# -------------------------------------------------------------------------------- the collective export
SHARD_BYTES = 20_000  # `tiny` in fp32 (340 kB) in 19 files; a layer's fused experts (32 kB) span two or three


def export_on_rank(step: str, out: str) -> tuple[list[str], list[str]]:
    """(files this rank wrote, internal tensors it read from DCP) of the collective fp32 export."""
    from genomelm.parallel import export

    read: list[str] = []
    read_group = export._read_group

    def recording_read(state_dir, expected, names, stored):
        read.extend(names)
        return read_group(state_dir, expected, names, stored)

    export._read_group = recording_read  # this rank's process only
    files = export.export_checkpoint_collective(step, out, torch.float32, max_shard_bytes=SHARD_BYTES)
    return [path.name for path in files], read


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


@pytest.mark.parametrize(("world", "spanning"), [(2, 0), (3, 1), (4, 0)])
def test_collective_export_writes_the_one_process_files_each_rank_its_share(
    sharded_run, tmp_path, world, spanning
):
    """The same bytes in every file (index and config.json too) as `export_checkpoint`; each rank writes a
    contiguous run of the shards, about its share of the bytes, and reads only the tensors they hold. A tensor
    whose files two ranks write is read by both: at most world - 1 such (at 3 ranks a layer's fused experts
    span a rank boundary: at least `spanning`)."""
    step = sharded_run / "checkpoints" / STEP
    export_checkpoint(step, tmp_path / "one", torch.float32, max_shard_bytes=SHARD_BYTES)
    out = tmp_path / "many"
    results = launch(export_on_rank, world, str(step), str(out), timeout_s=TIMEOUT_S, collective_timeout_s=60)
    assert folder_bytes(out) == folder_bytes(tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "one"]  # no staging folder left

    written = [files for files, _ in results]
    assert written[0][-2:] == [INDEX_FILE, "config.json"]
    shards = [files[:-2] if rank == 0 else files for rank, files in enumerate(written)]
    assert [name for files in shards for name in files] == sorted(p.name for p in out.glob("*.safetensors"))
    sizes = [sum((out / name).stat().st_size for name in files) for files in shards]
    assert min(sizes) > sum(sizes) / world / 2

    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    files_of = {
        name: {weight_map[key] for key, _ in official_tensors(name, tensor)}
        for name, tensor in reference_model().state_dict().items()
    }
    for files, (_, read) in zip(shards, results, strict=True):
        assert sorted(read) == sorted(name for name, held in files_of.items() if held & set(files))
    readers = [sum(bool(held & set(files)) for files in shards) for held in files_of.values()]
    assert spanning <= sum(readers) - len(files_of) <= world - 1


def export_failing_on_rank(step: str, out: str, failing: int) -> str:
    """The collective export with rank `failing`'s disk full; what this rank raised ("type: message")."""
    import torch.distributed as dist

    from genomelm.parallel import export

    if dist.get_rank() == failing:

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        export.save_file = full_disk  # this rank's process only
    try:
        export.export_checkpoint_collective(step, out, torch.float32, max_shard_bytes=SHARD_BYTES)
    except Exception as exc:  # reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_collective_export_failing_on_one_rank_raises_on_all_and_leaves_nothing(sharded_run, tmp_path):
    """Rank 1's write fails after rank 0 wrote its files: both raise (rank 0 quoting rank 1's error), no rank
    waits, and neither OUT nor the staging folder is left."""
    step = sharded_run / "checkpoints" / STEP
    out = tmp_path / "hf"
    errors = launch(
        export_failing_on_rank, 2, str(step), str(out), 1, timeout_s=TIMEOUT_S, collective_timeout_s=60
    )
    assert errors[1] == "OSError: [Errno 28] No space left on device"
    assert errors[0].startswith(
        f"ExportError: the export to {out} failed, nothing was written: rank 1: OSError"
    )
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- training's export of its last step
@pytest.mark.parametrize(
    ("settings", "writes"),
    [
        ([], True),  # auto: one process
        (["dp=8"], True),  # auto: one node of 8 GPUs
        (["dp=2", "cp=8"], False),  # auto: 16 ranks, 2 nodes
        (["dp=4", "gpus_per_node=2"], False),
        (["launcher=ray", "dp=2"], True),  # a Ray started on this machine
        (["launcher=ray", "dp=2", "ray_address=auto"], False),  # workers on an existing cluster
        (["export_final=true", "dp=64"], True),
        (["export_final=false", "dp=2"], False),
    ],
)
def test_writes_final_export_follows_the_setting_and_the_node_count(settings, writes):
    from genomelm.run.config import TrainConfig
    from genomelm.train.loop import writes_final_export

    assert writes_final_export(TrainConfig.load(None, settings)) is writes


@pytest.fixture(scope="module")
def fly(tmp_path_factory) -> Path:
    from data_fixtures import fly_windows

    return fly_windows(tmp_path_factory.mktemp("data") / "fly", "1-4096", 512)


def train_on_rank(config, shard_bytes: int) -> None:
    """`train(config)` on this rank, its final export in files of `shard_bytes` (the default 4 GiB makes
    `tiny` one file, all of it rank 0's)."""
    import functools

    from genomelm.train import loop

    loop.export_checkpoint_collective = functools.partial(  # this rank's process only
        loop.export_checkpoint_collective, max_shard_bytes=shard_bytes
    )
    loop.train(config, progress=False)


def train_dp2(fly: Path, runs: Path, **settings) -> Path:
    """One step of `tiny` at dp 2 x ep 2 (2 gloo ranks); its checkpoint folder."""
    from data_fixtures import tiny_run

    from genomelm.run.config import TrainConfig

    run = tiny_run(fly, runs, dp=2, ep=2, steps=1, save_every=1, **settings)
    launch(train_on_rank, 2, TrainConfig.load(None, run), SHARD_BYTES, timeout_s=TIMEOUT_S)
    return runs / "r" / "checkpoints" / "step-0000001"


def test_final_export_is_written_by_every_rank_and_all_their_checksums_verified(fly, tmp_path):
    """export_final=true: the Hugging Face copy equals the one-process export of the checkpoint; each rank
    records its own files' checksums, and `verify_checkpoint(prefix="model/")` catches a changed file of rank
    1's."""
    from genomelm.parallel.checkpoint import verify_checkpoint

    step = train_dp2(fly, tmp_path / "runs", export_final="true")
    export_checkpoint(step, tmp_path / "one", torch.float32, max_shard_bytes=SHARD_BYTES)
    assert folder_bytes(step / "model") == folder_bytes(tmp_path / "one")
    records = {
        path.name: json.loads(path.read_text()) for path in (step / "checksums").glob("model-rank-*.json")
    }
    assert sorted(records) == ["model-rank-00000.json", "model-rank-00001.json"]
    assert {name for record in records.values() for name in record} == {
        f"model/{path.name}" for path in (step / "model").iterdir()
    }
    assert f"model/{INDEX_FILE}" in records["model-rank-00000.json"]
    assert verify_checkpoint(step, prefix="model/") == []

    theirs = step / sorted(records["model-rank-00001.json"])[0]
    damaged = bytearray(theirs.read_bytes())
    damaged[-1] ^= 0xFF
    theirs.write_bytes(bytes(damaged))
    assert verify_checkpoint(step, prefix="model/") == [
        f"{theirs}: its bytes differ from those written (xxh3-128 mismatch)"
    ]


def test_final_export_false_writes_none_and_a_rerun_with_auto_writes_it(fly, tmp_path):
    """export_final=false leaves the sharded checkpoint alone; the same run again (at its end, nothing left to
    train) with auto on one machine writes the copy."""
    from genomelm.parallel.checkpoint import verify_checkpoint

    step = train_dp2(fly, tmp_path / "runs", export_final="false")
    assert not (step / "model").exists()
    assert not list((step / "checksums").glob("model*"))
    assert train_dp2(fly, tmp_path / "runs", export_final="auto") == step
    assert (step / "model" / "config.json").exists()
    assert len(list((step / "model").glob("*.safetensors"))) > 2
    assert verify_checkpoint(step, prefix="model/") == []
    assert sorted(p.name for p in step.iterdir() if p.name.startswith(".")) == []  # no staging folder left
