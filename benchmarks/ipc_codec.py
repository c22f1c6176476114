"""How much does one engine-core message cost between two processes? Groundwork for issue 13
(engine core as its own process): msgspec msgpack, pickle and JSON, each over a ZeroMQ PUSH/PULL
pair on ipc:// between two processes, for the messages that would cross per step.

Messages: a new request (prompt token ids and sampling fields; 256 and 2,048 tokens) and one
step's outputs (new token id and finish state per running request; batch 1 and 32). Reported:
the median one-way time from encoding in the parent to decoded in the child (the child sends back
its perf_counter, the system-wide monotonic clock on Linux) and the encoded size.

Usage: .venv/bin/python benchmarks/ipc_codec.py [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 2000


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    arrival_time: float
    priority: int = 0


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None


class StepOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[RequestDelta]
    timestamp: float


def sample_messages() -> dict[str, object]:
    def request(n):
        return NewRequest(f"cmpl-{n}", list(range(1000, 1000 + n)), 128, 0.8, 0.95, -1, None,
                          [2], time.time())

    def step(batch):
        return StepOutputs([RequestDelta(f"cmpl-{i:08d}", [4000 + i]) for i in range(batch)],
                           time.time())

    return {"request 256 tokens": request(256), "request 2048 tokens": request(2048),
            "step outputs, batch 1": step(1), "step outputs, batch 32": step(32)}


ENCODERS = {
    "msgspec msgpack": msgspec.msgpack.Encoder().encode,
    "pickle": lambda message: pickle.dumps(msgspec.to_builtins(message), protocol=5),
    "json": msgspec.json.Encoder().encode,
}


def decoder(codec: str, kind: type):
    if codec == "msgspec msgpack":
        return msgspec.msgpack.Decoder(kind).decode
    if codec == "json":
        return msgspec.json.Decoder(kind).decode
    return pickle.loads


def child(address: str, back: str, codec: str, kind_name: str) -> None:
    kind = {"NewRequest": NewRequest, "StepOutputs": StepOutputs}[kind_name]
    decode = decoder(codec, kind)
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(address)
    push.connect(back)
    for _ in range(ROUNDS):
        frame = pull.recv(copy=False)
        decode(frame.buffer)
        push.send(msgspec.msgpack.encode(time.perf_counter()))
    context.destroy(linger=0)


def measure(codec: str, message) -> tuple[float, int]:
    encode = ENCODERS[codec]
    with tempfile.TemporaryDirectory() as directory:
        address, back = f"ipc://{directory}/in", f"ipc://{directory}/out"
        context = zmq.Context()
        push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        push.bind(address)
        pull.bind(back)
        process = mp.get_context("spawn").Process(
            target=child, args=(address, back, codec, type(message).__name__))
        process.start()
        times, size = [], 0
        for _ in range(ROUNDS):
            start = time.perf_counter()
            payload = encode(message)
            size = len(payload)
            push.send(payload, copy=False)
            received = msgspec.msgpack.decode(pull.recv())
            times.append(received - start)
        process.join()
        context.destroy(linger=0)
    return statistics.median(times[ROUNDS // 10:]) * 1e6, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-ipc-codec")
    args = parser.parse_args()
    header = machine_header()
    rows, records = [], []
    for label, message in sample_messages().items():
        for codec in ENCODERS:
            micros, size = measure(codec, message)
            rows.append(f"| {label} | {codec} | {micros:.1f} | {size:,} |")
            records.append({"message": label, "codec": codec, "one_way_us_p50": micros,
                            "bytes": size})
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = (f"# Engine-core messages between processes, {args.name}\n\n"
            f"Machine: {cpu_label(header)}, {header['cores']} cores. `benchmarks/ipc_codec.py`: "
            f"ZeroMQ PUSH/PULL over ipc:// to a spawned process, {ROUNDS} messages each, one "
            "at a time; one-way time = encode + send + receive + decode, median.\n\n"
            "| message | codec | one-way us (p50) | bytes |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    (out_dir / f"{args.name}.md").write_text(text)
    (out_dir / f"{args.name}.json").write_text(json.dumps({"machine": header,
                                                          "results": records}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
