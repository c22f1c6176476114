"""A decoder-only language model: the shared decoder stack (`model`), its LM head, and loading by
checkpoint name. A family subclasses `CausalLM` and says how one of its decoder layers is built
(`decoder_layer`) and, where it differs from Llama's, its norms' offset and embedding scale.

Loading: every module that takes checkpoint tensors says which names it takes (a projection its
parts', fused or not; the embedding, the head, each norm its own), so `load_weights` maps an HF
name to its loader and nothing else knows the names. Each loader takes its tensor-parallel
slice, and projections convert themselves as soon as their parts are in.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.distributed.communication import gather_vocab
from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.distributed.sharding import shard_config
from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError
from kvserve.models.layers.decoder import DecoderModel, IntermediateTensors
from kvserve.models.layers.embedding import LogitsHead, TokenEmbedding
from kvserve.models.layers.linear import PartitionedLinear
from kvserve.models.layers.rotary import RotaryEmbedding
from kvserve.quant import QuantPolicy

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class CausalLM(nn.Module):
    # a family's overrides
    norm_weight_offset = 0.0  # Gemma: norms scale by (1 + weight)

    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 parallel: ParallelContext | None = None, quant: QuantPolicy | None = None):
        """`config`: the whole model's (with `parallel` spanning several ranks, this rank's
        share of it is built, and `self.config` is the rank's: its heads and MLP width, what its
        KV cache holds); `quant`: how projections hold their weights (default: float32)."""
        super().__init__()
        check_backend_support(config, backend)
        self.full_config = config
        self.config = shard_config(config, parallel.tp_size if parallel is not None else 1)
        self.parallel = active(parallel)
        self.quant = quant or QuantPolicy("none", torch.float32)
        self.lora = None  # its LoRA adapters (models/lora/ModelLoRA), with --enable-lora
        self.model = DecoderModel(self.config, backend, parallel, self._make_layer,
                                  self.norm_weight_offset, self.embedding_multiplier(config),
                                  self.quant)
        self.has_lm_head = self.model.is_last_stage
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LogitsHead(config.vocab_size, config.hidden_size, self.quant,
                                      parallel, tied) if self.has_lm_head else None

    # ---- what a family defines -------------------------------------------------------------

    def decoder_layer(self, config: ModelConfig, index: int, prefix: str,
                      rotary: RotaryEmbedding) -> nn.Module:
        """Decoder layer `index` (checkpoint prefix `prefix`), attending with `rotary`'s
        table: `layer.forward(ops, positions, hidden, residual, metadata) -> (hidden,
        residual)`, its attention at `layer.self_attn`. `config`: the whole model's (layers
        take their tensor-parallel share themselves)."""
        raise NotImplementedError

    def embedding_multiplier(self, config: ModelConfig) -> float | None:
        """What the token embeddings are multiplied by (Gemma: sqrt(hidden)); None: 1."""
        return None

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterable:
        """The checkpoint's tensors as this model's loaders name them: a family whose HF
        checkpoints stack or interleave what the model holds apart (gpt-oss's experts) splits
        them here; others pass them through."""
        return weights

    def _make_layer(self, index: int, prefix: str, rotary: RotaryEmbedding) -> nn.Module:
        return self.decoder_layer(self.full_config, index, prefix, rotary)

    # ---- running ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None):
        return self.model(input_ids, positions, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for just the rows given: callers pass only sampled positions (with
        tensor parallelism each rank computes its vocabulary range and these rows are gathered)."""
        logits = self.lm_head(hidden)
        if self.parallel is not None:
            logits = gather_vocab(logits, self.parallel)[:, : self.config.vocab_size]
        logits = logits.float()
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma 2, as HF: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def num_stage_layers(self) -> int:
        """Decoder layers this stage runs (and holds KV for)."""
        return len(self.model.stage_layers)

    @property
    def kernel_ops(self):
        """The op set (compiled kernels or their torch versions) the model's layers run."""
        return self.model.ops

    def kv_page_layouts(self, dtype: torch.dtype) -> list:
        """Each of this stage's layers' KV page (`KVPageLayout`) in `dtype`: what the pool's
        sizing and the workers' allocation read."""
        return [layer.self_attn.kv_page_layout(dtype) for layer in self.model.stage_layers]

    def bind_kv_cache(self, kv_caches: list[torch.Tensor],
                      kv_groups: list[int] | None = None) -> None:
        """Give the stage's layer i the tensor kv_caches[i] of shape
        [2, blocks, block_size, kv_heads, dim], and (the hybrid layout) the KV cache group
        kv_groups[i] whose block tables it reads (default: group 0)."""
        layers = self.model.stage_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"need {len(layers)} KV tensors, got {len(kv_caches)}")
        groups = kv_groups or [0] * len(layers)
        for layer, cache, group in zip(layers, kv_caches, groups):
            layer.self_attn.kv_cache = cache
            layer.self_attn.kv_group = group
        self.model.reset_decode_stack()

    @torch.no_grad()
    def shift_keys(self, block_ids: list[int], delta: int) -> None:
        """Rotate the keys held in `block_ids` by `delta` positions, in every layer of this
        stage: attention sinks move the window's keys back by the evicted length (RoPE is a
        rotation by position, so a key written at p becomes the key written at p + delta, up
        to one rounding in the cache's dtype)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        rotations = {kind: table.rotation(delta) for kind, table in self.model.rotaries.items()}
        for layer in self.model.stage_layers:
            layer.self_attn.shift_cached_keys(index, rotations[layer.self_attn.rope_kind])

    def expert_counts(self) -> dict[int, list[int]]:
        """Per mixture-of-experts layer of this stage (by its index in the model), the tokens
        routed to each expert so far."""
        counts = {}
        for index in range(self.model.start_layer, self.model.end_layer):
            for module in self.model.layers[index].modules():
                if hasattr(module, "expert_counts"):
                    counts[index] = module.expert_counts()
        return counts

    def bind_kv_connector(self, hooks) -> None:
        """A KV connector's worker side whose per-layer hooks the stage's layers call (its
        layer index is the position in `bind_kv_cache`'s list)."""
        self.model.kv_connector = hooks

    # ---- loading ---------------------------------------------------------------------------

    def holds(self, name: str) -> bool:
        """Whether this stage has a place for the checkpoint tensor `name`: false for other
        stages' layers, the embedding, final norm and LM head where absent."""
        model = self.model
        match = _LAYER_INDEX.match(name)
        if match:
            return model.start_layer <= int(match[1]) < model.end_layer and \
                not name.startswith(self._not_held())
        if name.startswith("model.embed_tokens."):
            return model.holds_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return model.is_last_stage
        return True

    def _not_held(self) -> tuple[str, ...]:
        """Checkpoint name prefixes of what this rank's layers leave to other ranks (experts
        under expert parallelism), asked of the layers once."""
        if getattr(self, "_not_held_prefixes", None) is None:
            self._not_held_prefixes = tuple(
                prefix for name, module in self.named_modules()
                if hasattr(module, "not_held") for prefix in module.not_held(name))
        return self._not_held_prefixes

    def rebalance_experts(self) -> int:
        """EPLB's periodic step (expert parallelism): each mixture layer re-places its experts
        for the load it measured; the number of layers whose placement changed."""
        moved = sum(bool(module.rebalance()) for module in self.modules()
                    if hasattr(module, "rebalance"))
        self._not_held_prefixes = None
        return moved

    def balancedness(self) -> dict[int, tuple[float, float]]:
        """Per mixture layer (by index) under EPLB, the last rebalance's balancedness before
        and after: mean / max of the tokens the ranks' copies took over its window."""
        return {index: module.ep.balancedness
                for index in range(self.model.start_layer, self.model.end_layer)
                for module in self.model.layers[index].modules()
                if getattr(module, "ep", None) is not None and module.ep.balancedness}

    def checkpoint_loaders(self) -> dict[str, tuple]:
        """Every checkpoint name this stage takes -> (kind, target...): ("linear", layer, part,
        weight or bias), ("param", parameter, its module's loader for it or None), ("head",),
        ("embedding",)."""
        tables = [module for module in (self.lm_head, self.model.embed_tokens)
                  if module is not None]
        loaders = module_loaders(self, tables)
        if isinstance(self.model.embed_tokens, TokenEmbedding):
            loaders["model.embed_tokens.weight"] = ("embedding",)
        if self.lm_head is not None and not self.lm_head.tied:
            loaders["lm_head.weight"] = ("head",)
        return loaders

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors (or lazy slices of them) into the model, each through its loader;
        the tied LM head is built from the embedding's tensor as it passes."""
        loaders = self.checkpoint_loaders()
        loaded: set[str] = set()
        for name, tensor in self.quant.prepare(self.checkpoint_tensors(weights), loaders):
            if name == "rope_freqs.weight":  # a GGUF's Llama 3 scaling: the global table's
                self.model.rotary_emb.freq_factors.copy_(_whole(tensor))
                continue
            if "rotary_emb.inv_freq" in name or not self.holds(name):
                continue
            if name == "lm_head.weight" and self.lm_head is not None \
                    and self.lm_head.tied:
                continue
            if name not in loaders:
                raise CorruptModelFileError(f"checkpoint tensor {name!r} has no place in the "
                                            f"model (its config: {self.config.architecture})")
            check_tensor(loaders[name], name, tensor, self.config)
            self._load_one(loaders[name], tensor)
            loaded.add(name)
        check_complete(self, loaders, loaded)
        self.model.reset_rotary_tables()

    def _load_one(self, loader: tuple, tensor) -> None:
        kind = loader[0]
        if kind == "head":
            self.lm_head.load(tensor)
        elif kind == "embedding":
            self.model.embed_tokens.load(tensor)
            if self.lm_head is not None and self.lm_head.tied:
                self.lm_head.load(tensor)
        else:
            load_tensor(loader, tensor)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The whole model's checkpoint tensors this stage takes, HF names and shapes (random
        weights, exports): projections by part, not fused, unless the family's checkpoints
        fuse them."""
        shapes = {}
        for name, loader in self.checkpoint_loaders().items():
            if loader[0] == "linear":
                _, layer, part, kind = loader
                if (part is None) != layer.export_fused:
                    continue
                rows = sum(p.full_rows for p in layer.parts) if part is None \
                    else layer.parts[part].full_rows
                shapes[name] = (rows, layer.full_in_features) if kind == "weight" else (rows,)
            elif loader[0] in ("head", "embedding"):
                shapes[name] = (self.config.vocab_size, self.config.hidden_size)
            else:
                shapes[name] = tuple(loader[1].shape)
        return shapes

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our float weights under HF checkpoint names, in HF's order (one rank's model)."""
        state = {}
        embedding = self.model.embed_tokens
        if isinstance(embedding, TokenEmbedding):
            if embedding.weight is None:
                raise NotImplementedError("an embedding kept in its file's blocks keeps no float "
                                          "weights to export")
            state["model.embed_tokens.weight"] = embedding.weight.data.clone()
        for name, loader in self.checkpoint_loaders().items():
            if loader[0] == "param":
                _, param, load = loader
                order = getattr(load, "export_order", None)
                state[name] = (param.data if order is None else param.data[order]).clone()
        for name, module in self.named_modules():
            if isinstance(module, PartitionedLinear):
                parent, _, own = name.rpartition(".")
                state.update(module.hf_tensors(parent, own))
        if self.lm_head is not None and not self.lm_head.tied:
            if self.lm_head.weight is None:
                raise NotImplementedError("a quantized LM head keeps no float weights to export")
            state["lm_head.weight"] = self.lm_head.weight.data.clone()
        return state


