"""MTP drafts (spec_decode/mtp.py, models/layers/mtp.py): DeepSeek-V3's next-token-prediction
modules as speculative decoding's proposer, in the worker beside the target.

HF transformers does not run MTP modules, so the reference here is built from HF's own pieces:
a tiny DeepSeek-V3 saved by HF, its MTP module's decoder block taken from a second HF model one
layer deeper (its last layer, an MoE layer as V3's MTP layer is), and the module's norms,
projection and head as DeepSeek's checkpoints name them. The reference runs the module over a
whole sequence with HF's causal attention: its argmax at the last known position is the draft
the engine must make, whatever chunking, batching and verification came before."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvserve.sampling_params import SamplingParams
from tests.helpers import TINY_FAMILY_SHAPE, randomise_norms, save_hf_checkpoint

transformers = pytest.importorskip("transformers")

LAYERS = 3
CONFIG = dict(TINY_FAMILY_SHAPE, num_hidden_layers=LAYERS, num_key_value_heads=4,
              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
              topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
              max_position_embeddings=256, num_nextn_predict_layers=1)
PROMPTS = [[(7 * i + 13 * j) % 4000 + 5 for j in range(n)] for i, n in enumerate((37, 5, 70))]


class ReferenceMTP:
    """One MTP module from HF's parts (module docstring), and its checkpoint tensors."""

    def __init__(self, hf_config, target, seed: int = 3, chain: bool = False):
        """`chain`: the module (and `target`, already so) with every attention output and
        MLP down projection zero, its projection passing the next token's normed embedding
        through, its head norm the target's final norm: it then predicts exactly what the
        target will (module docstring of `chain_case`)."""
        deeper = copy.deepcopy(hf_config)
        deeper.num_hidden_layers = LAYERS + 1
        torch.manual_seed(seed)
        self.deeper = transformers.AutoModelForCausalLM.from_config(
            deeper, attn_implementation="eager").eval()
        randomise_norms(self.deeper)
        generator = torch.Generator().manual_seed(seed)
        hidden = hf_config.hidden_size
        self.block = self.deeper.model.layers[LAYERS]
        with torch.no_grad():
            bias = self.block.mlp.gate.e_score_correction_bias
            bias.copy_(0.4 * torch.randn(bias.shape, generator=generator))
        self.target = target
        self.enorm = torch.rand(hidden, generator=generator) + 0.5
        self.hnorm = torch.rand(hidden, generator=generator) + 0.5
        self.head_norm = torch.rand(hidden, generator=generator) + 0.5
        self.eh_proj = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
        self.eps = hf_config.rms_norm_eps
        if chain:
            silence(self.deeper)
            self.enorm = torch.ones(hidden)
            self.head_norm = target.model.norm.weight.detach().clone()
            self.eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)

    def tensors(self, scratch) -> dict[str, torch.Tensor]:
        """The module's tensors as a V3 checkpoint names them (the block's as HF saves its
        layer: experts one by one), `scratch` a directory to save the deeper model in."""
        from safetensors.torch import load_file

        prefix = f"model.layers.{LAYERS}."
        self.deeper.save_pretrained(scratch)
        block = {name: tensor for file in sorted(Path(scratch).glob("*.safetensors"))
                 for name, tensor in load_file(str(file)).items() if name.startswith(prefix)}
        return {**block, prefix + "enorm.weight": self.enorm, prefix + "hnorm.weight": self.hnorm,
                prefix + "eh_proj.weight": self.eh_proj,
                prefix + "shared_head.norm.weight": self.head_norm,
                prefix + "shared_head.head.weight": self.target.lm_head.weight.detach().clone(),
                prefix + "embed_tokens.weight":
                    self.target.model.embed_tokens.weight.detach().clone()}

    def _norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    @torch.no_grad()
    def drafts(self, tokens: list[int], count: int) -> list[int]:
        """The drafts after `tokens` (whose last is the one just sampled): the module at the
        last known position, then (count > 1) again one position on, on its own output."""
        ids = torch.tensor([tokens])
        hidden = self.target.model(ids).last_hidden_state[0]
        inputs = self._inputs(torch.tensor(tokens[1:]), hidden[:-1])
        drafts = []
        for _ in range(count):
            out = self._block(inputs)
            drafts.append(int((self._norm(out[-1], self.head_norm)
                               @ self.target.lm_head.weight.T).argmax()))
            inputs = torch.cat([inputs, self._inputs(torch.tensor(drafts[-1:]), out[-1:],
                                                     first=inputs.shape[0])])
        return drafts

    def _inputs(self, next_ids, previous, first: int = 0):
        embedded = self.target.model.embed_tokens(next_ids)
        if first == 0:
            embedded[0] = 0.0  # position 0
        joined = torch.cat([self._norm(embedded, self.enorm),
                            self._norm(previous, self.hnorm)], dim=-1)
        return joined @ self.eh_proj.T

    def _block(self, inputs):
        from transformers.masking_utils import create_causal_mask

        x = inputs.unsqueeze(0)
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=self.deeper.config, inputs_embeds=x,
                                  attention_mask=None, cache=None, position_ids=positions)
        rotary = self.deeper.model.rotary_emb(x, positions)
        return self.block(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=rotary)[0]


