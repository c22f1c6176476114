"""How fast does a decode engine pull a prefill engine's KV: TCP frames or shared memory?

SmolLM2-135M's KV layout (30 layers, 3 KV heads of 64, blocks of 16 tokens) in float32 and
bfloat16; the sender (kvserve/kv_transfer/tcp.KVSender, its own thread and ZeroMQ socket over
loopback TCP) holds 16, 64 and 256 blocks (256 to 4,096 tokens), the puller
(`pull_into`, in a spawned process so the two do not share a GIL) copies them into its own
KV tensors, through frames ("tcp") or a /dev/shm file ("shm"). Reported: the median seconds
per pull over repeated pulls and the GB/s of KV moved.

Usage: .venv/bin/python benchmarks/kv_transfer.py [--pulls 20] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch
import zmq

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.tcp import KVSender, pull_into

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 30, 16, 3, 64
BLOCK_COUNTS = (16, 64, 256)
NUM_BLOCKS = 512


def _caches(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
            for _ in range(LAYERS)]


def _puller(port: int, dtype_name: str, cases, pulls: int, results) -> None:
    torch.set_num_threads(1)
    caches = _caches(getattr(torch, dtype_name))
    context = zmq.Context()
    out = {}
    for transport, blocks in cases:
        times = []
        for i in range(pulls):
            start = time.perf_counter()
            pull_into(context, "127.0.0.1", port, f"{transport}-{blocks}-{i}", caches,
                      list(range(blocks)), 30.0, use_shm=transport == "shm")
            times.append(time.perf_counter() - start)
        out[(transport, blocks)] = statistics.median(times)
    context.term()
    results.put(out)


def run(dtype_name: str, pulls: int) -> list[dict]:
    torch.set_num_threads(1)
    caches, leases = _caches(getattr(torch, dtype_name)), LeaseTable()
    sender = KVSender(caches, leases, "127.0.0.1", use_shm=True)
    cases = [(transport, blocks) for blocks in BLOCK_COUNTS for transport in ("tcp", "shm")]
    for transport, blocks in cases:
        for i in range(pulls):
            leases.hold(f"{transport}-{blocks}-{i}", list(range(100, 100 + blocks)), 600)
    results = multiprocessing.get_context("spawn").Queue()
    puller = multiprocessing.get_context("spawn").Process(
        target=_puller, args=(sender.port, dtype_name, cases, pulls, results))
    puller.start()
    medians = results.get(timeout=600)
    puller.join()
    sender.close()
    bytes_per_block = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * caches[0].element_size()
    return [{"dtype": dtype_name, "transport": transport, "blocks": blocks,
             "tokens": blocks * BLOCK, "megabytes": blocks * bytes_per_block / 1e6,
             "ms_per_pull": seconds * 1e3,
             "gb_per_s": blocks * bytes_per_block / seconds / 1e9}
            for (transport, blocks), seconds in medians.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pulls", type=int, default=20)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-kv-transfer")
    args = parser.parse_args()
    header = machine_header()
    records = run("float32", args.pulls) + run("bfloat16", args.pulls)
    lines = [f"# KV transfer: TCP frames vs shared memory ({args.name})", "",
             f"CPU: {cpu_label(header)}. Command: `.venv/bin/python benchmarks/kv_transfer.py "
             f"--pulls {args.pulls}`. SmolLM2-135M's KV layout; sender thread and puller "
             f"process on this host, one torch thread each; median of {args.pulls} pulls.", "",
             "| dtype | blocks (tokens) | MB | tcp ms | tcp GB/s | shm ms | shm GB/s |",
             "|---|---|---|---|---|---|---|"]
    for dtype in ("float32", "bfloat16"):
        for blocks in BLOCK_COUNTS:
            row = {r["transport"]: r for r in records
                   if r["dtype"] == dtype and r["blocks"] == blocks}
            tcp, shm = row["tcp"], row["shm"]
            lines.append(f"| {dtype} | {blocks} ({tcp['tokens']}) | {tcp['megabytes']:.1f} | "
                         f"{tcp['ms_per_pull']:.2f} | {tcp['gb_per_s']:.2f} | "
                         f"{shm['ms_per_pull']:.2f} | {shm['gb_per_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.md").write_text(text)
    (out_dir / f"{args.name}.json").write_text(json.dumps(
        {"machine": header, "results": records}, indent=1))


if __name__ == "__main__":
    main()