# ---- loading any module by checkpoint name (the model, or modules beside it: MTP's layers) ----

def module_loaders(root: nn.Module, tables: Iterable[nn.Module] = ()) -> dict[str, tuple]:
    """The checkpoint names `root`'s projections and parameters take (their module paths):
    ("linear", layer, part, weight or bias) and ("param", parameter, its module's loader for it
    or None); `tables` (embeddings, heads) load whole and are left out."""
    loaders: dict[str, tuple] = {}
    owned: set[int] = set()
    for name, module in root.named_modules():
        if isinstance(module, PartitionedLinear):
            parent, _, own = name.rpartition(".")
            for checkpoint, (part, kind) in module.checkpoint_names(parent, own).items():
                loaders[checkpoint] = ("linear", module, part, kind)
            owned.update(id(p) for p in module.parameters())
    for module in tables:
        owned.update(id(p) for p in module.parameters())
    for module_name, module in root.named_modules():
        custom = getattr(module, "param_loaders", {})
        for local, param in module.named_parameters(recurse=False):
            if id(param) not in owned:
                name = f"{module_name}.{local}" if module_name else local
                loaders[name] = ("param", param, custom.get(local))
    return loaders


def load_tensor(loader: tuple, tensor) -> None:
    """One checkpoint tensor through its loader: a projection's part, a parameter, or a table
    ("table", module: an embedding or head of its own, `module.load(tensor)`)."""
    kind = loader[0]
    if kind == "linear":
        _, layer, part, weight_or_bias = loader
        layer.load(part, weight_or_bias, tensor)
    elif kind == "table":
        loader[1].load(tensor)
    else:
        _, param, load = loader
        if load is not None:
            load(param, tensor)
        else:
            param.data.copy_(_whole(tensor))


