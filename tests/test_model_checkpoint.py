"""Checkpoint reading/writing (genomelm.model.checkpoint, .hf_names, .fp8) against transformers' glm5_next.

Checkpoints are written here from tiny random transformers models: by transformers' own `save_pretrained`
(the official on-disk names), re-sharded with FP8 weights, or with internal names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open as real_safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    Glm5NextTextConfig,
    Glm5NextTextModel,
)

from genomelm.model import checkpoint
from genomelm.model.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    load_model,
    read_state_dict,
    save_model,
    save_state_dict,
)
from genomelm.model.config import DENSE, DSA, KDA, MOE, ModelConfig
from genomelm.model.fp8 import FP8Error, dequantize_fp8_blocks

TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 32,
    "out_hidden_size": 32,
    "projection_intermediate_size": 32,
}
FP8_BLOCK = (16, 24)  # small blocks so tiny weights get several, with partial edge blocks
FP8_MAX = 448.0


def tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=8,
        index_kpool=4,
        linear_num_heads=2,
        linear_head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=24,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=2,
        pad_token_id=0,
        # transformers hands a full layer's top-k only to the very next layer, so the shared layer follows it
        layer_types=[KDA, DSA, DSA, KDA],
        mlp_layer_types=[DENSE, MOE, MOE, MOE],
        indexer_types=["full", "full", "shared", "full"],
    )


def perturb(module: torch.nn.Module) -> None:
    """Add noise to every parameter and buffer: the default init leaves ones and zeros that hide mix-ups."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.add_(0.1 * torch.randn_like(tensor))


def dequantize_by_loops(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Reference: multiply each block of the FP8 values by its own scale."""
    out = torch.empty(quantized.shape, dtype=torch.float32)
    rows, cols = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[tile] = quantized[tile].float() * scale[i, j]
    return out


def quantize_by_loops(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 values, fp32 scale per block) with each block's largest magnitude mapped to the FP8
    maximum."""
    rows, cols = block
    scale = torch.empty(math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            scale[i, j] = weight[tile].abs().max().clamp_min(1e-12) / FP8_MAX
            quantized[tile] = (weight[tile] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def write_sharded(folder: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    folder.mkdir(parents=True)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update({key: file for key in tensors})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))


class RecordingOpen:
    """Stands in for `safetensors.safe_open`, logging the files opened and the tensors read."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.reads: list[str] = []

    def __call__(self, path, framework, device="cpu"):
        self.files.append(Path(path).name)
        return _RecordingHandle(real_safe_open(path, framework=framework, device=device), self.reads)


class _RecordingHandle:
    def __init__(self, handle, reads: list[str]) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.inner = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key):
        self.reads.append(key)
        return self.inner.get_tensor(key)

    def get_slice(self, key):
        self.reads.append(key)
        return self.inner.get_slice(key)


def assert_state_dicts_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), name


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(config, transformers model, its internal-name state dict + lm_head, folder it saved itself)."""
    config = tiny_config()
    torch.manual_seed(0)
    hf_config = Glm5NextConfig(text_config=config.text_config_dict(), vision_config=TINY_VISION)
    model = Glm5NextForConditionalGeneration(hf_config).eval()
    perturb(model)
    state = dict(model.model.language_model.state_dict()) | {"lm_head.weight": model.lm_head.weight.detach()}
    folder = tmp_path_factory.mktemp("hf") / "saved_by_transformers"
    model.save_pretrained(folder)
    return config, model, state, folder


@pytest.fixture(scope="module")
def official_fp8(reference, tmp_path_factory):
    """transformers' save re-split into 3 shards (top-level, layers 0-1, layers 2-3 + MTP), every 2D
    projection weight FP8 with 16 x 24 block scales; returns (folder, expected internal state dict)."""
    config, _, state, hf_folder = reference
    on_disk = load_file(hf_folder / "model.safetensors")
    shards: dict[str, dict[str, torch.Tensor]] = {
        "top.safetensors": {},
        "a.safetensors": {},
        "b.safetensors": {},
    }
    dequantized: dict[str, torch.Tensor] = {}
    for key, tensor in on_disk.items():
        shard = (
            "top.safetensors"
            if ".layers." not in key
            else ("a.safetensors" if ".layers.0." in key or ".layers.1." in key else "b.safetensors")
        )
        if key.endswith("_proj.weight") and tensor.dim() == 2 and "visual" not in key:
            quantized, scale = quantize_by_loops(tensor, FP8_BLOCK)
            shards[shard][key], shards[shard][key + "_scale_inv"] = quantized, scale
            dequantized[key] = dequantize_by_loops(quantized, scale, FP8_BLOCK)
        else:
            shards[shard][key] = tensor
    # the MTP layer and its shared head are not part of the text model
    shards["b.safetensors"]["model.language_model.layers.4.eh_proj.weight"] = torch.randn(32, 64)
    shards["b.safetensors"]["model.language_model.layers.4.shared_head.norm.weight"] = torch.randn(32)
    raw_config = json.loads((hf_folder / "config.json").read_text())
    raw_config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
    folder = tmp_path_factory.mktemp("fp8") / "official_fp8"
    write_sharded(folder, shards, raw_config)

    expected = dict(state)
    for key, value in dequantized.items():
        text_key = key.removeprefix("model.language_model.")
        if ".experts." in key:
            layer, expert, which = text_key.split(".")[1], int(text_key.split(".")[4]), text_key.split(".")[5]
            name = f"layers.{layer}.mlp.experts." + ("down_proj" if which == "down_proj" else "gate_up_proj")
            expected[name] = expected[name].clone()
            size = config.moe_intermediate_size
            if which == "down_proj":
                expected[name][expert] = value
            else:
                expected[name][expert, (0 if which == "gate_proj" else size) :][:size] = value
        elif text_key.endswith(("f_a_proj.weight", "f_b_proj.weight")):
            layer_attn, leaf = text_key.rsplit(".", 2)[0], ".".join(text_key.rsplit(".", 2)[1:])
            expected[f"{layer_attn}.forget_gate.{leaf}"] = value
        else:
            expected[text_key] = value
    return folder, expected


# ------------------------------------------------------------------------------------------------ FP8
def test_fp8_block_dequantisation_matches_hand_computed_blocks():
    torch.manual_seed(1)
    quantized = (torch.randn(130, 260) * 8).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5, 2.0, 0.25], [4.0, 0.125, 3.0]])
    got = dequantize_fp8_blocks(quantized, scale)
    assert got.dtype == torch.float32 and got.shape == (130, 260)
    assert torch.equal(got, dequantize_by_loops(quantized, scale, (128, 128)))
    # corners of the full block and of the partial edge blocks
    assert got[0, 0] == quantized[0, 0].float() * 0.5
    assert got[127, 255] == quantized[127, 255].float() * 2.0
    assert got[128, 0] == quantized[128, 0].float() * 4.0
    assert got[129, 259] == quantized[129, 259].float() * 3.0
    with pytest.raises(FP8Error, match=r"\(2, 3\)"):
        dequantize_fp8_blocks(quantized, scale[:, :2], name="w")


