"""kvserve's first run on a GPU: the offline API (kvserve.LLM) on device="cuda" against kvserve on
the CPU and against HF transformers, on a tiny random Llama (.devcheck/tiny-llama, built by tools/gpu_check/prepare.sh).

Run from the repo root (kvserve imports from there, not from an install):

    PYTHONPATH=$PWD python3 tools/gpu_check/gpu_check.py            # cuda when available, else cpu
    PYTHONPATH=$PWD python3 tools/gpu_check/gpu_check.py --device cpu   # dry run of every check on cpu

Every check is caught on its own (traceback printed, the next one runs); the summary at the end
lists PASS / FAIL / INFO / SKIP per check. Exit status 0 when no check FAILed, else 1.
The CPU baseline runs kvserve's torch reference ops (cpu_kernels=False: no C++ build); pass
--cpu-kernels to also run the compiled CPU kernels (builds them if not cached: ~1 min or more).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from pathlib import Path

# before kvserve is imported: no start-up autotuning, no thread governor (as the test suite)
os.environ.setdefault("KVSERVE_AUTOTUNE", "0")
os.environ.setdefault("KVSERVE_ADAPTIVE_THREADS", "0")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
WORK = HERE.parent.parent / ".devcheck"  # what prepare.sh builds (git-ignored)
MODEL = str(WORK / "tiny-llama")
GGUF = str(WORK / "tiny-llama-q4_1.gguf")  # Q4_1 projections, like the bundled SmolLM2 file
VOCAB = 512
PROMPT_LENGTHS = (5, 17, 150, 300)  # 150 and 300: the "fresh prompt" SDPA path (> 128 tokens)
NEW_TOKENS = 24
TEXT_PROMPTS = ["The KV cache", "kvserve is an LLM inference engine",
                "Continuous batching with chunked prefill", "Hello"]

RESULTS: list[tuple[str, str, str]] = []  # (name, PASS/FAIL/INFO/SKIP, detail)


def log(*args) -> None:
    print(*args, flush=True)


def record(name: str, status: str, detail: str = "") -> None:
    RESULTS.append((name, status, detail))
    log(f"[{status}] {name}" + (f": {detail}" if detail else ""))


def run_check(name: str, fn, *args, **kwargs):
    """fn returns (status, detail, value) or raises; returns value (None on failure)."""
    log(f"\n=== {name} ===")
    start = time.perf_counter()
    try:
        status, detail, value = fn(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - one check never stops the others
        if isinstance(error, KeyboardInterrupt):
            raise
        traceback.print_exc()
        sys.stdout.flush()
        record(name, "FAIL", f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
               if str(error) else type(error).__name__)
        return None
    record(name, status, f"{detail} ({time.perf_counter() - start:.1f}s)")
    return value


# ---- inputs ------------------------------------------------------------------------------------

def token_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


# ---- kvserve -----------------------------------------------------------------------------------

def make_llm(device: str, dtype: str, model: str = MODEL, **options):
    from kvserve import LLM

    defaults = dict(num_kv_blocks=512, block_size=16, engine_core="thread", autotune=False,
                    adaptive_threads=False, cpu_kernels=False)
    defaults.update(options)
    return LLM(model=model, device=device, dtype=dtype, **defaults)


def kv_greedy(llm, prompts, new_tokens=NEW_TOKENS, logprobs=True):
    """(token ids per prompt, the chosen tokens' logprobs per prompt or None)."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=0 if logprobs else None)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    lps = None
    if logprobs:
        lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
               for o in outputs]
    return tokens, lps


def kvserve_greedy(device: str, dtype: str, prompts, **options):
    llm = make_llm(device, dtype, **options)
    try:
        ready = llm.llm_engine.core.ready
        log(f"  engine: dtype {ready.dtype}, kv {ready.kv_cache_dtype}, "
            f"quantization {ready.quantization}, {ready.num_kv_blocks} blocks")
        return kv_greedy(llm, prompts)
    finally:
        llm.shutdown()


