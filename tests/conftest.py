"""Shared fixtures: the bundled real model (ours and HF's reference) and a tiny random model."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.errors import KernelBuildError
from kvserve.kernels import compiled_ops, isa
from kvserve.model_source import resolve_model
from kvserve.testing.tiny import tiny_config
from tests.helpers import gguf_parsed_once, kernel_level, single_process_reference

torch.set_num_threads(max(1, torch.get_num_threads()))
# Kernel choices fixed (the documented limits) so tests do not time kernels; tests/test_autotune.py
# runs the autotuner itself, and both choices are tested equal to the reference at every level.
os.environ.setdefault("KVSERVE_AUTOTUNE", "0")
# the thread governor would change thread counts mid-test when the suite runs beside other work
os.environ.setdefault("KVSERVE_ADAPTIVE_THREADS", "0")


@pytest.fixture(scope="session", params=isa.tested_levels())
def kernels(request):
    """The compiled kernels built for each instruction-set level this CPU can execute (AVX2 and
    scalar everywhere on x86), so every vector variant is tested on any machine. A level that
    does not build fails its tests: no green run without the kernels."""
    try:
        return compiled_ops(request.param)
    except KernelBuildError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(params=isa.tested_levels())
def isa_level(request):
    """The test once per kernel ISA level this machine can execute: KVSERVE_CPU_ISA caps the
    level while it runs, so the models, engines and core processes it starts load that level's
    build (the equivalence tests run at every level, not only the best one)."""
    with kernel_level(request.param):
        yield request.param


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory):
    """One real-model server (SmolLM2, served as "smol") shared by the test files that only
    talk to it over HTTP (tools, the Responses API): one model load instead of one each."""
    from kvserve.testing.server import ServerProcess

    log = tmp_path_factory.mktemp("smol-server") / "server.log"
    with ServerProcess(["--max-model-len", "2048", "--served-model-name", "smol"],
                       log_path=log) as server:
        yield server
    assert server.exit_code == 0, log.read_text()[-3000:]


@pytest.fixture(scope="session")
def smollm_source():
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(smollm_source):
    from kvserve.tokenizer import load_tokenizer

    return load_tokenizer(smollm_source)


@pytest.fixture(scope="session")
def smollm_fp32(smollm_source):
    from kvserve.models import load_model

    model, _ = load_model(smollm_source, "float32")
    return model


@pytest.fixture(scope="session")
def smollm_fp32_paged(smollm_source):
    """The engine's default fast path (fused C++ kernels, paged attention) in float32."""
    from kvserve.models import load_model

    model, _ = load_model(smollm_source, "float32", attention_backend="paged")
    return model


@pytest.fixture(scope="session")
def hf_model(smollm_source):
    """HF transformers loading the same GGUF in float32: the reference."""
    transformers = pytest.importorskip("transformers")
    with gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm_source.path.parent), gguf_file=smollm_source.path.name,
            dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_source):
    transformers = pytest.importorskip("transformers")
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(
            str(smollm_source.path.parent), gguf_file=smollm_source.path.name)


@pytest.fixture(scope="session")
def tiny_model():
    from kvserve.models import random_model

    return random_model(tiny_config(), "float32", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    from kvserve.testing.tiny import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), tokenizer)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """The tiny model with the engine core in this process, so tests can look inside it
    (`llm_engine.engine_core`); tests/test_engine_process.py checks the process core gives the
    same outputs."""
    from kvserve import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
               engine_core="thread")


@pytest.fixture(scope="session")
def mixed_workload_reference():
    """`single_process_reference(model_dir)` (tests/helpers: the mixed workload with the core on
    a thread, in this process), run once per model directory in the session: the mp and ray
    executor tests compare their runs on one model with the same (deterministic) run."""
    runs: dict[str, tuple] = {}

    def reference(model_dir) -> tuple[list, list[float], int]:
        if str(model_dir) not in runs:
            runs[str(model_dir)] = single_process_reference(model_dir)
        return runs[str(model_dir)]

    return reference


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance per test module (Ray Serve's tests), shared by the CLI it starts
    (as RAY_ADDRESS) and the test's own Ray calls."""
    ray = pytest.importorskip("ray")
    from ray import serve

    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        serve.shutdown()
        ray.shutdown()