# ------------------------------------------------------------------------------------------------ reading
def test_reads_the_folder_transformers_save_pretrained_writes(reference):
    _, _, state, folder = reference
    assert_state_dicts_equal(read_state_dict(folder), state)


def test_reads_a_bare_text_model_saved_by_transformers(reference, tmp_path):
    config, model, _, _ = reference
    text_model = Glm5NextTextModel(Glm5NextTextConfig(**config.text_config_dict()))
    text_model.load_state_dict(model.model.language_model.state_dict())
    text_model.save_pretrained(tmp_path / "text")
    assert_state_dicts_equal(read_state_dict(tmp_path / "text"), dict(text_model.state_dict()))


def test_reads_internal_names(reference, tmp_path):
    _, _, state, hf_folder = reference
    folder = tmp_path / "internal"
    folder.mkdir()
    prefixed = {("" if k == "lm_head.weight" else "model.language_model.") + k: v for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in prefixed.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    assert_state_dicts_equal(read_state_dict(folder), state)
    subset = read_state_dict(folder, layers=[2], experts=[3, 1])
    assert subset["layers.2.mlp.experts.gate_up_proj"].shape == (2, 48, 32)
    assert torch.equal(
        subset["layers.2.mlp.experts.gate_up_proj"], state["layers.2.mlp.experts.gate_up_proj"][[3, 1]]
    )
    assert torch.equal(
        subset["layers.2.mlp.experts.down_proj"], state["layers.2.mlp.experts.down_proj"][[3, 1]]
    )


def test_reads_sharded_official_fp8_skipping_vision_and_mtp(official_fp8):
    folder, expected = official_fp8
    assert_state_dicts_equal(read_state_dict(folder), expected)


def test_subset_reads_only_the_requested_tensors(official_fp8, monkeypatch):
    folder, expected = official_fp8
    recorder = RecordingOpen()
    monkeypatch.setattr(checkpoint, "safe_open", recorder)
    got = read_state_dict(folder, layers=[1], experts=[3, 1])
    assert set(recorder.files) == {"top.safetensors", "a.safetensors"}  # b.safetensors is never opened
    experts = [f"model.language_model.layers.1.mlp.experts.{e}." for e in (3, 1)]
    allowed = {
        key
        for key in json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        if ".layers." not in key
        and "visual" not in key
        or ".layers.1." in key
        and (".experts." not in key or key.startswith(tuple(experts)))
    }
    assert set(recorder.reads) == allowed and len(recorder.reads) == len(allowed)
    other_layers = ("layers.0.", "layers.2.", "layers.3.")
    want = {name: value for name, value in expected.items() if not name.startswith(other_layers)}
    for name in ("layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"):
        want[name] = expected[name][[3, 1]]
    assert_state_dicts_equal(got, want)


# ------------------------------------------------------------------------------------------------ saving
def test_save_round_trip_and_same_layout_as_transformers(reference, tmp_path):
    config, _, state, hf_folder = reference
    folder = tmp_path / "ours"
    save_state_dict(state, config, folder, max_shard_bytes=20_000)
    files = sorted(path.name for path in folder.iterdir())
    shards = [name for name in files if name.endswith(".safetensors")]
    assert len(shards) >= 2 and INDEX_FILE in files and "config.json" in files
    assert_state_dicts_equal(read_state_dict(folder), state)
    assert ModelConfig.from_file(folder).text_config_dict() == config.text_config_dict()

    ours = {k: v for shard in shards for k, v in load_file(folder / shard).items()}
    theirs = {
        k: v
        for k, v in load_file(hf_folder / "model.safetensors").items()
        if not k.startswith("model.visual.")
    }
    assert_state_dicts_equal(ours, theirs)


def test_transformers_loads_what_we_save(reference, tmp_path):
    config, _, state, _ = reference
    folder = tmp_path / "ours"
    save_state_dict(state, config, folder, max_shard_bytes=20_000)
    loaded = Glm5NextForConditionalGeneration.from_pretrained(folder)
    got = dict(loaded.model.language_model.state_dict()) | {"lm_head.weight": loaded.lm_head.weight.detach()}
    assert_state_dicts_equal(got, state)


def test_save_replaces_an_existing_folder_atomically(reference, tmp_path):
    config, _, state, _ = reference
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "stale.safetensors").write_bytes(b"old")
    save_state_dict(state, config, folder)
    assert not (folder / "stale.safetensors").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]  # no staging or backup left
    assert_state_dicts_equal(read_state_dict(folder), state)


