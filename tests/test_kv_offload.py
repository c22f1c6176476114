"""KV offload tiers (kv_transfer/offload/): blocks the pool evicts are kept in RAM and/or on disk
and loaded back, counted as cached tokens, with the same greedy tokens as recomputing them; the
disk tier outlives a restart; a corrupt, truncated or half-written file is never served, a full
disk only costs recomputes, and a writer killed with -9 leaves no file under a real name that
does not verify."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv_transfer.offload import store

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
FINGERPRINT = bytes(range(16))


# ---- the disk tier's files ---------------------------------------------------------------
def test_a_block_file_reads_back_and_every_damage_is_refused_and_deleted(tmp_path):
    payload = os.urandom(4096)
    store.write_block(tmp_path, FINGERPRINT, 0xABC, 1, payload)
    assert store.read_block(tmp_path, FINGERPRINT, 0xABC, 1, len(payload)) == payload
    path = store.block_file(tmp_path, 0xABC, 1)

    def damaged(change, **expect) -> str:
        store.write_block(tmp_path, FINGERPRINT, 0xABC, 1, payload)
        data = bytearray(path.read_bytes())
        path.write_bytes(change(data))
        with pytest.raises(store.CorruptBlockError) as error:
            store.read_block(tmp_path, expect.get("fingerprint", FINGERPRINT), 0xABC, 1,
                             len(payload))
        assert not path.exists()
        return str(error.value)

    def flip_last(data):
        data[-1] ^= 0xFF
        return bytes(data)

    assert "checksum" in damaged(flip_last)
    assert "payload" in damaged(lambda data: bytes(data[:-100]))
    assert "header" in damaged(lambda data: bytes(data[:10]))
    assert "another" in damaged(bytes, fingerprint=bytes(16))
    with pytest.raises(store.CorruptBlockError):
        store.read_block(tmp_path, FINGERPRINT, 0xDEF, 1, len(payload))  # never written


def test_scan_finds_whole_blocks_oldest_first_and_removes_leftover_temporaries(tmp_path):
    for block_hash in (3, 1, 2):
        for rank in (0, 1):
            store.write_block(tmp_path, FINGERPRINT, block_hash, rank, b"x")
        time.sleep(0.01)
    store.write_block(tmp_path, FINGERPRINT, 9, 0, b"x")  # rank 1's file is missing
    leftover = tmp_path / "0000000000000005.r0.kv.123.tmp"
    leftover.write_bytes(b"half")
    assert store.scan(tmp_path, world_size=2) == [3, 1, 2]
    assert not leftover.exists()


_WRITER = """
import os, sys
from pathlib import Path
from kvserve.kv_transfer.offload import store
folder = Path(sys.argv[1])
payload = os.urandom(1 << 20)
print("ready", flush=True)
index = 0
while True:
    store.write_block(folder, bytes(range(16)), index, 0, payload)
    index += 1
