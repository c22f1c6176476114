"""DeepSeek-V3's multi-token prediction (MTP) modules, as speculative decoding runs them.

A V3 checkpoint keeps `num_nextn_predict_layers` modules after its decoder layers (checkpoint
layers num_hidden_layers.., which the model's own load skips). Module k predicts the token
after next: at position i it takes the target's final hidden state h_i (after the final norm,
as vLLM and SGLang feed it) and the embedding of the token at i + 1, and

    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])      (the embedding zeroed at position 0)
    y = block(x) + its residual                           (a decoder layer of the family's own)
    logits = shared_head.head(shared_head.norm(y))

Its block attends over a KV cache of its own, with the target's block tables: position i of the
MTP cache is written when position i of the target is, so it lives in the target's blocks'
positions (sized with them) and follows preemption, prefix hits and chunked prefill unchanged.

Checkpoint names: `model.layers.{L+k}.{embed_tokens, enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head}` and the block's own (`self_attn.*`, `mlp.*`, its norms), which this module
holds under `block.`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError
from kvserve.models.layers.causal_lm import check_complete, check_tensor, load_tensor, \
    module_loaders
from kvserve.models.layers.embedding import LogitsHead, TokenEmbedding
from kvserve.models.layers.linear import column_parallel
from kvserve.models.layers.norm import RMSNorm

# an MTP module's own tensors; the rest of its layer's names are its decoder block's
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class MTPLayer(nn.Module):
    """One next-token-prediction module: its own embedding table, input norms, projection of
    the two, decoder block and head."""

    def __init__(self, config: ModelConfig, block: nn.Module, quant, prefix: str):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = TokenEmbedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = column_parallel(2 * hidden, [("eh_proj", hidden)], False, quant, prefix)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)
        self.shared_head.head = LogitsHead(config.vocab_size, hidden, quant)
        self.block = block

    def forward(self, ops, next_ids: torch.Tensor, positions: torch.Tensor,
                previous: torch.Tensor, metadata) -> torch.Tensor:
        """The module's output y [T, H] (before its head's norm) for tokens `next_ids` at
        `positions` + 1, from `previous` [T, H]: the target's final hidden states (the first
        module), or the module's own outputs (a later draft position)."""
        embedded = self.embed_tokens(next_ids).to(previous.dtype)
        embedded.masked_fill_((positions == 0).unsqueeze(-1), 0.0)
        joined = torch.cat([ops.rms_norm(embedded, self.enorm),
                            ops.rms_norm(previous, self.hnorm)], dim=-1)
        hidden = ops.linear(self.eh_proj, joined)
        hidden, residual = self.block.forward(ops, positions, hidden, None, metadata)
        return hidden + residual

    def logits(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of rows of `forward`'s output."""
        return self.shared_head.head(ops.rms_norm(hidden, self.shared_head.norm)).float()


class MultiTokenPredictor(nn.Module):
    """The checkpoint's MTP modules beside `target` (a CausalLM holding every decoder layer):
    each is built by the target's family (its `decoder_layer` at index L + k), and loaded from
    the target's checkpoint (`load`)."""

    def __init__(self, target, count: int):
        super().__init__()
        config = target.full_config
        if target.parallel is not None or not target.model.is_last_stage \
                or not target.model.is_first_stage:
            raise UnsupportedArchitectureError(
                "MTP drafts run the model whole in one process for now (no tensor or pipeline "
                "parallelism)")
        first = config.num_hidden_layers
        # the modules' own layer indices, as the family builds a layer there (V3's: MoE)
        extended = dataclasses.replace(
            config, num_hidden_layers=first + count,
            moe_layers=config.moe_layers + (config.is_moe_layer(first - 1),) * count
            if config.moe_layers else ())
        rotaries = target.model.rotaries
        self.first = first
        self.model = nn.Module()  # module paths are the checkpoint's: model.layers.{L + k}
        self.model.layers = nn.ModuleDict({
            str(first + k): MTPLayer(
                config, target.decoder_layer(extended, first + k, f"model.layers.{first + k}",
                                             rotaries[extended.layer_rope(first + k)]),
                target.quant, f"model.layers.{first + k}")
            for k in range(count)})
        self._target = (target,)

    @property
    def layers(self) -> list[MTPLayer]:
        return list(self.model.layers.values())

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, object]]) -> None:
        """The modules' tensors out of the target's whole checkpoint (the family's renames
        and fp8 preparation apply as to the model's own); a module the checkpoint lacks is
        an error naming it."""
        target = self._target[0]
        loaders = module_loaders(self, [m for layer in self.layers
                                        for m in (layer.embed_tokens, layer.shared_head.head)])
        for index, layer in zip(self.model.layers, self.layers):
            loaders[f"model.layers.{index}.embed_tokens.weight"] = ("table", layer.embed_tokens)
            loaders[f"model.layers.{index}.shared_head.head.weight"] = (
                "table", layer.shared_head.head)
        loaded: set[str] = set()
        mine = self._renamed(target.checkpoint_tensors(self._own(weights)))
        for name, tensor in target.quant.prepare(mine, loaders):
            if name not in loaders:
                raise CorruptModelFileError(f"checkpoint tensor {name!r} has no place in the "
                                            "model's MTP modules")
            check_tensor(loaders[name], name, tensor, target.full_config)
            load_tensor(loaders[name], tensor)
            loaded.add(name)
        for index in self.model.layers:
            if not any(name.startswith(f"model.layers.{index}.") for name in loaded):
                raise CorruptModelFileError(
                    f"the checkpoint has no MTP module {int(index) - self.first} (no "
                    f"model.layers.{index}.* tensors) of the {len(self.layers)} its config's "
                    "num_nextn_predict_layers (or num_speculative_tokens' modules) name")
        check_complete(self, loaders, loaded, "the checkpoint's MTP modules")

    def _own(self, weights: Iterable[tuple[str, object]]) -> Iterator:
        """The checkpoint's tensors of these modules' layer indices."""
        indices = {int(index) for index in self.model.layers}
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match and int(match[1]) in indices:
                yield name, tensor

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, object]]) -> Iterator:
        """A module's block tensors under `block.` (model.layers.61.self_attn.* ->
        model.layers.61.block.self_attn.*)."""
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match and not match[2].startswith(_OWN):
                name = f"model.layers.{match[1]}.block.{match[2]}"
            yield name, tensor
