"""GLM-5.3-Flash text decoder for causal language modelling (`GlmForCausalLM`).

Token embeddings are copied into `hc_mult` residual streams; each `DecoderLayer` runs two mHC-wrapped blocks
(attention: KDA or DSA; feed-forward: dense SwiGLU or MoE); the streams are averaged, normed and projected
onto the vocabulary only inside the chunked loss. Parameter names equal transformers' `Glm5NextTextModel`
plus `lm_head`. Each block names its compute route in `route` (`GlmForCausalLM.route_table`).

Everything goes through `forward` (`model(input_ids, labels)`), and every submodule is called through
`__call__`, so module hooks (FSDP2, `torch.compile`, profilers) see each call. The model never turns autocast
on or decides to recompute: the caller does (see `genomelm.train`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from genomelm.data.vocab import IGNORE_INDEX

from .config import DSA, KDA, MOE, ModelConfig, RunOptions
from .dsa import DSAAttention
from .indexer import Indexer, Selection
from .kda import ForgetGate, KDAttention
from .loss import LMHead, reduce_nll
from .mhc import HyperConnection, hc_head
from .mlp import MLP
from .moe import Experts, MoE, TopkRouter
from .norms import GatedRMSNorm, RMSNorm
from .precision import compute_dtype

log = logging.getLogger(__name__)

LayerRunner = Callable[["DecoderLayer", Tensor, "Selection | None"], "tuple[Tensor, Selection | None]"]


class DecoderLayer(nn.Module):
    """One block pair on the residual streams: [B, S, N, D] -> [B, S, N, D]."""

    def __init__(self, config: ModelConfig, layer_idx: int, options: RunOptions) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.attn_hc = HyperConnection(config, options)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: KDAttention | DSAAttention = (
            KDAttention(config, layer_idx, options)
            if self.layer_type == KDA
            else DSAAttention(config, layer_idx, options)
        )
        self.ffn_hc = HyperConnection(config, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MoE | MLP = (
            MoE(config, options)
            if config.mlp_layer_types[layer_idx] == MOE
            else MLP(config, chunk_tokens=options.moe_chunk_tokens)
        )

    def forward(
        self, streams: Tensor, shared_selection: Selection | None = None, selection_cache: dict | None = None
    ) -> tuple[Tensor, Selection | None]:
        """streams [B, S, N, D]; shared_selection: the latest full DSA layer's (used by "shared" DSA layers);
        selection_cache: see `DSAAttention.forward` (lets an activation recompute skip the indexer).

        Returns the new streams and this layer's DSA selection (None for KDA layers).
        """
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        selection = None
        if self.layer_type == DSA:
            x, selection = self.self_attn(x, shared_selection, selection_cache)
        else:
            x, _ = self.self_attn(x)
        streams = self.attn_hc.combine(post, comb, x, streams)
        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x))
        return self.ffn_hc.combine(post, comb, x, streams), selection

    @property
    def route(self) -> str:
        """The compute route this layer took (or will take): attention | feed-forward | mHC route."""
        return f"{self.self_attn.route} | {self.mlp.route} | {self.attn_hc.route}"


def _call_layer(
    layer: DecoderLayer, streams: Tensor, shared_selection: Selection | None
) -> tuple[Tensor, Selection | None]:
    return layer(streams, shared_selection)


class GlmForCausalLM(nn.Module):
    """Decoder + untied output head: `forward` (= `loss`), `token_logprobs`, `hidden_states`, `route_table`,
    `router_stats`."""

    def __init__(self, config: ModelConfig, options: RunOptions | None = None) -> None:
        super().__init__()
        self.config = config
        self.options = options if options is not None else RunOptions()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.options) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, self.options.loss_chunk_tokens)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.last_indexer_loss: dict[int, Tensor] = {}
        self._announced = False
        self.init_weights()

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        options: RunOptions | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> GlmForCausalLM:
        """Randomly initialised model in `dtype` (the fp32-declared parameters stay fp32) on `device` (meta
        works)."""
        with torch.device(device if device is not None else "cpu"), _default_dtype(dtype):
            return cls(config, options)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_weights(self) -> None:
        """The reference initialisation: normal(0, initializer_range) for matrices and embeddings (pad row
        0), norms 1, mHC base 0 / scale 1, router bias 0, KDA A_log 0 (with a lower bound; else log U(1, 16))
        and dt_bias = softplus^-1 of log-uniform [1e-3, 1e-1], indexer pool ape 0 / gate 1. No data-dependent
        step, so it runs on the meta device."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, LMHead):
                module.weight.normal_(0.0, std)
            elif isinstance(module, (nn.Linear, nn.Conv1d)):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                module.weight.fill_(1.0)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, HyperConnection):
                module.fn.normal_(0.0, std)
                module.base.zero_()
                module.scale.fill_(1.0)
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, TopkRouter):
                module.weight.normal_(0.0, std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, ForgetGate):
                if module.lower_bound is not None:
                    module.A_log.zero_()
                else:
                    module.A_log.uniform_(1.0, 16.0).log_()
                dt = module.dt_bias.uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif isinstance(module, Indexer):
                module.index_kpool_compress_ape.zero_()
                module.index_kpool_compress_gate.fill_(1.0)

    # ------------------------------------------------------------------ forward
    def check_dense_guard(self, seq_len: int) -> None:
        """Refuse sequences longer than `options.forbid_dense_above` when some layer would build S x S
        tensors."""
        limit = self.options.forbid_dense_above
        dense = self.config.dsa_layers if self.options.dsa_backend == "dense" else []
        if limit is not None and seq_len > limit and dense:
            raise ValueError(
                f"sequence of {seq_len} tokens > forbid_dense_above={limit}: DSA layers {dense} run "
                "dsa_backend='dense', which builds S x S tensors; "
                "use dsa_backend='sparse' (or raise the limit)"
            )

    def hidden_states(
        self, input_ids: Tensor, layer_runner: LayerRunner | None = None, upto_layer: int | None = None
    ) -> Tensor:
        """input_ids [B, S] -> hidden states [B, S, D] as the head reads them: the mHC streams after the last
        decoder layer collapsed (`hc_head`: their mean) and normed (the final `norm`); fp32 whatever the
        autocast (the collapse is fp32, the norm weight promotes to it).

        `upto_layer` (0-based): stop after that decoder layer (the layers after it do not run) and collapse
        its output streams the same way, so `upto_layer = L - 1` equals the default. `layer_runner(layer,
        streams, shared_selection) -> (streams, selection)` wraps every layer call (activation recompute,
        offload); default: call the layer.
        """
        layers = self.layers
        if upto_layer is not None:
            if not 0 <= upto_layer < len(self.layers):
                raise ValueError(
                    f"upto_layer={upto_layer}: the model has {len(self.layers)} decoder layers, "
                    f"0..{len(self.layers) - 1}"
                )
            layers = self.layers[: upto_layer + 1]
        self.check_dense_guard(input_ids.shape[1])
        runner = layer_runner if layer_runner is not None else _call_layer
        embedded = self.embed_tokens(input_ids)
        # the streams are stored in the compute dtype (bf16 under bf16 autocast); mHC mixes them in fp32
        streams = embedded.to(compute_dtype(embedded)).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1)
        streams = streams.contiguous()
        selection: Selection | None = None
        for layer in layers:
            streams, new_selection = runner(layer, streams, selection)
            if new_selection is not None:
                selection = new_selection
        self.last_indexer_loss = {  # of the layers that ran: the others keep an earlier forward's
            layer.layer_idx: layer.self_attn.indexer_loss
            for layer in layers
            if isinstance(layer.self_attn, DSAAttention) and layer.self_attn.indexer_loss is not None
        }
        if not self._announced:
            self._announced = True
            log.info(
                "genomelm model routes at the first forward (%d tokens per row):\n%s",
                input_ids.shape[1],
                self.route_table(),
            )
        return self.norm(hc_head(streams))

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor,
        reduction: str = "mean",
        layer_runner: LayerRunner | None = None,
    ) -> Tensor:
        """Cross-entropy of position t predicting labels[t] (-100 ignored), chunked over tokens.

        input_ids, labels [B, S]. reduction "mean" (over non-ignored tokens) or "sum": a scalar, plus the DSA
        indexer KL terms when `options.train_indexer` (also kept, per layer, in `last_indexer_loss`); "none":
        [B, S] fp32, 0 at ignored positions, without indexer terms.
        """
        hidden = self.hidden_states(input_ids, layer_runner)
        nll = self.lm_head(hidden, labels)
        loss = reduce_nll(nll, labels, reduction)
        if reduction != "none" and self.last_indexer_loss:
            loss = loss + sum(self.last_indexer_loss.values())
        return loss

    def loss(
        self,
        input_ids: Tensor,
        labels: Tensor,
        reduction: str = "mean",
        layer_runner: LayerRunner | None = None,
    ) -> Tensor:
        """`model(input_ids, labels, ...)`: see `forward`."""
        return self(input_ids, labels, reduction=reduction, layer_runner=layer_runner)

    @torch.no_grad()
    def token_logprobs(self, input_ids: Tensor, layer_runner: LayerRunner | None = None) -> Tensor:
        """log p(x[t+1] | x[<=t]) for t = 0..S-2: [B, S-1] fp32, chunked over tokens (through `forward`)."""
        labels = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], IGNORE_INDEX)], dim=1)
        return -self(input_ids, labels, reduction="none", layer_runner=layer_runner)[:, :-1]

    # ------------------------------------------------------------------ reports
    def route_table(self) -> str:
        """One line per layer with the attention and feed-forward routes, plus the loss route."""
        lines = [f"{'layer':>5}  {'type':<5}  route"]
        for layer in self.layers:
            kind = "KDA" if layer.layer_type == KDA else "DSA"
            lines.append(f"{layer.layer_idx:>5}  {kind:<5}  {layer.route}")
        lines.append(
            f"{'':>5}  {'head':<5}  loss: chunked cross-entropy, "
            f"{self.options.loss_chunk_tokens} tokens at a time"
        )
        return "\n".join(lines)

    def router_stats(self) -> dict[int, Tensor]:
        """Tokens routed to each expert [E] (long) per MoE layer, for the last forward."""
        return {
            layer.layer_idx: layer.mlp.tokens_per_expert
            for layer in self.layers
            if isinstance(layer.mlp, MoE) and layer.mlp.tokens_per_expert is not None
        }


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating tensors in `dtype` unless they name their own dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