# ---- HF transformers reference -------------------------------------------------------------------

def hf_greedy(device: str, dtype: torch.dtype, prompts, new_tokens=NEW_TOKENS):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(MODEL, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    tokens, lps, margins = [], [], []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device=device),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, len(prompt):].tolist()
        tokens.append(ids)
        top2 = torch.stack([step[0].float().topk(2).values for step in out.logits])
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
        lps.append([torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, ids)])
    del model
    flat = sorted(m for row in margins for m in row)
    log(f"  HF {device} {dtype}: smallest top-2 logit margins along the greedy paths "
        f"{[round(m, 4) for m in flat[:3]]} (a divergence at a margin this small is a near-tie)")
    return tokens, lps


# ---- comparison --------------------------------------------------------------------------------

def compare(a, b, a_lps=None, b_lps=None) -> tuple[bool, str]:
    """Exact token agreement, where each prompt first diverges, and max |d logprob| over the
    tokens before the first divergence."""
    equal = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    total = sum(max(len(ta), len(tb)) for ta, tb in zip(a, b))
    first = []
    max_delta = 0.0
    for i, (ta, tb) in enumerate(zip(a, b)):
        diverge = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y),
                       None if len(ta) == len(tb) else min(len(ta), len(tb)))
        first.append(diverge)
        if a_lps is not None and b_lps is not None:
            upto = len(ta) if diverge is None else diverge
            for j in range(upto):
                max_delta = max(max_delta, abs(a_lps[i][j] - b_lps[i][j]))
    same = all(d is None for d in first) and len(a) == len(b)
    detail = f"{equal}/{total} tokens equal; first divergence per prompt {first}"
    if a_lps is not None and b_lps is not None:
        detail += f"; max |d logprob| (agreeing prefix) {max_delta:.2e}"
    return same, detail


def comparison_check(a, b, label_a, label_b, strict=True):
    def fn():
        if a is None or b is None:
            return "SKIP", f"{label_a if a is None else label_b} did not run", None
        same, detail = compare(a[0], b[0], a[1], b[1])
        status = "PASS" if same else ("FAIL" if strict else "INFO")
        return status, detail, same
    return fn


# ---- the checks --------------------------------------------------------------------------------

def environment(device: str):
    log("python", sys.version.replace("\n", " "), platform.machine())
    log("torch", torch.__version__, "cuda build", torch.version.cuda,
        "cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        log("gpu", torch.cuda.get_device_name(0), "capability",
            torch.cuda.get_device_capability(0), f"{props.total_memory / 2**30:.1f} GiB",
            "SMs", props.multi_processor_count, "bf16 supported", torch.cuda.is_bf16_supported())
    for name in ("transformers", "tokenizers", "safetensors", "numpy", "msgspec", "zmq", "gguf",
                 "jinja2", "tqdm"):
        try:
            module = __import__(name)
            log(f"  {name} {getattr(module, '__version__', '?')} ({Path(module.__file__).parent})")
        except Exception as error:  # noqa: BLE001
            log(f"  {name}: NOT IMPORTABLE ({type(error).__name__}: {error})")
    import kvserve

    log("kvserve from", Path(kvserve.__file__).parent, "target device", device,
        "torch threads", torch.get_num_threads())
    return "INFO", f"torch {torch.__version__}, target {device}", None


def kvserve_dtype_auto(device: str):
    llm = make_llm(device, "auto")
    try:
        ready = llm.llm_engine.core.ready
        chosen = (ready.dtype, ready.kv_cache_dtype, ready.quantization)
        tokens, _ = kv_greedy(llm, token_prompts()[:2], 8, logprobs=False)
    finally:
        llm.shutdown()
    return "INFO", f"dtype auto -> activations/kv/quantization {chosen}; ran, {sum(map(len, tokens))} tokens", \
        None


