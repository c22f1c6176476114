"""Structured output end to end on the real model: a corpus of 32 JSON schemas
(tests/data/json_schemas.json) in ragged batches at temperature 0 and 1, every output finished
("stop") and valid by the `jsonschema` library; greedy outputs unchanged by preemption with
prefix caching and by speculative decoding; regex, choice, EBNF and Lark grammars; the
OpenAI-compatible server through the official client; and, without a model, the compiler's
cache key and its one compile per spec. The mask kernel itself: tests/test_token_bitmask.py."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import wait_until

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

CORPUS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "json_schemas.json").read_text())
BY_NAME = {entry["name"]: entry for entry in CORPUS}
MAX_TOKENS = 256
# one kernel thread per engine: on a small machine shared with other work, two threads that
# meet at every op's barrier ran decode steps 4-15x slower than one (measured on 2 busy cores)
ONE_THREAD = {"num_threads": 1}
# the preemption and speculation runs: nested objects, arrays of objects, anyOf, $ref, null,
# patterns and output that repeats itself (drafts); short outputs (the float32 runs are slow)
SUBSET = ["payment", "flight", "version", "employee", "contacts", "user_profile", "tool_call"]


def _keywords(node: Any) -> set[str]:
    """Every keyword used anywhere in a schema, plus "null-type" for a type list with null."""
    found: set[str] = set()
    if isinstance(node, dict):
        found |= set(node)
        if isinstance(node.get("type"), list) and "null" in node["type"]:
            found.add("null-type")
        for value in node.values():
            found |= _keywords(value)
    elif isinstance(node, list):
        for value in node:
            found |= _keywords(value)
    return found


def _unbounded(node: Any, path: str = "#") -> list[str]:
    """Where a 135M model could write forever: strings with neither maxLength, pattern, enum
    nor const, and arrays without maxItems."""
    found = []
    if isinstance(node, dict):
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "string" in types and not {"maxLength", "pattern", "enum", "const"} & set(node):
            found.append(path)
        if "array" in types and "maxItems" not in node:
            found.append(path)
        for key, value in node.items():
            found += _unbounded(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _unbounded(value, f"{path}/{index}")
    return found


def test_the_corpus_covers_the_schema_features_and_is_bounded():
    assert len(CORPUS) >= 30 and len(BY_NAME) == len(CORPUS)
    used: set[str] = set()
    for entry in CORPUS:
        jsonschema.Draft202012Validator.check_schema(entry["schema"])
        used |= _keywords(entry["schema"])
        assert _unbounded(entry["schema"]) == [], entry["name"]
    assert {"properties", "items", "minItems", "maxItems", "enum", "const", "pattern",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$defs", "$ref",
            "anyOf", "null-type", "additionalProperties", "required", "maxLength"} <= used
    assert set(SUBSET) <= set(BY_NAME)


# ---- the compiler, without a model ------------------------------------------------------------
def _key(**spec) -> str:
    from kvserve.structured_output.compiler import spec_key

    return spec_key(StructuredOutputsParams(**spec))


def test_spec_key_keeps_property_order_and_ignores_formatting():
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    ba = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    # the same schema as a dict and as differently spaced text: one key
    assert _key(json=ab) == _key(json=json.dumps(ab, indent=4)) == _key(json=json.dumps(ab))
    # property order is the order the output follows: another grammar, another key
    assert _key(json=ab) != _key(json=ba)
    assert _key(json=ab) != _key(json=ab, disable_any_whitespace=True)
    assert _key(choice=["a", "b"]) != _key(choice=["b", "a"])
    assert _key(regex="a+") != _key(grammar="a+") != _key(choice=["a+"])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        _key(json='{"type": ')


class _Grammar:
    memory_size_bytes = 100


def test_one_compile_per_spec_however_many_requests_wait(monkeypatch):
    """Eight threads and eight coroutines ask for one spec while it compiles: they share one
    compile (one future); another spec compiles beside it; once cached, asking again compiles
    nothing."""
    from kvserve.structured_output import compiler as module

    compiled: list[str] = []
    release = threading.Event()

    def slow_compile(_xgr, spec):
        compiled.append(spec.key)
        release.wait(10)
        return _Grammar()

    monkeypatch.setattr(module, "compile_spec", slow_compile)
    grammars = module.GrammarCompiler(lambda: None, 64, max_workers=2)
    grammars._xgr_compiler = lambda: None  # no xgrammar, no tokenizer: the cache alone
    one = {"type": "object", "properties": {"x": {"type": "integer"}}}
    other = {"type": "boolean"}
    errors: list[BaseException] = []

    def attach(schema):
        try:
            grammars.submit(StructuredOutputsParams(json=schema)).result(10)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    def attach_async_many():
        async def many():
            await asyncio.gather(*(asyncio.wrap_future(grammars.submit(
                StructuredOutputsParams(json=one))) for _ in range(8)))
        try:
            asyncio.run(many())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=attach, args=(one,)) for _ in range(8)]
    threads += [threading.Thread(target=attach_async_many),
                threading.Thread(target=attach, args=(other,))]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len(compiled) == 2, what="both compiles to start")
        under_way = grammars.submit(StructuredOutputsParams(json=one))
        assert grammars.submit(StructuredOutputsParams(json=one)) is under_way
        assert not under_way.done()
        time.sleep(0.2)
        assert all(thread.is_alive() for thread in threads)  # all waiting on the two compiles
        release.set()
        for thread in threads:
            thread.join(10)
        assert errors == []
        assert len(compiled) == 2 and len(set(compiled)) == 2
        assert grammars.submit(StructuredOutputsParams(json=one)).result() is \
            under_way.result()
        assert len(compiled) == 2
    finally:
        release.set()
        grammars.shutdown()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    """The real compiler: xgrammar against SmolLM2's vocabulary (no model)."""
    from kvserve.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(lambda: tokenizer, tokenizer.vocab_size)
    yield compiler
    compiler.shutdown()


