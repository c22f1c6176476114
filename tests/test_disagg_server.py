"""Disaggregated prefill/decode through two servers (process cores), driven the way a proxy
drives them (vLLM's toy proxy flow; the router's disaggregated mode does the same): the prompt
to the prefill server with max_tokens 1 and kv_transfer_params {"do_remote_decode": true},
the handle it answers with to the decode server. Greedy tokens equal one aggregated server's,
usage reports the transferred tokens, chat works too, and both servers end idle with no KV
block in use; a prefill server killed with -9 before the pull makes the decode side recompute
within the transfer timeout."""

from __future__ import annotations

import time

import httpx
import pytest

from kvserve.testing.server import ServerProcess
from tests.helpers import complete_with_kv, kill_server_tree, tiny_server_flags, wait_idle

pytestmark = pytest.mark.multiprocess

PROMPTS = [f"Conversation {i}: tell me about the weather in city number {i}. " * (1 + i % 3)
           for i in range(16)]


def _servers(model_dir, tmp_path, decode_extra=()):
    prefill = ServerProcess(tiny_server_flags(model_dir, "--kv-role", "prefill"),
                            log_path=tmp_path / "prefill.log")
    decode = ServerProcess(tiny_server_flags(model_dir, "--kv-role", "decode", *decode_extra),
                           log_path=tmp_path / "decode.log")
    return prefill, decode


def test_prefill_then_decode_servers_match_one_server(tiny_model_dir, tmp_path):
    prefill, decode = _servers(tiny_model_dir, tmp_path)
    with prefill, decode:
        for prompt in PROMPTS:
            expected = complete_with_kv(prefill.base_url, prompt, 16)  # no kv params: aggregated
            handed = complete_with_kv(prefill.base_url, prompt, 1, {"do_remote_decode": True})
            handle = handed["kv_transfer_params"]
            assert handle["do_remote_prefill"] and handle["remote_block_ids"]
            got = complete_with_kv(decode.base_url, prompt, 16, handle)
            assert got["choices"][0]["text"] == expected["choices"][0]["text"]
            prompt_tokens = got["usage"]["prompt_tokens"]
            assert got["usage"]["prompt_tokens_details"]["transferred_tokens"] == \
                prompt_tokens - 1
        chat = {"messages": [{"role": "user", "content": "Say something about rivers."}],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(prefill.base_url + "/v1/chat/completions", json=chat,
                              timeout=60).json()
        handed = httpx.post(prefill.base_url + "/v1/chat/completions", timeout=60, json={
            **chat, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        got = httpx.post(decode.base_url + "/v1/chat/completions", timeout=60, json={
            **chat, "kv_transfer_params": handed["kv_transfer_params"]}).json()
        assert got["choices"][0]["message"] == expected["choices"][0]["message"]
        for server in (prefill, decode):
            metrics = wait_idle(server.base_url, timeout=10)
            assert metrics["kvserve:kv_cache_usage_perc"] == 0


def test_a_killed_prefill_server_makes_the_decode_side_recompute(tiny_model_dir, tmp_path):
    prefill, decode = _servers(tiny_model_dir, tmp_path, decode_extra=(
        "--kv-transfer-config", '{"kv_connector_extra_config": {"transfer_timeout_s": 1}}'))
    prompt = PROMPTS[5]
    with decode:
        with prefill:
            expected = complete_with_kv(prefill.base_url, prompt, 12)
            handle = complete_with_kv(prefill.base_url, prompt, 1,
                                      {"do_remote_decode": True})["kv_transfer_params"]
            # the whole server: its engine core (which serves the held KV) first
            kill_server_tree(prefill)
        started = time.monotonic()
        got = complete_with_kv(decode.base_url, prompt, 12, handle)
        assert time.monotonic() - started < 15
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert got["usage"]["prompt_tokens_details"]["transferred_tokens"] == 0
        assert wait_idle(decode.base_url, timeout=10)["kvserve:kv_cache_usage_perc"] == 0