# ------------------------------------------------------------------------------------------------ errors
def test_missing_expert_and_missing_scale_name_the_file(official_fp8, tmp_path):
    folder, _ = official_fp8
    index = json.loads((folder / INDEX_FILE).read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    expert_key = "model.language_model.layers.2.mlp.experts.2.up_proj.weight"
    del index["weight_map"][expert_key]
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"b\.safetensors.*lacks expert weights \[\(2, 'up'\)\].*n_routed"
    ):
        read_state_dict(broken, layers=[2])
    del index["weight_map"]["model.language_model.layers.0.mlp.gate_proj.weight_scale_inv"]
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.gate_proj\.weight in .*a\.safetensors is FP8"
    ):
        read_state_dict(broken, layers=[0])


def test_both_layouts_for_one_tensor_is_an_error(reference, tmp_path):
    _, _, state, hf_folder = reference
    folder = tmp_path / "mixed"
    folder.mkdir()
    tensors = load_file(hf_folder / "model.safetensors")
    tensors["model.language_model.layers.0.attn_hc.fn"] = state["layers.0.attn_hc.fn"]
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.attn_hc\.fn', .*layers\.0\.hc_attn_fn'\] all map onto"
    ):
        read_state_dict(folder)


def test_unknown_preset_empty_folder_and_bad_layers(reference, tmp_path):
    _, _, _, hf_folder = reference
    with pytest.raises(CheckpointError, match=r"unknown model preset 'no-such-model'.*checkpoint folder"):
        load_model("no-such-model")
    (tmp_path / "config.json").write_text((hf_folder / "config.json").read_text())
    with pytest.raises(
        CheckpointError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"
    ):
        read_state_dict(tmp_path)
    with pytest.raises(CheckpointError, match=r"layers \[7\] do not exist.*0\.\.3"):
        read_state_dict(hf_folder, layers=[7])
    (tmp_path / "no_config").mkdir()
    with pytest.raises(CheckpointError, match=r"no_config has no config\.json"):
        load_model(tmp_path / "no_config")


# ------------------------------------------------------------------------------------------------ model
FP32_PARAMETERS = (
    "layers.1.mlp.gate.weight",
    "layers.1.mlp.gate.e_score_correction_bias",
    "layers.0.self_attn.conv1d.weight",
    "layers.0.self_attn.forget_gate.dt_bias",
    "layers.0.self_attn.forget_gate.A_log",
    "layers.3.attn_hc.base",
    "layers.3.ffn_hc.scale",
)