@pytest.mark.parametrize("spec, says", [
    ({"regex": "([a-z"}, "Unclosed"),
    ({"regex": "a{3,1}"}, "larger than upper bound"),
    ({"grammar": "root ::= undefined_rule"}, "not defined"),
    ({"grammar": 'start: "a" | b'}, "unknown name"),
    ({"json": {"type": "strnig"}}, "Unsupported type"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "defs"),
    ({"json": {"type": "array", "minItems": 3, "maxItems": 1}}, "minItems"),
    ({"json": "[1, 2]"}, "object or bool"),
])
def test_a_grammar_xgrammar_rejects_is_an_invalid_request(grammars, spec, says):
    """The front-end's check (no vocabulary, well under a millisecond) and the compile both
    refuse it, saying why."""
    from kvserve.structured_output.compiler import validate

    with pytest.raises(InvalidRequestError, match=says) as refused:
        validate(StructuredOutputsParams(**spec))
    assert refused.value.param == "structured_outputs"
    for _ in range(2):  # a failed compile is not cached as a success, nor left pending
        with pytest.raises(InvalidRequestError, match=says) as refused:
            grammars.submit(StructuredOutputsParams(**spec)).result(30)
        assert refused.value.param == "structured_outputs"



def test_bounded_strings_go_to_llguidance_unless_told_otherwise(monkeypatch):
    """`auto`: JSON schemas with a string bound or pattern (what xgrammar expands: seconds to
    compile, ms a mask) go to llguidance, the rest to xgrammar; the switch names either, and
    the cache keeps the two apart."""
    from kvserve.structured_output.compiler import BACKEND_ENV, choose_backend, spec_key

    bounded = StructuredOutputsParams(json={"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}})
    free = StructuredOutputsParams(json={"type": "object", "properties": {
        "maxLength": {"type": "string"}, "note": {"type": "string", "default": "pattern"}}})
    assert choose_backend(bounded) == "guidance" and choose_backend(free) == "xgrammar"
    assert choose_backend(StructuredOutputsParams(regex="a{2,9}")) == "xgrammar"
    auto_key = spec_key(bounded)
    monkeypatch.setenv(BACKEND_ENV, "xgrammar")
    assert choose_backend(bounded) == "xgrammar" and spec_key(bounded) != auto_key
    monkeypatch.setenv(BACKEND_ENV, "guidance")
    assert choose_backend(free) == choose_backend(StructuredOutputsParams(regex="a")) == \
        "guidance"
    assert choose_backend(StructuredOutputsParams(choice=["a", "b"])) == "xgrammar"
    monkeypatch.setenv(BACKEND_ENV, "outlines")
    with pytest.raises(ValueError, match="outlines"):
        choose_backend(bounded)


def test_both_backends_mask_nearly_the_same_tokens(grammars, tokenizer):
    """One bounded schema without free whitespace, walked token by token through the matchers
    the processor uses. The two masks differ only where the backends read JSON differently:
    xgrammar lets raw control characters into strings (JSON forbids them; llguidance does
    not) and any split of text the grammar forces (llguidance only the canonical tokens);
    llguidance allows escapes (a backslash) inside a bounded string, xgrammar does not. Both
    end allowing only EOS; a name past its bound is refused."""
    import torch

    from kvserve.structured_output.guidance import GuidanceGrammar

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}
    grammars_by_backend = {}
    for backend in ("xgrammar", "guidance"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVSERVE_STRUCTURED_OUTPUTS_BACKEND", backend)
            spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            grammars_by_backend[backend] = grammars.submit(spec).result(30)
    assert isinstance(grammars_by_backend["guidance"], GuidanceGrammar)
    eos = tokenizer.eos_token_id
    matchers = {b: grammars.matcher(g, [eos]) for b, g in grammars_by_backend.items()}
    words = (tokenizer.vocab_size + 31) // 32

    def allowed(matcher) -> set[int]:
        mask = torch.zeros(1, words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask, 0)
        return {32 * i + j for i, word in enumerate(mask[0].tolist()) for j in range(32)
                if (word >> j) & 1}

    def control(token: int) -> bool:
        return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in tokenizer.decode([token]))

    for token in tokenizer.encode('{"name": "Ada", "n": 12}', add_special_tokens=False):
        ours, theirs = allowed(matchers["guidance"]), allowed(matchers["xgrammar"])
        assert token in ours and token in theirs
        assert all("\\" in tokenizer.decode([t]) for t in ours - theirs)
        assert len(ours) == 1 or all(control(t) for t in theirs - ours)
        assert all(matcher.accept_token(token) for matcher in matchers.values())
    assert allowed(matchers["guidance"]) == allowed(matchers["xgrammar"]) == {eos}
    assert all(matcher.accept_token(eos) and matcher.is_terminated()
               for matcher in matchers.values())
    too_long = grammars.matcher(grammars_by_backend["guidance"], [eos])
    prefix = tokenizer.encode('{"name": "', add_special_tokens=False)
    assert all(too_long.accept_token(token) for token in prefix)
    letters = tokenizer.encode("abcdefghijkl", add_special_tokens=False)
    assert not all(too_long.accept_token(token) for token in letters)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 3}}, "contains"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
])
def test_schema_keywords_the_grammar_would_not_enforce_are_refused(schema, keyword):
    """xgrammar accepts these and ignores them (uniqueItems gave ["fantasy", "fantasy"]): a
    400 naming the keyword, never output that silently breaks the schema. A property that
    merely has such a name, or uniqueItems false, is fine."""
    from kvserve.structured_output.compiler import validate

    with pytest.raises(InvalidRequestError, match=f"'{keyword}'"):
        validate(StructuredOutputsParams(json=schema))
    harmless = {"type": "object", "properties": {"if": {"type": "string"}, "not": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": False}}}
    validate(StructuredOutputsParams(json=harmless))


def test_min_tokens_with_a_grammar_is_refused():
    """Once a grammar is complete only EOS may follow, which min_tokens forbids: every logit
    -inf, token 0, then unconstrained text ("no\n\nThe 2017"). Refused instead."""
    with pytest.raises(InvalidRequestError, match="min_tokens") as refused:
        SamplingParams(min_tokens=4, structured_outputs=StructuredOutputsParams(choice=["no"]))
    assert refused.value.param == "min_tokens"


def test_an_error_message_reads_cleanly():
    from kvserve.structured_output.compiler import validate

    with pytest.raises(InvalidRequestError) as refused:
        validate(StructuredOutputsParams(grammar="root ::= undefined_rule"))
    message = str(refused.value)
    assert message.startswith("the grammar cannot be used: ") and "/project/" not in message

# ---- the real model, offline ------------------------------------------------------------------
def _prompt(tokenizer, entry) -> str:
    schema = entry["schema"]
    kind = "array" if schema.get("type") == "array" else "object"
    keys = ", ".join(schema.get("properties", {}))
    text = f"Reply with a JSON {kind}: {entry['describe']}." + (f" Keys: {keys}." if keys else "")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _json_params(entry, **options) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, **options,
                          structured_outputs=StructuredOutputsParams(json=entry["schema"]))


def _problems(entry, completion) -> list[str]:
    """Why one output is not a finished instance of its schema ([] when it is)."""
    if completion.finish_reason != "stop":
        return [f"{entry['name']}: finish_reason {completion.finish_reason} after "
                f"{len(completion.token_ids)} tokens: {completion.text!r}"]
    try:
        jsonschema.validate(json.loads(completion.text), entry["schema"])
    except (ValueError, jsonschema.ValidationError) as exc:
        return [f"{entry['name']}: {type(exc).__name__}: {str(exc)[:300]} in "
                f"{completion.text!r}"]
    return []


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored():
    """The in-process engines set torch's thread count for the whole test process."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm():
    from kvserve import LLM

    with LLM(engine_core="thread", max_model_len=2048, **ONE_THREAD) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {entry["name"]: _prompt(tokenizer, entry) for entry in CORPUS}


@pytest.mark.slow
def test_every_schema_at_temperature_0_finishes_and_validates(llm, prompts):
    """The whole corpus in one ragged batch."""
    outputs = llm.generate(list(prompts.values()),
                           [_json_params(entry, temperature=0.0) for entry in CORPUS],
                           use_tqdm=False)
    problems = [p for entry, output in zip(CORPUS, outputs)
                for p in _problems(entry, output.outputs[0])]
    assert problems == []


@pytest.mark.slow
def test_every_schema_at_temperature_1_finishes_and_validates(llm, prompts):
    """Two seeded samples per schema, the 64 rows in one batch."""
    outputs = llm.generate(list(prompts.values()),
                           [_json_params(entry, temperature=1.0, n=2, seed=index)
                            for index, entry in enumerate(CORPUS)], use_tqdm=False)
    problems = [p for entry, output in zip(CORPUS, outputs) for completion in output.outputs
                for p in _problems(entry, completion)]
    assert all(len(output.outputs) == 2 for output in outputs)
    assert problems == []


def _greedy_subset(prompts, **options) -> tuple[list, Any]:
    """The SUBSET at temperature 0 on SmolLM2 in float32 -> the outputs and the engine core.
    float32 is exact whatever the batch or the chunking (tests/test_engine_real.py); the
    default dtype rounds decode steps' activations to int8 and K/V to bfloat16, so a recomputed
    or verified token can differ from a decoded one (2 of 8 outputs did)."""
    from kvserve import LLM

    with LLM(dtype="float32", engine_core="thread", **ONE_THREAD, **options) as engine:
        outputs = engine.generate([prompts[name] for name in SUBSET],
                                  [_json_params(BY_NAME[name], temperature=0.0)
                                   for name in SUBSET], use_tqdm=False)
        return [output.outputs[0] for output in outputs], engine.llm_engine.engine_core


@pytest.mark.slow
def test_preemption_prefix_caching_and_drafts_change_no_token(prompts):
    """A roomy run without drafts, then one engine with everything that replays or skips
    ahead: a pool of 24 blocks for 7 requests of ~7 blocks each (requests are preempted and
    recomputed, their prefix found in the cache, and each grammar's matcher replays the row's
    outputs) and ngram drafts verified depth by depth under the grammar's mask. The same
    greedy tokens, all valid, and each mechanism was exercised."""
    roomy, _ = _greedy_subset(prompts, max_model_len=2048)
    squeezed, core = _greedy_subset(
        prompts, enable_prefix_caching=True, max_model_len=384, num_kv_blocks=24, block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert core.scheduler.num_preemptions > 0
    assert core.kv_manager.stats.hits > 0
    drafts = core.drafter.stats
    assert drafts.num_draft_tokens > 0 and drafts.num_accepted_tokens > 0, drafts
    assert [p for name, output in zip(SUBSET, roomy) for p in _problems(BY_NAME[name], output)
            ] == []
    changed = [f"{name}: {a.text!r} became {b.text!r}"
               for name, a, b in zip(SUBSET, roomy, squeezed) if a.token_ids != b.token_ids]
    assert changed == []


EBNF = """root ::= number (" " op " " number){1,3}
number ::= [1-9] [0-9]{0,2}
op ::= "+" | "-" | "*"
"""
EBNF_AS_REGEX = r"[1-9][0-9]{0,2}( [-+*] [1-9][0-9]{0,2}){1,3}"
LARK = """start: "The answer is " ANSWER "."
ANSWER: /[0-9]{1,4}/
"""

# (question, spec, check of the output text)
GRAMMARS: list[tuple[str, dict, Any]] = [
    ("Write a product code: three digits, a dash and a short word.",
     {"regex": r"[0-9]{3}-[a-z]{2,8}"}, re.compile(r"[0-9]{3}-[a-z]{2,8}")),
    ("What is the date of the first day of spring in 2025?",
     {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"},
     re.compile(r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")),
    ("Give a US phone number.", {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"},
     re.compile(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")),
    ("Is the sky blue?", {"choice": ["yes", "no", "maybe"]}, {"yes", "no", "maybe"}),
    ("Which color is grass?", {"choice": ["red", "green", "blue", "light green"]},
     {"red", "green", "blue", "light green"}),
    ("Write a small arithmetic expression.", {"grammar": EBNF}, re.compile(EBNF_AS_REGEX)),
    ("How many legs does a spider have?", {"grammar": LARK},
     re.compile(r"The answer is [0-9]{1,4}\.")),
]


@pytest.mark.slow
def test_regex_choice_and_grammars_are_followed(llm):
    """Each grammar at temperature 0 and at temperature 1 (seeded), one batch."""
    tokenizer = llm.get_tokenizer()
    cases = [(question, spec, check, temperature) for question, spec, check in GRAMMARS
             for temperature in (0.0, 1.0)]
    outputs = llm.generate(
        [tokenizer.apply_chat_template([{"role": "user", "content": question}])
         for question, *_ in cases],
        [SamplingParams(temperature=temperature, seed=7, max_tokens=48,
                        structured_outputs=StructuredOutputsParams(**spec))
         for _, spec, _, temperature in cases], use_tqdm=False)
    for (question, spec, check, temperature), output in zip(cases, outputs):
        completion = output.outputs[0]
        where = f"{spec} at temperature {temperature}: {completion.text!r}"
        assert completion.finish_reason == "stop", where
        if isinstance(check, set):
            assert completion.text in check, where
        else:
            assert check.fullmatch(completion.text), where


# ---- the engine core's gate: a request waits for its grammar, nobody waits with it -------------
@pytest.fixture
def held_compiles(monkeypatch):
    """Compiles of specs whose schema has the property "held" wait until the event is set
    (the rest compile as usual): a grammar that takes as long as a test likes."""
    from kvserve.structured_output import compiler as module

    release, real = threading.Event(), module.compile_spec

    def compile_spec(xgr, spec):
        if spec.json is not None and '"held"' in spec.json:
            release.wait(60)
        return real(xgr, spec)

    monkeypatch.setattr(module, "compile_spec", compile_spec)
    yield release
    release.set()


def _held_schema(test: str) -> dict:
    """A schema no other test compiled (the process's compiler caches by spec)."""
    return {"type": "object", "properties": {"held": {"const": test}}, "required": ["held"]}


def _run_until(engine, request_id: str, finished: dict, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while request_id not in finished:
        assert time.monotonic() < deadline, f"{request_id} did not finish"
        for output in engine.step(timeout=1):
            if output.finished:
                finished[output.request_id] = output


@pytest.mark.slow
def test_a_request_waits_for_its_grammar_out_of_the_batch(llm, held_compiles):
    """While one request's grammar compiles, a free request arrives after it, runs and
    finishes; the constrained one waits out of the schedule (no batch stalls on its compile),
    then runs to a valid answer once the grammar is ready."""
    from kvserve.core.request import RequestStatus

    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Reply with a JSON object."}])
    schema = _held_schema("waits")
    engine.add_request("constrained", prompt, SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=schema)))
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True))
    finished: dict = {}
    _run_until(engine, "free", finished)
    assert len(finished["free"].outputs[0].token_ids) == 16
    waiting = core.scheduler.requests["constrained"]
    assert waiting.status == RequestStatus.WAITING_FOR_GRAMMAR
    assert waiting.num_computed_tokens == 0 and core.scheduler.num_waiting == 1
    held_compiles.set()
    _run_until(engine, "constrained", finished)
    answer = finished["constrained"].outputs[0]
    assert answer.finish_reason == "stop" and json.loads(answer.text) == {"held": "waits"}