"""


def test_a_writer_killed_mid_write_leaves_only_whole_files(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)],
                              stdout=subprocess.PIPE)
    assert writer.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    written = store.scan(tmp_path, world_size=1)
    assert written
    for block_hash in written:
        assert len(store.read_block(tmp_path, FINGERPRINT, block_hash, 0, 1 << 20)) == 1 << 20
    assert not list(tmp_path.glob("*.tmp"))


# ---- the engine with tiers -----------------------------------------------------------------
def _prompts(tokenizer) -> list[list[int]]:
    """Six prompts of 80 tokens (5 blocks), no two sharing a block."""
    words = tokenizer.encode(" ".join(f"word{i}" for i in range(600)), add_special_tokens=False)
    return [words[i * 80:(i + 1) * 80] for i in range(6)]


def _engine(tiny_model_dir, **options) -> LLM:
    """A pool of 16 blocks: three prompts' worth, so the later ones evict the first. Tiers load
    every run they hold (the tests here assert loads; on the tiny model the measured policy
    may rightly recompute: its choice is tested on its own below)."""
    options.setdefault("kv_offload_load_policy", "always")
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, block_size=16,
               max_model_len=128, engine_core="thread", **options)


def _run(engine: LLM, prompts) -> list:
    return [engine.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
            for p in prompts]


def _connector(engine: LLM):
    return engine.llm_engine.engine_core.scheduler.connector


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tokenizer):
    prompts = _prompts(tokenizer)
    with LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
             engine_core="thread", enable_prefix_caching=False) as engine:
        return prompts, [o.outputs[0].token_ids for o in _run(engine, prompts)]


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_evicted_prefixes_come_back_from_a_tier_as_cached_tokens(tiny_model_dir, reference,
                                                                 tmp_path, tier):
    prompts, expected = reference
    options = ({"kv_offload_ram_bytes": 8 << 20} if tier == "ram"
               else {"kv_offload_disk_dir": str(tmp_path)})
    with _engine(tiny_model_dir, **options) as engine:
        first = _run(engine, prompts)  # the last three evict the first three from the pool
        again = _run(engine, prompts[:3])
        stats = _connector(engine).stats
    assert [o.outputs[0].token_ids for o in first + again] == expected + expected[:3]
    assert [o.num_cached_tokens for o in first] == [0] * 6
    assert all(o.num_cached_tokens >= 64 for o in again), [o.num_cached_tokens for o in again]
    assert stats["saved_blocks"] > 0 and stats["loaded_blocks"] >= 12
    assert stats["failed_loads"] == 0


def test_the_disk_tier_outlives_a_restart_and_a_corrupt_file_is_recomputed(
        tiny_model_dir, reference, tmp_path):
    prompts, expected = reference
    with _engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path)) as engine:
        _run(engine, prompts)  # leaving the block waits for the disk writes
    with _engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path)) as restarted:
        warm = _run(restarted, prompts[:1])
    assert warm[0].outputs[0].token_ids == expected[0]
    assert warm[0].num_cached_tokens >= 64  # from files the first run wrote
    for path in tmp_path.rglob("*.kv"):  # every file damaged
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with _engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path)) as damaged:
        cold = _run(damaged, prompts[1:2])
        again = _run(damaged, prompts[1:2])
        stats = _connector(damaged).stats
    assert cold[0].outputs[0].token_ids == again[0].outputs[0].token_ids == expected[1]
    assert cold[0].num_cached_tokens == 0 and stats["failed_loads"] == 1
    assert again[0].num_cached_tokens >= 64  # the pool's own copy, recomputed


def test_a_full_disk_only_costs_recomputes(tiny_model_dir, reference, tmp_path, monkeypatch,
                                           caplog):
    prompts, expected = reference

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_block", full)
    with _engine(tiny_model_dir, kv_offload_disk_dir=str(tmp_path)) as engine:
        outputs = _run(engine, prompts) + _run(engine, prompts[:3])
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected[:3]
    assert "No space left" in caplog.text


def test_offload_flags(tiny_model_dir, tmp_path):
    from kvserve.engine_config import EngineConfig

    config = EngineConfig(model="m", kv_offloading_size=0.5)
    transfer = config.transfer_config()
    assert transfer.connector == "OffloadingConnector"
    assert transfer.extra_config["ram_bytes"] == 1 << 29
    assert transfer.extra_config["load_policy"] == "measured"
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(model="m", kv_offload_disk_dir=str(tmp_path), kv_role="prefill")
    assert EngineConfig(model="m").transfer_config() is None


def test_load_cost_loads_on_a_busy_engine_and_recomputes_short_runs_on_an_idle_one():
    from kvserve.kv_transfer.offload.load_cost import LoadCost

    assert LoadCost().load_pays(1, 16)  # nothing measured yet
    busy = LoadCost()
    for i in range(10):  # 90 ms steps of 32 requests, a 256-token prefill among them
        busy.on_schedule(i * 0.09, 287 if i % 2 else 32, 32)
    assert busy.load_pays(1, 16)  # one block recomputed would stall 32 streams
    idle = LoadCost()
    for i in range(10):  # 20 ms steps of one request's 400-token prefill chunks
        idle.on_schedule(i * 0.02, 400, 1)
    assert not idle.load_pays(1, 16)  # 0.8 ms of prefill against a step's wait
    assert idle.load_pays(30, 16)  # 24 ms of prefill against the same wait
    idle.on_load(30, 0.02 + 30 * 0.01)  # a slow tier: 10 ms a block past the step
    assert not idle.load_pays(30, 16)


def test_the_measured_policy_recomputes_runs_it_expects_to_load_slower(tiny_model_dir,
                                                                       reference, monkeypatch):
    from kvserve.kv_transfer.offload.load_cost import LoadCost

    prompts, expected = reference
    monkeypatch.setattr(LoadCost, "load_pays", lambda self, blocks, block_size: False)
    with _engine(tiny_model_dir, kv_offload_ram_bytes=8 << 20,
                 kv_offload_load_policy="measured") as engine:
        outputs = _run(engine, prompts) + _run(engine, prompts[:3])
        stats = _connector(engine).stats
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected[:3]
    assert stats["saved_blocks"] > 0 and stats["loaded_blocks"] == 0
    assert stats["recomputed_runs"] >= 3


def test_tier_blocks_are_announced_as_kv_events_under_their_medium(tiny_model_dir, reference):
    """With KV events on, blocks the pool evicts into the RAM tier are published as
    BlockStored with medium CPU (a router counts them at a discount), and those the tier drops
    as BlockRemoved; the pool's own events keep no medium."""
    from kvserve.kv_events import BlockRemoved, BlockStored

    prompts, _ = reference
    events = []
    with _engine(tiny_model_dir, kv_offload_ram_bytes=1,
                 kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}'
                 ) as engine:
        core = engine.llm_engine.engine_core
        core.kv_events.publisher.publish = events.extend
        _connector(engine).ram.capacity = 8  # a tier of 8 blocks: it drops some too
        _run(engine, prompts)
    tier_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    tier_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    pool_removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium is None
                    for h in e.block_hashes}
    stored_hashes = {h for e in tier_stored for h in e.block_hashes}
    assert stored_hashes and stored_hashes <= pool_removed  # what the pool let go
    assert tier_removed and {h for e in tier_removed for h in e.block_hashes} <= stored_hashes