def test_load_model_from_transformers_save(reference):
    _, _, state, folder = reference
    assert_state_dicts_equal(dict(load_model(folder).state_dict()), state)


def test_load_model_in_bf16_keeps_the_fp32_parameters(reference):
    _, _, state, folder = reference
    got = load_model(folder, dtype=torch.bfloat16).state_dict()
    for name in FP32_PARAMETERS:
        assert got[name].dtype == torch.float32, name
    for name in (
        "embed_tokens.weight",
        "lm_head.weight",
        "layers.1.mlp.experts.gate_up_proj",
        "layers.2.self_attn.kv_b_proj.weight",
    ):
        assert got[name].dtype == torch.bfloat16, name
    for name, value in got.items():
        assert torch.equal(value, state[name].to(value.dtype)), name


def test_load_model_layer_subset_reads_and_holds_only_those_layers(official_fp8, monkeypatch):
    folder, expected = official_fp8
    recorder = RecordingOpen()
    monkeypatch.setattr(checkpoint, "safe_open", recorder)
    model = load_model(folder, layers=[1])
    assert set(recorder.files) == {"top.safetensors", "a.safetensors"}
    assert not any(".layers.0." in key or ".layers.2." in key for key in recorder.reads)
    for name, value in model.state_dict().items():
        if name.startswith(("layers.0.", "layers.2.", "layers.3.")):
            assert value.is_meta, name
        else:
            assert torch.equal(value, expected[name]), name


def test_a_model_read_from_fp8_saves_unquantised(official_fp8, tmp_path):
    folder, expected = official_fp8
    save_model(load_model(folder), tmp_path / "ours")
    assert "quantization_config" not in json.loads((tmp_path / "ours" / "config.json").read_text())
    assert_state_dicts_equal(read_state_dict(tmp_path / "ours"), expected)


def test_genomelm_checkpoint_loads_in_transformers_with_equal_logits(reference, tmp_path):
    _, _, _, hf_folder = reference
    ours = load_model(hf_folder).eval()
    save_model(ours, tmp_path / "ours")
    theirs = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    input_ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(input_ids=input_ids).logits
        got = ours.hidden_states(input_ids) @ ours.lm_head.weight.T
    assert want.abs().max() > 0.1  # a live model, not a degenerate one
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_load_model_rejects_a_config_that_does_not_match_the_weights(reference, tmp_path):
    _, _, _, hf_folder = reference
    raw = json.loads((hf_folder / "config.json").read_text())
    folder = tmp_path / "mismatch"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(hf_folder / "model.safetensors")

    raw["text_config"]["moe_intermediate_size"] = 16
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=r"layers\.1\.mlp\.experts.*model\.safetensors.*has shape \(4, 48, 32\).*"
        r"expects layers\.1\.mlp\.experts\.gate_up_proj of shape \(4, 32, 32\); config\.json",
    ):
        load_model(folder)

    raw["text_config"]["moe_intermediate_size"] = 24
    raw["text_config"]["indexer_types"] = ["full"] * 4  # layer 2 would need indexer weights
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match=r"lacks 7 tensor\(s\).*layers\.2\.self_attn\.indexer.*config\.json"
    ):
        load_model(folder)

    raw["text_config"]["indexer_types"] = ["full", "full", "shared", "full"]
    raw["text_config"]["mlp_layer_types"] = ["dense"] * 4  # layer 1 holds experts on disk
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match=r"layers\.1\.mlp\..*has no place in the model.*mlp_layer_types"
    ):
        load_model(folder)


def test_load_preset_random_init_with_a_layer_subset(monkeypatch, tmp_path):
    import yaml

    from genomelm.model import config as config_module

    (tmp_path / "tiny-test.yaml").write_text(yaml.safe_dump(tiny_config().text_config_dict()))
    monkeypatch.setattr(config_module, "PRESET_DIR", tmp_path)
    full = load_model("tiny-test", dtype=torch.bfloat16)
    assert (
        full.embed_tokens.weight.dtype == torch.bfloat16
        and full.layers[1].mlp.gate.weight.dtype == torch.float32
    )
    assert not any(value.is_meta for value in full.state_dict().values())
    subset = load_model("tiny-test", layers=[2])
    for name, value in subset.state_dict().items():
        assert value.is_meta == name.startswith(("layers.0.", "layers.1.", "layers.3.")), name
        if not value.is_meta:
            assert torch.isfinite(value).all(), name
    assert subset.layers[2].mlp.experts.gate_up_proj.std() > 0.01  # initialised, not left empty