@pytest.mark.slow
def test_a_compile_that_fails_or_runs_too_long_fails_only_its_request(llm, held_compiles,
                                                                      monkeypatch):
    """A grammar the core cannot compile (here: past the time limit, and one that raises)
    fails its request with the reason; the engine serves the next request as before; an
    aborted waiting request leaves nothing behind."""
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    compiler = core.grammar_gate.compiler
    monkeypatch.setattr(compiler, "timeout_s", 0.5)
    prompt = "Hello"
    engine.add_request("slow", prompt, SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json=_held_schema("slow"))))
    engine.add_request("aborted", prompt, SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json=_held_schema("abort"))))
    engine.abort_request("aborted")
    deadline = time.monotonic() + 30
    failures: list = []
    while not failures:
        assert time.monotonic() < deadline, "the slow compile never failed its request"
        engine.step(timeout=0.5)
        failures += engine.take_failures()
    assert [request_id for request_id, _ in failures] == ["slow"]
    assert "longer than 0.5 s to compile" in str(failures[0][1])
    held_compiles.set()  # the pool's two threads were busy with them

    from kvserve.structured_output import compiler as module

    def broken(xgr, spec):
        raise RuntimeError("[12:00:00] /project/cpp/x.cc:1: no memory for the grammar")

    monkeypatch.setattr(module, "compile_spec", broken)
    engine.add_request("broken", prompt, SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json=_held_schema("broken"))))
    finished: dict = {}
    engine.add_request("after", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    # the pool's threads may still be finishing the released compiles, so "broken" can fail
    # after "after" is done: run until both have happened
    failures = []
    deadline = time.monotonic() + 60
    while "after" not in finished or not failures:
        assert time.monotonic() < deadline, f"after finished: {'after' in finished}"
        _run_until(engine, "after", finished)
        engine.step(timeout=0.2)
        failures += engine.take_failures()
    assert [request_id for request_id, _ in failures] == ["broken"]
    assert "no memory for the grammar" in str(failures[0][1])
    assert core.scheduler.compiling == {} and len(core.grammar_gate) == 0
    assert not core.scheduler.has_unfinished()


# ---- over HTTP, through the official client ---------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvserve.testing.server import ServerProcess

    log = tmp_path_factory.mktemp("structured-server") / "server.log"
    # no prefix caching: the streamed and the whole response are compared token for token, and
    # with the default dtype a prompt found in the cache (K/V kept in bfloat16) can change a
    # greedy token
    with ServerProcess(["--max-model-len", "2048", "--no-enable-prefix-caching",
                        "--num-threads", str(ONE_THREAD["num_threads"]),
                        "--served-model-name", "smol"], log_path=log) as process:
        yield process
    assert process.exit_code == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _ask(entry) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON object: {entry['describe']}."}]


def _response_format(entry) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["payment", "employee"])
def test_http_json_schema_streamed_and_not(client, name):
    entry = BY_NAME[name]
    options = dict(model="smol", messages=_ask(entry), temperature=0, max_tokens=MAX_TOKENS,
                   response_format=_response_format(entry))
    whole = client.chat.completions.create(**options)
    assert whole.choices[0].finish_reason == "stop"
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), entry["schema"])

    deltas, finish = [], None
    for chunk in client.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    assert "".join(deltas) == text  # greedy: the stream spells the same object
    jsonschema.validate(json.loads("".join(deltas)), entry["schema"])