def silence(hf_model) -> None:
    """Every attention output and MLP (expert, shared expert) down projection zero: each
    layer adds nothing to the residual stream."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.zero_()


@pytest.fixture(scope="module")
def chain_case(tmp_path_factory, tokenizer):
    """A target whose layers add nothing (its next token a function of the current one,
    t -> argmax head(norm(embed(t)))) and an MTP module that applies the same function to
    the token after: its drafts are the target's next tokens, so nearly all are accepted."""
    directory = tmp_path_factory.mktemp("deepseek-v3-mtp-chain")
    hf_config = transformers.DeepseekV3Config(**CONFIG)
    target = save_hf_checkpoint(hf_config, directory, tokenizer)
    silence(target)
    target.save_pretrained(directory)
    reference = ReferenceMTP(hf_config, target, chain=True)
    save_file(reference.tensors(tmp_path_factory.mktemp("deeper")),
              str(directory / "mtp.safetensors"))
    return {"dir": directory}


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("deepseek-v3-mtp")
    hf_config = transformers.DeepseekV3Config(**CONFIG)
    target = save_hf_checkpoint(hf_config, directory, tokenizer)
    reference = ReferenceMTP(hf_config, target)
    save_file(reference.tensors(tmp_path_factory.mktemp("deeper")),
              str(directory / "mtp.safetensors"))
    return {"dir": directory, "reference": reference, "target": target}


def _llm(directory, tokens: int | None = None, **options):
    from kvserve import LLM

    spec = None if tokens is None else {"method": "mtp", "num_speculative_tokens": tokens,
                                        "adaptive": False}
    return LLM(model=str(directory), dtype="float32", engine_core="thread",
               speculative_config=spec, **options)


def _greedy(llm, count: int = 12):
    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_drafts_are_the_modules_argmax_over_the_whole_context(mtp_case, num_drafts):
    """Every proposal, after chunked prefill, batched decodes and verifications, equals the
    reference module's over the request's whole sequence: the module's KV holds every
    position the target computed, fed the right next token."""
    from kvserve.spec_decode.mtp import MTPProposer

    seen = []
    propose = MTPProposer.propose

    def recording(self, step):
        drafts = propose(self, step)
        seen.extend((list(step.requests[r].all_token_ids), d) for r, d in drafts.items())
        return drafts

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MTPProposer, "propose", recording)
        llm = _llm(mtp_case["dir"], num_drafts, max_num_batched_tokens=32, block_size=16)
        try:
            _greedy(llm)
        finally:
            llm.shutdown()
    assert len(seen) >= 20
    reference = mtp_case["reference"]
    for tokens, drafts in seen:
        expected = reference.drafts(tokens, num_drafts)
        # a draft whose position would cross into a block not yet allocated is not made
        assert drafts == expected[:len(drafts)] and drafts


def test_greedy_tokens_with_mtp_equal_without(mtp_case):
    """Greedy output with two MTP drafts a step is the target's own (chunked prefill and
    prefix hits on), and the verifications are counted."""
    llm = _llm(mtp_case["dir"], max_num_batched_tokens=32)
    try:
        expected = _greedy(llm, 16)
    finally:
        llm.shutdown()
    llm = _llm(mtp_case["dir"], 2, max_num_batched_tokens=32)
    try:
        assert _greedy(llm, 16) == expected
        assert _greedy(llm, 16) == expected  # again, over the cached prefixes
        stats = llm.llm_engine.engine_core.drafter.stats
        assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    finally:
        llm.shutdown()