def backends_check(device: str, reference):
    details, ok = [], True
    for backend in ("sdpa_batched", "torch_ref"):
        result = kvserve_greedy(device, "float32", token_prompts(), attention_backend=backend)
        same, detail = compare(result[0], reference[0], result[1], reference[1])
        ok &= same
        details.append(f"{backend}: {'same' if same else 'DIFFERENT'} ({detail})")
    return ("PASS" if ok else "FAIL"), " | ".join(details), None


def chunked_prefill_check(device: str, hf):
    """A small step budget: the long prompts are prefilled in chunks over their cached prefix
    (the paged and gathered attention paths), the short ones alongside."""
    result = kvserve_greedy(device, "float32", token_prompts(), max_num_batched_tokens=192,
                            enable_prefix_caching=True)
    same, detail = compare(result[0], hf[0], result[1], hf[1])
    return ("PASS" if same else "FAIL"), "vs HF: " + detail, None


def prefix_cache_check(device: str):
    """The same prompts twice on one engine: the second run hits the prefix cache."""
    llm = make_llm(device, "float32")
    try:
        first, _ = kv_greedy(llm, token_prompts(), logprobs=False)
        second, _ = kv_greedy(llm, token_prompts(), logprobs=False)
    finally:
        llm.shutdown()
    same, detail = compare(first, second)
    return ("PASS" if same else "FAIL"), "second run vs first: " + detail, None


def process_core_check(device: str, reference):
    result = kvserve_greedy(device, "float32", token_prompts(), engine_core="process")
    same, detail = compare(result[0], reference[0], result[1], reference[1])
    return ("PASS" if same else "FAIL"), "engine_core=process vs thread: " + detail, None


def low_precision_check(device: str, dtype: str, hf_fp32, hf_same_dtype):
    result = kvserve_greedy(device, dtype, token_prompts())
    parts = []
    if hf_fp32 is not None:
        parts.append("vs HF fp32: " + compare(result[0], hf_fp32[0])[1])
    if hf_same_dtype is not None:
        parts.append(f"vs HF {dtype}: " + compare(result[0], hf_same_dtype[0])[1])
    nan = any(lp != lp for row in result[1] for lp in row)
    hf_nan = hf_same_dtype is not None and any(lp != lp for row in hf_same_dtype[1] for lp in row)
    parts.append(f"NaN logprobs: kvserve {nan}, HF {hf_nan}")
    return ("FAIL" if nan and not hf_nan else "INFO"), " | ".join(parts), result


def quantization_check(device: str, mode: str, dtype: str, fp32):
    if mode in ("int4", "w4a8") and not device.startswith("cpu"):
        try:
            kvserve_greedy(device, dtype, token_prompts(), quantization=mode)
        except ValueError as error:  # the CPU-only 4-bit modes are refused at load
            ok = "CPU only" in str(error)
            return ("PASS" if ok else "FAIL"), f"refused at load: {error}", None
        return "FAIL", f"{mode} on {device} should be refused at load", None
    result = kvserve_greedy(device, dtype, token_prompts(), quantization=mode)
    nan = any(lp != lp for row in result[1] for lp in row)
    detail = f"ran; vs kvserve {device} fp32: " + (compare(result[0], fp32[0])[1]
                                                   if fp32 is not None else "n/a")
    return ("FAIL" if nan else "PASS"), detail + f"; NaN logprobs {nan}", None


def gguf_fp32_check(device: str, baseline_device: str):
    """The GGUF path (dequantize, weight cache, tokenizer from metadata) in float32, unquantized:
    the same tokens on the target as on the cpu."""
    fp32 = {dev: kvserve_greedy(dev, "float32", token_prompts(), model=GGUF, quantization="none")
            for dev in dict.fromkeys([device, baseline_device])}
    same, detail = compare(fp32[device][0], fp32[baseline_device][0], fp32[device][1],
                           fp32[baseline_device][1])
    return ("PASS" if same else "FAIL"), f"{device} vs {baseline_device}: {detail}", fp32[device]