def check_tensor(loader: tuple, name: str, tensor, config: ModelConfig) -> None:
    """Refuse a tensor whose shape disagrees with the config, or that holds no float (or
    block-quantized) numbers, naming it: loading it would fail deep in a copy with a bare
    size error, or worse, broadcast or cast it silently."""
    shape, dtype = _shape_and_dtype(tensor)
    if dtype is not None and dtype not in _WEIGHT_DTYPES:
        raise CorruptModelFileError(f"checkpoint tensor {name!r} has type {dtype}; a weight "
                                    "must be floating point")
    expected = _expected_shape(loader, config)
    if expected is not None and tuple(shape) != expected:
        raise CorruptModelFileError(
            f"checkpoint tensor {name!r} has shape {list(shape)}, the config "
            f"({config.architecture}) gives {list(expected)}")


def _expected_shape(loader: tuple, config: ModelConfig) -> tuple[int, ...] | None:
    """The whole model's shape of a checkpoint tensor (None: a custom loader checks)."""
    kind = loader[0]
    if kind == "linear":
        _, layer, part, weight_or_bias = loader
        parts = layer.parts if part is None else [layer.parts[part]]
        rows = sum(p.full_rows for p in parts)
        return (rows, layer.full_in_features) if weight_or_bias == "weight" else (rows,)
    if kind in ("head", "embedding", "table"):
        return (config.vocab_size, config.hidden_size)
    _, param, load = loader
    return tuple(param.shape) if load is None else None