def test_drafts_the_module_gets_right_are_accepted(chain_case):
    """Where the module predicts the target's tokens, two drafts a step are nearly all
    accepted: the tokens are the target's, in about a third of the steps."""
    llm = _llm(chain_case["dir"])
    try:
        expected = _greedy(llm, 24)
    finally:
        llm.shutdown()
    llm = _llm(chain_case["dir"], 2)
    try:
        assert _greedy(llm, 24) == expected
        stats = llm.llm_engine.engine_core.drafter.stats
    finally:
        llm.shutdown()
    assert stats.num_draft_tokens >= 30
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    # the second draft too, where made (not across into a block the step has not allocated)
    assert stats.accepted_per_position[1] >= 0.75 * stats.accepted_per_position[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_server_reports_mtp_acceptance_in_usage_and_metrics(chain_case, tmp_path):
    """`kvserve serve --speculative-config '{"method": "mtp", ...}'`: OpenAI's predicted-output
    counts in `usage` and vLLM's spec_decode counters in /metrics, per position."""
    import json

    import httpx

    from kvserve.testing.server import ServerProcess
    from tests.helpers import read_metrics, tiny_server_flags

    flags = tiny_server_flags(chain_case["dir"], "--speculative-config", json.dumps(
        {"method": "deepseek_mtp", "num_speculative_tokens": 2, "adaptive": False}),
                              kv_blocks=256,
                              max_model_len=256)
    with ServerProcess(flags, log_path=tmp_path / "server.log") as server:
        answer = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}).json()
        metrics = read_metrics(server.base_url)
    details = answer["usage"]["completion_tokens_details"]
    drafted = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    assert drafted >= 10 and details["accepted_prediction_tokens"] >= 0.9 * drafted
    assert metrics["kvserve:spec_decode_num_draft_tokens_total"] == drafted
    assert metrics["kvserve:spec_decode_num_accepted_tokens_per_pos_total"] == \
        details["accepted_prediction_tokens"]


def test_an_mtp_count_the_checkpoint_lacks_fails_at_load(mtp_case, tmp_path):
    """A config naming more MTP modules than the file holds, a model with none in its
    config, or MTP beside tensor parallelism, each fail at start with an error naming it."""
    import json
    import shutil

    from kvserve import LLM
    from kvserve.errors import CorruptModelFileError, UnsupportedArchitectureError

    two = tmp_path / "two"
    shutil.copytree(mtp_case["dir"], two)
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=2)))
    with pytest.raises(CorruptModelFileError, match=r"no MTP module 1 \(no model\.layers\.4"):
        _llm(two, 2)
    none = tmp_path / "none"
    shutil.copytree(mtp_case["dir"], none)
    (none / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    with pytest.raises(UnsupportedArchitectureError, match="num_nextn_predict_layers is 0"):
        _llm(none, 1)
    (none / "mtp.safetensors").unlink()  # a V3 checkpoint without its MTP tensors
    (none / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptModelFileError, match=r"no MTP module 0 \(no model\.layers\.3"):
        _llm(none, 1)
    with pytest.raises(ValueError, match="'model'"):
        LLM(model=str(mtp_case["dir"]), speculative_config={
            "method": "mtp", "num_speculative_tokens": 1, "model": str(mtp_case["dir"])})


def test_drafts_that_miss_stop_being_made(mtp_case):
    """With the step-cost model on, a module whose drafts all miss (random weights) is asked
    for fewer and fewer: its head runs on a few retries, its KV fill on every step."""
    from kvserve import LLM
    from kvserve.spec_decode.mtp import MTPProposer

    fills, propose = [], MTPProposer.propose

    def counting(self, step):
        fills.append(sum(step.limits.values()))
        return propose(self, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MTPProposer, "propose", counting)
        llm = LLM(model=str(mtp_case["dir"]), dtype="float32", engine_core="thread",
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        try:
            _greedy(llm, 64)
            stats = llm.llm_engine.engine_core.drafter.stats
        finally:
            llm.shutdown()
    assert len(fills) >= 60  # every step, warm-up and profiling included
    assert stats.num_accepted_tokens <= 0.1 * stats.num_draft_tokens
    assert stats.num_drafts <= 0.3 * 64 * len(PROMPTS)
