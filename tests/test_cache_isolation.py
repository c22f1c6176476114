"""Prefix-cache isolation (vLLM's `cache_salt`, and one salt per tenant on a server with several
API keys): requests with different salts never share a prefix block, so one caller cannot learn
another's prompts from how fast its first token comes; the same salt still hits."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.protocol.block_hash import block_hashes, salted_root

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_a_salt_changes_every_block_hash_and_the_same_salt_gives_the_same():
    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, cache_salt="tenant-a")
    assert salted_root(None) is None and salted_root("") is None
    assert block_hashes(tokens, 16, cache_salt=None) == plain
    assert block_hashes(tokens, 16, cache_salt="tenant-a") == salted
    assert not set(plain) & set(salted)
    assert not set(salted) & set(block_hashes(tokens, 16, cache_salt="tenant-b"))


def test_salts_never_share_prefix_blocks_and_change_no_token(tiny_llm):
    prompt = "isolation of tenants in the prefix cache " * 6

    def run(salt):
        item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        return tiny_llm.generate(item, GREEDY, use_tqdm=False)[0]

    first_a, again_a, first_b, plain, again_plain = (run(s) for s in ("a", "a", "b", None,
                                                                       None))
    assert first_a.num_cached_tokens == 0
    assert again_a.num_cached_tokens >= 32
    assert first_b.num_cached_tokens == 0
    assert plain.num_cached_tokens == 0
    assert again_plain.num_cached_tokens >= 32
    tokens = {tuple(o.outputs[0].token_ids) for o in (first_a, again_a, first_b, plain)}
    assert len(tokens) == 1


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_salt_that_is_not_a_non_empty_string_is_refused(tiny_llm, salt):
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        tiny_llm.llm_engine.prepare_request("bad-salt", {"prompt": "x", "cache_salt": salt})
