"""A model family defined outside the package, in one file, registered through the
`kvserve.model_families` entry point: a parallel-block decoder (GPT-J / Falcon style: attention and
MLP both read one norm of the residual, both added back) composed of the shared layers, loaded
from an HF directory whose config names it, checked against a plain torch implementation of the
same maths, on the reference and the paged backends and through the engine."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kvserve.models import registry
from kvserve.models.paged_loop import PagedLoop
from kvserve.testing.tiny import tiny_config, write_tokenizer_files

FAMILY_FILE = '''
"""A parallel-block decoder: x + attn(norm(x)) + mlp(norm(x))."""
from torch import nn

from kvserve.config import FamilyRules
from kvserve.models import register_model
from kvserve.models.layers.attention import SelfAttention
from kvserve.models.layers.causal_lm import CausalLM
from kvserve.models.layers.mlp import GatedMLP
from kvserve.models.layers.norm import RMSNorm


class ParallelBlock(nn.Module):
    def __init__(self, config, self_attn, mlp):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn, self.mlp = self_attn, mlp

    def forward(self, ops, positions, hidden, residual, metadata):
        if residual is None:
            residual, hidden = hidden, ops.rms_norm(hidden, self.input_layernorm)
        else:
            ops.add_rms_norm_(hidden, residual, self.input_layernorm)
        attended = self.self_attn(ops, positions, hidden, metadata)
        ops.add_(attended, self.mlp(ops, hidden))
        return attended, residual


class ParallelForCausalLM(CausalLM):
    def decoder_layer(self, config, index, prefix, rotary):
        attention = SelfAttention(config.hidden_size, config.num_attention_heads,
                                  config.num_key_value_heads, config.head_dim, rotary,
                                  self.quant, f"{prefix}.self_attn", parallel=self.parallel)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, "silu", self.quant,
                       f"{prefix}.mlp", self.parallel)
        return ParallelBlock(config, attention, mlp)


class ParallelBlockRules(FamilyRules):
    """Its config.json names the model type parallel_block and the MLP width ffn_hidden_size."""
    architecture = "parallelblock"
    hf_model_type = "parallel_block"
    hf_class_name = "ParallelForCausalLM"

    def from_hf(self, hf):
        return super().from_hf(dict(hf, intermediate_size=hf["ffn_hidden_size"]))

    def to_hf(self, config):
        hf = super().to_hf(config)
        hf["ffn_hidden_size"] = hf.pop("intermediate_size")
        return hf


def register():
    register_model("parallelblock", ParallelForCausalLM, config_rules=ParallelBlockRules())
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The family's file and an installed distribution's entry point naming it."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "parallelblock_family.py").write_text(FAMILY_FILE)
    dist = root / "parallelblock_family-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: parallelblock-family\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [kvserve.model_families]
        parallelblock = parallelblock_family:register
        """))
    sys.path.insert(0, str(root))
    registry.rediscover()
    yield root
    sys.path.remove(str(root))
    registry.rediscover()