def gguf_auto_check(device: str, fp32):
    """dtype=auto on the Q4_1 GGUF: on cuda bf16 + int4 from the Q4_1 codes (the bundled
    SmolLM2's default path); must run, agreement with float32 is information."""
    llm = make_llm(device, "auto", model=GGUF)
    try:
        ready = llm.llm_engine.core.ready
        log(f"  engine: dtype {ready.dtype}, kv {ready.kv_cache_dtype}, "
            f"quantization {ready.quantization}")
        auto, _ = kv_greedy(llm, token_prompts(), logprobs=False)
        text = llm.generate(TEXT_PROMPTS[:2], None, use_tqdm=False)
    finally:
        llm.shutdown()
    detail = (f"dtype=auto -> {ready.dtype}/{ready.quantization}; vs float32: "
              + (compare(auto, fp32[0])[1] if fp32 is not None else "n/a")
              + f"; text prompts -> {[o.outputs[0].text for o in text]!r}")
    return "PASS", detail, None


def sampling_check(device: str, baseline_device: str):
    from kvserve import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in token_prompts()]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234 + i, max_tokens=16,
                             ignore_eos=True) for i in range(len(prompts))]
    unseeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True,
                              min_p=0.01, repetition_penalty=1.1, logprobs=3)
    runs = {}
    for dev in dict.fromkeys([device, baseline_device]):
        llm = make_llm(dev, "float32")
        try:
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded,
                                                                  use_tqdm=False)]
            second = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded,
                                                                   use_tqdm=False)]
            free = llm.generate(prompts, unseeded, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 16 for o in free)
            assert all(len(o.outputs[0].logprobs[0]) >= 3 for o in free)
        finally:
            llm.shutdown()
        runs[dev] = (first, second)
    first, second = runs[device]
    reproducible = first == second
    detail = f"seeded reproducible on {device}: {reproducible}; unseeded top_p/min_p/penalty " \
             f"+ logprobs ran"
    if baseline_device != device:
        detail += f"; seeded {device} vs {baseline_device}: " + compare(
            first, runs[baseline_device][0])[1]
    return ("PASS" if reproducible else "FAIL"), detail, None


def text_and_chat_check(device: str):
    from kvserve import SamplingParams

    llm = make_llm(device, "float32")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
        chat = llm.chat([{"role": "user", "content": "What is a KV cache?"}], params,
                        use_tqdm=False)
        stop = llm.generate(TEXT_PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12,
                                                             stop_token_ids=[outs[0].outputs[0]
                                                                             .token_ids[3]]),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    for o in outs:
        log("  ", repr(o.prompt), "->", repr(o.outputs[0].text), o.outputs[0].token_ids)
    log("   chat ->", repr(chat[0].outputs[0].text))
    ok = all(len(o.outputs[0].token_ids) == 12 for o in outs) and \
        len(chat[0].outputs[0].token_ids) == 12 and stop[0].outputs[0].finish_reason == "stop"
    return ("PASS" if ok else "FAIL"), \
        f"text prompts, chat template, stop token (finish {stop[0].outputs[0].finish_reason})", \
        None


def builtin_processors_check(device: str):
    from kvserve import SamplingParams
    from kvserve.testing.logits_processors import BanTokens

    prompts = [{"prompt_token_ids": p} for p in token_prompts()]
    llm = make_llm(device, "float32", logits_processors=[BanTokens])
    try:
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True), use_tqdm=False)
        banned = sorted({t for o in plain for t in o.outputs[0].token_ids})
        biased = llm.generate(prompts, SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={7: 100.0},
            extra_args={"ban_tokens": banned}), use_tqdm=False)
        rows = [o.outputs[0].token_ids for o in biased]
    finally:
        llm.shutdown()
    leaked = sorted({t for row in rows for t in row} & set(banned))
    sevens = sum(t == 7 for row in rows for t in row)
    return ("PASS" if not leaked else "FAIL"), \
        f"BanTokens banned {len(banned)} ids, leaked {leaked}; logit_bias +100 on id 7: " \
        f"{sevens}/{sum(map(len, rows))} tokens are 7; rows {rows}", None


