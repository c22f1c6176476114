"""Serve a GGUF whose weights exceed a memory limit: the load maps them from the packed-panel
cache (quant/pack_cache.py's spill) instead of failing or being killed. Runs the model in a
memory cgroup of --limit-gib (v1 or v2; needs root), prints load time, decode speed and the
process's anonymous memory at its highest (sampled every 0.5 s).

Usage (root): .venv/bin/python benchmarks/weights_beyond_memory.py --model M.gguf
  [--limit-gib 3] [--tokens 16] [--fresh: remove the model's packed cache first]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def _cgroup(limit: int) -> Path:
    """A fresh memory cgroup limited to `limit` bytes (v1 where mounted, else v2)."""
    name = f"kvserve-beyond-{os.getpid()}"
    if V1.is_dir():
        group = V1 / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    else:
        group = V2 / name
        group.mkdir()
        (group / "memory.max").write_text(str(limit))
    return group


def _anonymous_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def child(args) -> None:
    peak = [0]

    def sample():
        while True:
            peak[0] = max(peak[0], _anonymous_kib())
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    started = time.perf_counter()
    from kvserve import LLM, SamplingParams

    llm = LLM(model=args.model, engine_core="thread", max_model_len=1024,
              kv_cache_memory_bytes=128 << 20)
    loaded = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": [(j * 7) % 4000 + 100 for j in range(32)]}
    times, outputs = [], []
    for _ in range(2):
        begin = time.perf_counter()
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        times.append(time.perf_counter() - begin)
    import resource

    print(json.dumps({"load_s": round(loaded, 1), "generate_s": [round(t, 2) for t in times],
                      "tokens": args.tokens, "same_tokens": outputs[0] == outputs[1],
                      "peak_anonymous_gib": round(peak[0] / 2**20, 2),
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                            / 2**20, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit-gib", type=float, default=3.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.fresh:
        from kvserve.quant.pack_cache import PackCache

        cache = PackCache(Path(args.model))
        cache.data_path.unlink(missing_ok=True)
        cache.index_path.unlink(missing_ok=True)
    group = _cgroup(int(args.limit_gib * 2**30))
    try:
        command = [sys.executable, __file__, "--child", "--model", args.model,
                   "--tokens", str(args.tokens)]
        process = subprocess.Popen(command, preexec_fn=lambda: (
            group / "cgroup.procs").write_text(str(os.getpid())))
        code = process.wait()
        print(f"limit {args.limit_gib} GiB; exit {code}" + (" (killed by the limit)"
                                                           if code == -9 else ""))
    finally:
        group.rmdir()


if __name__ == "__main__":
    main()