def reference_logits(state: dict, config, tokens: list[int]) -> torch.Tensor:
    """The parallel-block maths in plain torch, from the checkpoint's tensors."""
    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, \
        config.head_dim
    positions = torch.arange(len(tokens)).float()
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(positions, inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x):  # [T, H, D]
        first, second = x.chunk(2, -1)
        return x * cos[:, None] + torch.cat([-second, first], -1) * sin[:, None]

    x = state["model.embed_tokens.weight"][tokens]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, state[p + "input_layernorm.weight"])
        q = rope((h @ state[p + "self_attn.q_proj.weight"].T).view(-1, heads, dim))
        k = rope((h @ state[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim))
        v = (h @ state[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        attended = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                  v.transpose(0, 1), is_causal=True)
        attended = attended.transpose(0, 1).reshape(len(tokens), -1)
        mlp = (F.silu(h @ state[p + "mlp.gate_proj.weight"].T) * (
            h @ state[p + "mlp.up_proj.weight"].T)) @ state[p + "mlp.down_proj.weight"].T
        x = x + attended @ state[p + "self_attn.o_proj.weight"].T + mlp
    return norm(x, state["model.norm.weight"]) @ state["model.embed_tokens.weight"].T


@pytest.fixture(scope="module")
def checkpoint(plugin, tmp_path_factory, tokenizer):
    """An HF directory of the family (random weights drawn through its own loaders)."""
    from safetensors.torch import save_file

    from kvserve.models import random_model

    registry.check_architecture("parallelblock")  # discovers the plugin (and its config rules)
    config = tiny_config(architecture="parallelblock")
    model = random_model(config, "float32", seed=7)
    directory = tmp_path_factory.mktemp("parallelblock")
    state = {k: v.contiguous() for k, v in model.hf_state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    write_tokenizer_files(directory, tokenizer)
    return directory, config, state


def test_the_family_is_found_through_its_entry_point(plugin):
    assert registry.model_class_for("parallelblock").__name__ == "ParallelForCausalLM"
    assert "parallelblock" in registry.registered_architectures()


def test_its_config_is_read_by_its_own_rules(checkpoint):
    """The family's config rules (registered with it) read a config.json whose fields the
    shared reading does not know: its own model_type and MLP width name."""
    from kvserve.model_source import resolve_model
    from kvserve.weights.loader import load_config

    directory, config, _ = checkpoint
    raw = json.loads((directory / "config.json").read_text())
    assert raw["model_type"] == "parallel_block" and "intermediate_size" not in raw
    assert load_config(resolve_model(directory), use_cache=False,
                       check_architecture=registry.check_architecture) == config


@pytest.mark.parametrize("backend", ["torch_ref", "paged"])
def test_logits_equal_the_plain_torch_maths(checkpoint, backend):
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    directory, config, state = checkpoint
    model, _ = load_model(resolve_model(directory), "float32", attention_backend=backend)
    tokens = [(7 * i + 3) % 300 + 5 for i in range(24)]
    ours = PagedLoop(model, 1, 64).step([tokens], [len(tokens)], [0], all_logits=True)[0]
    assert (ours - reference_logits(state, config, tokens)).abs().max() < 1e-4


def test_decodes_through_the_stack_recorded_from_its_own_layer(checkpoint):
    """The decode stack is the family's own forward, recorded: its greedy decode equals the
    Python loop's to the bit."""
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    directory, _, _ = checkpoint
    model, _ = load_model(resolve_model(directory), "float32", attention_backend="paged")
    prompts = [[5, 9, 13, 17], [21, 25, 29]]
    outputs = {}
    for eager in (False, True):
        model.model.enforce_eager = eager
        model.model.reset_decode_stack()
        outputs[eager] = PagedLoop(model, 2, 64).greedy(prompts, 10)
        if not eager and model.kernel_ops.compiled:
            assert type(model.model._decode_stack).__name__ == "DecodeStack"
    assert outputs[False] == outputs[True]


def test_the_engine_serves_it(checkpoint):
    from kvserve import LLM, SamplingParams

    directory, _, _ = checkpoint
    llm = LLM(model=str(directory), dtype="float32", engine_core="thread", num_kv_blocks=64)
    try:
        output = llm.generate(["the quick brown fox"],
                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert len(output[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()


def test_a_family_registered_by_name_is_imported_only_when_built(monkeypatch):
    """"module:Class" registers a family without importing it: its name passes the check (what
    the API front-end does, without torch); building it imports the module, and one that cannot
    be imported is a PluginError naming it."""
    from kvserve.plugins import PluginError

    monkeypatch.setitem(registry._models, "lazyfamily", "kvserve_no_such_module:Model")
    registry.check_architecture("lazyfamily")
    assert "lazyfamily" in registry.registered_architectures()
    with pytest.raises(PluginError, match="kvserve_no_such_module:Model cannot be imported"):
        registry.model_class_for("lazyfamily")
    with pytest.raises(ValueError, match="package.module:ClassName"):
        registry.register_model("lazyfamily", "no_colon")
    monkeypatch.setitem(registry._models, "lazyllama",
                        "kvserve.models.families.llama:LlamaForCausalLM")
    assert registry.model_class_for("lazyllama").__name__ == "LlamaForCausalLM"
    assert registry._models["lazyllama"] is registry.model_class_for("lazyllama")