def device_processor_check(device: str):
    """A custom processor whose state lives on ProcessorInit.device (vLLM's convention)."""
    from kvserve import SamplingParams

    sys.path.insert(0, str(HERE))
    from devcheck_procs import FORCED_TOKEN, DeviceBias

    llm = make_llm(device, "float32", logits_processors=[DeviceBias])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts()[:2]],
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                           extra_args={"force": True}), use_tqdm=False)
    finally:
        llm.shutdown()
    rows = [o.outputs[0].token_ids for o in outs]
    ok = all(t == FORCED_TOKEN for row in rows for t in row)
    return ("PASS" if ok else "FAIL"), f"tokens {rows}", None


def timing_check(device: str, dtype: str = "float32"):
    from kvserve import SamplingParams

    llm = make_llm(device, dtype, max_num_seqs=64)
    parts = []
    try:
        generator = torch.Generator().manual_seed(2)
        for batch in (1, 16):
            prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (16,),
                                                          generator=generator).tolist()}
                       for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)  # warm-up
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            parts.append(f"batch {batch}: {batch * 64 / seconds:.0f} tok/s "
                         f"({seconds / 64 * 1000:.1f} ms/step)")
    finally:
        llm.shutdown()
    return "INFO", f"{device} {dtype} (torch reference ops), 64 new tokens: " + \
        "; ".join(parts), None


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None,
                        help="target device (default: cuda when available, else cpu)")
    parser.add_argument("--cpu-kernels", action="store_true",
                        help="also run kvserve on the CPU with the compiled C++ kernels")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--all-branches", action="store_true",
                        help="dry runs: also take the GPU-only branches (HF per dtype on the "
                             "target, extra timings) when the target is the cpu")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    on_gpu = device.startswith("cuda") or args.all_branches
    if not on_gpu:
        log("NOTE: no GPU target: every 'target' check runs on the CPU (a dry run of the script)")
    start = time.perf_counter()

    run_check("environment", environment, device)
    prompts = token_prompts()
    log("prompt lengths", [len(p) for p in prompts], "new tokens", NEW_TOKENS)

    def timed(label, fn, *a, **kw):
        def inner():
            value = fn(*a, **kw)
            return "INFO", f"{label} ran", value
        return inner

    hf_cpu = run_check("HF transformers greedy, cpu float32",
                       timed("HF cpu", hf_greedy, "cpu", torch.float32, prompts))
    kv_cpu = run_check("kvserve greedy, cpu float32 (torch reference ops)",
                       timed("kvserve cpu", kvserve_greedy, "cpu", "float32", prompts))
    run_check("kvserve cpu float32 == HF cpu float32",
              comparison_check(kv_cpu, hf_cpu, "kvserve cpu", "HF cpu"))
    if args.cpu_kernels:
        kv_cpu_compiled = run_check(
            "kvserve greedy, cpu float32 (compiled C++ kernels)",
            timed("kvserve cpu compiled", kvserve_greedy, "cpu", "float32", prompts,
                  cpu_kernels=True))
        run_check("kvserve cpu compiled kernels == HF cpu float32",
                  comparison_check(kv_cpu_compiled, hf_cpu, "kvserve cpu compiled", "HF cpu"))

    hf_dev = hf_cpu
    if on_gpu:
        hf_dev = run_check(f"HF transformers greedy, {device} float32",
                           timed(f"HF {device}", hf_greedy, device, torch.float32, prompts))
        run_check(f"HF {device} float32 == HF cpu float32 (the model is well-conditioned)",
                  comparison_check(hf_dev, hf_cpu, f"HF {device}", "HF cpu", strict=False))
    kv_dev = run_check(f"kvserve greedy, {device} float32 (paged backend)",
                       timed(f"kvserve {device}", kvserve_greedy, device, "float32", prompts))
    if kv_dev is not None:
        for i, row in enumerate(kv_dev[0]):
            log(f"  prompt {i} ({len(prompts[i])} tokens) -> {row}")
    run_check(f"kvserve {device} float32 == HF {device} float32",
              comparison_check(kv_dev, hf_dev, f"kvserve {device}", f"HF {device}"))
    run_check(f"kvserve {device} float32 == kvserve cpu float32",
              comparison_check(kv_dev, kv_cpu, f"kvserve {device}", "kvserve cpu"))
    if kv_dev is not None:
        run_check(f"kvserve {device} float32, other attention backends == paged",
                  backends_check, device, kv_dev)
    if hf_dev is not None:
        run_check(f"kvserve {device} float32, chunked prefill (192-token steps) == HF",
                  chunked_prefill_check, device, hf_dev)
    run_check(f"kvserve {device} float32, prefix-cache hit gives the same tokens",
              prefix_cache_check, device)
    if kv_dev is not None:
        run_check(f"kvserve {device} float32, engine core in its own process",
                  process_core_check, device, kv_dev)

    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        hf_low = None
        if on_gpu:
            hf_low = run_check(f"HF transformers greedy, {device} {dtype_name}",
                               timed(f"HF {dtype_name}", hf_greedy, device, dtype, prompts))
        run_check(f"kvserve {device} {dtype_name} runs (agreement is information)",
                  low_precision_check, device, dtype_name, hf_dev, hf_low)
    run_check(f"kvserve {device} dtype=auto", kvserve_dtype_auto, device)

    run_check(f"kvserve {device} sampling (seeded, top-k/top-p, min_p, penalties, logprobs)",
              sampling_check, device, "cpu")
    run_check(f"kvserve {device} text prompts, chat, stop token", text_and_chat_check, device)
    run_check(f"kvserve {device} logit_bias + custom processor (BanTokens)",
              builtin_processors_check, device)
    run_check(f"kvserve {device} custom processor holding a tensor on ProcessorInit.device",
              device_processor_check, device)

    gguf_fp32 = run_check(f"kvserve {device} GGUF (Q4_1) model, float32 unquantized == cpu",
                          gguf_fp32_check, device, "cpu")
    run_check(f"kvserve {device} GGUF (Q4_1) model, dtype=auto runs", gguf_auto_check, device,
              gguf_fp32)
    for mode, dtype_name in (("int4", "bfloat16"), ("int8", "bfloat16"), ("w8a8", "bfloat16"),
                             ("w4a8", "float32")):
        run_check(f"kvserve {device} quantization={mode} dtype={dtype_name} runs",
                  quantization_check, device, mode, dtype_name, kv_dev)

    if not args.no_timing:
        run_check(f"timing {device} float32", timing_check, device)
        if on_gpu:
            run_check(f"timing {device} bfloat16", timing_check, device, "bfloat16")
            run_check("timing cpu float32 (same machine, for scale)", timing_check, "cpu")

    log("\n================ SUMMARY ================")
    width = max(len(name) for name, _, _ in RESULTS)
    for name, status, detail in RESULTS:
        log(f"{status:4}  {name.ljust(width)}  {detail}")
    failed = [name for name, status, _ in RESULTS if status == "FAIL"]
    log(f"\n{len(RESULTS)} checks: "
        + ", ".join(f"{sum(s == k for _, s, _ in RESULTS)} {k}"
                    for k in ("PASS", "FAIL", "INFO", "SKIP"))
        + f"; total {time.perf_counter() - start:.0f}s")
    log("OVERALL:", "FAIL (" + "; ".join(failed) + ")" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