@pytest.mark.slow
def test_http_guided_fields_and_structured_outputs(client):
    chat = [{"role": "user", "content": "Is water wet?"}]
    choice = client.chat.completions.create(
        model="smol", messages=chat, temperature=1.0, max_tokens=8,
        extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert choice.choices[0].message.content in ("yes", "no", "it depends")

    regex = r"[A-Z]{3}-[0-9]{3}"
    coded = client.chat.completions.create(
        model="smol", messages=chat, temperature=1.0, max_tokens=16,
        extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, coded.choices[0].message.content)

    entry = BY_NAME["flight"]
    completed = client.completions.create(
        model="smol", prompt="A flight booking as JSON:\n", temperature=1.0, seed=3,
        max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {
            "json": entry["schema"], "disable_any_whitespace": True}})
    text = completed.choices[0].text
    assert completed.choices[0].finish_reason == "stop"
    assert not set("\n\r\t") & set(text)  # JSON strings hold these escaped: none at all
    jsonschema.validate(json.loads(text), entry["schema"])

    guided = client.completions.create(model="smol", prompt="The year was", max_tokens=8,
                                       temperature=1.0, extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", guided.choices[0].text)

    anything = client.chat.completions.create(
        model="smol", messages=_ask(BY_NAME["person"]), temperature=0, max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)

    # llama.cpp's form (instructor's JSON mode sends it to such servers): the schema is followed
    entry = BY_NAME["flight"]
    with_schema = client.chat.completions.create(
        model="smol", messages=_ask(entry), temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
        response_format={"type": "json_object", "schema": entry["schema"]})
    assert with_schema.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(with_schema.choices[0].message.content), entry["schema"])


