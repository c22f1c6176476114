"""A test-only worker behaviour that emits 1-4 tokens per request per step, so the step
contract (several new tokens at once, as speculative decoding gives) is exercised through the
real scheduler, output processor and server long before a real proposer exists.

It is a general plugin (`KVSERVE_PLUGINS=kvserve.testing.multi_token:register`, or
`enable()` in the test's own process). After the real step, a greedy request that sampled gets
up to 3 more tokens by looking ahead: the worker runs its own model one token at a time past
the request's computed tokens, writing their K/V into the request's unused slots and into
scratch blocks the scheduler never hands out (the pool is allocated a few blocks larger). The
scheduler then sees tokens whose KV is not computed yet and computes them in the next step,
exactly as it would accepted drafts without their KV. Greedy tokens equal a one-token run's.
Only for one rank (`uni`): it runs the model outside the ranks' collectives.
"""

from __future__ import annotations

import functools
import zlib

from kvserve.testing.plugin_switch import PluginSwitch
from kvserve.worker.request_state import CachedRequestState, RunnerInput, ScheduledItem

PLUGIN = "kvserve.testing.multi_token:register"
MAX_EXTRA_TOKENS = 3
SCRATCH_BLOCKS = 2

_counts = {"multi_token_steps": 0}


def multi_token_steps() -> int:
    """How many times a request got more than one token in a step (in this process)."""
    return _counts["multi_token_steps"]


def extra_tokens(request_id: str, num_output_tokens: int) -> int:
    """0..3, varying from step to step and request to request, the same in every run."""
    return zlib.crc32(f"{request_id}:{num_output_tokens}".encode()) % (MAX_EXTRA_TOKENS + 1)


def _install() -> None:
    from kvserve.worker.worker import Worker

    original_init_kv, original_execute = Worker.init_kv_cache, Worker.execute

    @functools.wraps(original_init_kv)
    def init_kv_cache(self, message):
        self._scratch_blocks = None
        if _switch.enabled:
            self._scratch_blocks = list(range(message.num_blocks,
                                              message.num_blocks + SCRATCH_BLOCKS))
            message = type(message)(message.num_blocks + SCRATCH_BLOCKS, message.block_size)
        return original_init_kv(self, message)

    @functools.wraps(original_execute)
    def execute(self, step):
        result = original_execute(self, step)
        if result is None or not _switch.enabled or not getattr(self, "_scratch_blocks", None):
            return result
        output = result.output
        for request_id, tokens in output.sampled_token_ids.items():
            state = self.requests[request_id]
            if not state.sampling_params.greedy:
                continue
            for _ in range(extra_tokens(request_id, len(state.output_token_ids))):
                token, logprobs = _look_ahead(self, state)
                tokens.append(token)
                state.output_token_ids.append(token)
                state.all_token_ids.append(token)
                if logprobs is not None:
                    output.logprobs[request_id].append(logprobs)
            _counts["multi_token_steps"] += len(tokens) > 1
        return result

    Worker.init_kv_cache, Worker.execute = init_kv_cache, execute


_switch = PluginSwitch(_install)
register = _switch.register
enable = _switch.enable


def _look_ahead(worker, state: CachedRequestState):
    """The next greedy token after the request's last one, computed alone (the last token's
    K/V goes into the request's own unused slot or a scratch block)."""
    position = len(state.prompt_token_ids) + len(state.output_token_ids) - 1
    block_size = worker.runner.block_size
    needed = position // block_size + 1
    table = (state.block_ids + worker._scratch_blocks)[:needed]
    if len(table) < needed:
        raise RuntimeError("look-ahead past the scratch blocks")
    probe = CachedRequestState(state.request_id, state.prompt_token_ids, state.sampling_params,
                               state.output_token_ids, table)
    step = RunnerInput([ScheduledItem(probe, [state.output_token_ids[-1]], position, True)], [])
    output = worker.runner.execute(step)
    logprobs = output.logprobs.get(state.request_id)
    return output.sampled_token_ids[state.request_id][0], logprobs[0] if logprobs else None