def check_complete(root: nn.Module, loaders: dict[str, tuple], loaded: set[str],
                   what: str = "checkpoint") -> None:
    """Every loader's tensor arrived (a projection counts its parts), or a named error."""
    missing = sorted(name for name, loader in loaders.items()
                     if loader[0] != "linear" and name not in loaded)
    for name, module in root.named_modules():
        if isinstance(module, PartitionedLinear) and not module.loaded:
            missing += module.missing_names(name.rpartition(".")[0])
    if missing:
        raise CorruptModelFileError(
            f"{what} lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}")


# a checkpoint's weight types (torch's, and safetensors' names for a lazy slice's)
_WEIGHT_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64,
                  "F32", "F16", "BF16", "F64"}


def _shape_and_dtype(tensor) -> tuple[tuple[int, ...], object]:
    """A torch tensor's, a lazy safetensors slice's, or QuantizedRows' (dtype None: its block
    type was checked when the file was read)."""
    if isinstance(tensor, torch.Tensor):
        return tuple(tensor.shape), tensor.dtype
    if hasattr(tensor, "get_shape"):
        return tuple(tensor.get_shape()), tensor.get_dtype()
    return tuple(tensor.shape), None


def _whole(tensor) -> torch.Tensor:
    """A tensor, or a lazy safetensors slice read whole."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def check_backend_support(config: ModelConfig, backend: AttentionBackend) -> None:
    """Refuse, at load, a backend that would attend past a windowed layer's window (every token
    after the window would then be wrong) or could not soft-cap scores (Gemma 2)."""
    windowed = [i for i in range(config.num_hidden_layers) if config.sliding_window(i)]
    name = getattr(backend, "name", type(backend).__name__)
    if windowed and not getattr(backend, "supports_sliding_window", False):
        raise UnsupportedArchitectureError(
            f"this {config.architecture} model uses sliding-window attention on {len(windowed)} "
            f"of its {config.num_hidden_layers} layers (window "
            f"{config.sliding_window(windowed[0])}), which the attention backend {name!r} "
            "cannot apply; use the 'paged', 'torch_ref' or 'sdpa_batched' backend")
    cap = config.attn_logit_softcapping
    if cap and not getattr(backend, "supports_softcap", False):
        raise UnsupportedArchitectureError(
            f"this {config.architecture} model soft-caps attention scores ({cap}), which the "
            f"attention backend {name!r} cannot do")
    if config.attention_sinks and not getattr(backend, "supports_sinks", False):
        raise UnsupportedArchitectureError(
            f"this {config.architecture} model adds learned sink logits to each head's "
            f"attention softmax, which the attention backend {name!r} cannot do")