@pytest.mark.slow
@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a", "b"]},
     "response_format"),
    ({"response_format": {"type": "text", "schema": {"type": "object"}}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {"type": "strnig"}}},
     "response_format"),
    ({"guided_regex": "a+", "structured_outputs": {"json": {"type": "object"}}},
     "structured_outputs"),
])
def test_http_bad_grammars_and_two_constraints_are_400s_naming_the_field(client, fields,
                                                                         param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=fields)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param, refused.value.body


class _City(BaseModel):
    name: str
    country: str
    is_capital: bool


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS", "JSON"])
def test_instructor_returns_validated_objects(client, mode):
    """instructor, as its users call it, in each mode it sends to an OpenAI-compatible
    server: JSON_SCHEMA (response_format json_schema), TOOLS (a forced function call) and
    JSON (json_object with the schema in the system prompt: the grammar makes any object, the
    model follows the prompt). No retries: the first answer validates. (No integer field:
    its grammar has no bound on digits, and this small model runs on in them.)"""
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model="smol", response_model=_City, temperature=0, max_tokens=128, max_retries=0,
        messages=[{"role": "user", "content": "Describe Paris: its name, its country and "
                   "whether it is a capital, as a JSON object."}])
    assert isinstance(city, _City)
    assert city.name == "Paris" and city.country.lower() == "france" and city.is_capital