def test_a_sessions_blocks_outlive_the_traffic_after_it(tiny_model_dir, reference):
    """No tiers: a request naming its session keeps its blocks through five others that
    fill the pool, and its next turn finds them; the same without a session finds nothing."""
    prompts, expected = reference
    with _engine(tiny_model_dir) as engine:
        def turn(prompt, session=None):
            item = {"prompt_token_ids": prompt, **({"session_id": session} if session else {})}
            return engine.generate(item, GREEDY, use_tqdm=False)[0]

        turn(prompts[0], "agent-1")
        turn(prompts[1])
        _run(engine, prompts[2:])
        kept = turn(prompts[0], "agent-1")
        lost = turn(prompts[1])
        stats = engine.llm_engine.engine_core.stats()
    assert kept.outputs[0].token_ids == expected[0]
    assert kept.num_cached_tokens >= 64 and lost.num_cached_tokens == 0
    assert stats.session_hits >= 64 and stats.session_queries >= 160


def test_preempted_requests_come_back_from_the_ram_tier(tiny_model_dir, tokenizer):
    """Three requests whose answers outgrow a 16-block pool: some are preempted, and their
    blocks, evicted meanwhile, are loaded back from the tier on resuming (swap preemption)
    instead of recomputed; the tokens are the roomy run's."""
    prompts = _prompts(tokenizer)[:3]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    items = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
             engine_core="thread") as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(items, params,
                                                                    use_tqdm=False)]
    with _engine(tiny_model_dir, kv_offload_ram_bytes=8 << 20) as engine:
        outputs = engine.generate(items, params, use_tqdm=False)
        core = engine.llm_engine.engine_core
        preemptions, stats = core.scheduler.num_preemptions, _connector(engine).stats
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert preemptions > 0 and stats["loaded_blocks"] > 0, (preemptions, stats)
