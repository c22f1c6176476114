"""Grammars compiled off the engine loop: a request's structured-output spec is compiled by
xgrammar (or prepared for llguidance: JSON schemas with bounded strings, `choose_backend`) on
a small thread pool, once per distinct spec (an LRU keyed by the normalised spec,
bounded in bytes); concurrent requests for one spec share one compile, and every part of one
process (the engine core's gate and forced spans, a worker in the core's process) shares one
compiler per model (`shared_compiler`). The front-end only checks a spec (`validate`: xgrammar
builds the grammar without the vocabulary, well under a millisecond against seconds for some
compiles); a spec it rejects is an InvalidRequestError, a 400 that says why. The engine core
holds a constrained request out of the schedule until its grammar is compiled, so nobody
waits for it but the request itself."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output import guidance
from kvserve.structured_output.backend import tokenizer_info, xgrammar

# which grammar engine serves a spec: "auto" (llguidance for JSON schemas with bounded strings,
# xgrammar for the rest: see guidance.py for the measurements), "xgrammar" or "guidance"
# (vLLM's --structured-outputs-config backend names)
BACKEND_ENV = "KVSERVE_STRUCTURED_OUTPUTS_BACKEND"
BACKENDS = ("auto", "xgrammar", "guidance")
_BOUNDS = ("maxLength", "minLength", "pattern")
COMPILE_TIMEOUT_S = 10.0
CACHE_BYTES = 256 << 20
# JSON with free whitespace lets a small model pad forever; a run of more than this many
# whitespace characters is not allowed (indented output still fits)
MAX_WHITESPACE_RUN = 16


# JSON-schema keywords xgrammar 0.2.8 accepts and does not enforce (checked one by one): a
# schema that uses them is a 400, never output that silently breaks them
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if",
                       "then", "else", "dependentRequired", "dependentSchemas")


_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_DATA = ("const", "enum", "default", "examples")  # values, not schemas


def unenforced_keyword(schema) -> str | None:
    """The first keyword in `schema` (anywhere in it) that the grammar would not enforce."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node and node[keyword] is not False:  # uniqueItems: false is fine
                return keyword
        for key, value in node.items():
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                stack.extend(value.values())  # the names are the user's, not keywords
            elif key not in _DATA:
                stack.append(value)
    return None


def spec_key(spec: StructuredOutputsParams) -> str:
    """The cache key: the kind, its normalised text and the whitespace option."""
    kind = spec.kinds()[0]
    value = getattr(spec, kind)
    if kind == "json":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                      param="structured_outputs") from exc
        keyword = unenforced_keyword(schema)
        if keyword is not None:
            raise InvalidRequestError(f"the JSON schema uses {keyword!r}, which this server's "
                                      "grammar engine does not enforce",
                                      param="structured_outputs")
        # not sorted: property order is the order the output follows
        value = json.dumps(schema, separators=(",", ":"))
    text = json.dumps([kind, value, spec.disable_any_whitespace, choose_backend(spec)],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def choose_backend(spec: StructuredOutputsParams) -> str:
    """"guidance" or "xgrammar" for this spec. The same in every process (the front-end, the
    core and the workers read the same environment), since each compiles it on its own."""
    chosen = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if chosen not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={chosen!r}: expected one of {', '.join(BACKENDS)}")
    kind = spec.kinds()[0]
    if chosen == "guidance":
        return "guidance" if kind in ("json", "json_object", "regex") else "xgrammar"
    if chosen == "xgrammar" or kind != "json":
        return "xgrammar"
    return "guidance" if _has_bounded_strings(json.loads(spec.json)) else "xgrammar"


def _has_bounded_strings(schema) -> bool:
    """A string length bound or pattern anywhere in the schema: what xgrammar expands."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if any(key in node and isinstance(node[key], (int, str)) for key in _BOUNDS):
                return True
            stack.extend(value for key, value in node.items() if key not in _DATA)
    return False


class GrammarCompiler:
    def __init__(self, tokenizer_loader, vocab_size: int, *,
                 timeout_s: float = COMPILE_TIMEOUT_S, cache_bytes: int = CACHE_BYTES,
                 max_workers: int = 2):
        """`tokenizer_loader`: the model's tokenizer (called once, on the first compile)."""
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> CompiledGrammar
        self._cached_bytes = 0
        self._pending: dict[str, Future] = {}
        self._compiler = None
        self._info = None
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._compiler_lock = threading.Lock()

    @property
    def tokenizer_info(self):
        """xgrammar's description of the vocabulary the grammars are compiled against."""
        self._xgr_compiler()
        return self._info

    def warm_up(self) -> Future:
        """Import xgrammar and describe the vocabulary in the background (seconds)."""
        return self._pool.submit(self._xgr_compiler)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The spec's CompiledGrammar, from the cache or a compile already under way or new;
        fills `spec.key`. The future raises InvalidRequestError for a spec xgrammar rejects."""
        key = spec.key or spec_key(spec)
        spec.key = key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(cached)
                return done
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(self._compile, key, spec)
                self._pending[key] = future
            return future

    def too_slow(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"the grammar took longer than {self.timeout_s:g} s to compile; simplify it",
            param="structured_outputs")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def matcher(self, grammar, stop_tokens: list[int] | None = None):
        """A matcher of the grammar's backend, xgrammar's methods either way."""
        if isinstance(grammar, guidance.GuidanceGrammar):
            return guidance.GuidanceMatcher(self.guidance_tokenizer, grammar, stop_tokens or [])
        return xgrammar().GrammarMatcher(grammar, override_stop_tokens=stop_tokens or None)

    @property
    def guidance_tokenizer(self):
        return guidance.guidance_tokenizer(self._loaded_tokenizer(), self.vocab_size)

    # ---- inside -----------------------------------------------------------------------------
    def _compile(self, key: str, spec: StructuredOutputsParams):
        try:
            if choose_backend(spec) == "guidance":
                grammar = guidance.GuidanceGrammar(build_guidance_grammar(spec))
                guidance.check(grammar.text, self.guidance_tokenizer)
            else:
                grammar = compile_spec(self._xgr_compiler(), spec)
        except Exception as exc:
            with self._lock:
                self._pending.pop(key, None)
            if isinstance(exc, InvalidRequestError):
                raise
            raise _unusable(spec, exc) from exc
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = grammar
            self._cached_bytes += grammar.memory_size_bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.memory_size_bytes
        return grammar

    def _loaded_tokenizer(self):
        """The model's tokenizer, loaded once (both backends describe the vocabulary from
        it; llguidance alone needs no xgrammar compiler)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_loader()
            return self._tokenizer

    def _xgr_compiler(self):
        with self._compiler_lock:  # not the cache's lock: building it takes seconds
            if self._compiler is None:
                self._info = tokenizer_info(self._loaded_tokenizer(), self.vocab_size)
                self._compiler = xgrammar().GrammarCompiler(self._info, max_threads=1,
                                                            cache_enabled=False)
            return self._compiler


def _unusable(spec: StructuredOutputsParams, exc: Exception) -> InvalidRequestError:
    """xgrammar's errors (RuntimeError, ValueError, its own) say what is wrong, after a
    "[time] /project/cpp/file.cc:line:" prefix of its build's."""
    kind = spec.kinds()[0].replace("_", " ")
    what = "grammar" if kind == "grammar" else f"{kind} grammar"
    message = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(exc).strip())
    return InvalidRequestError(f"the {what} cannot be used: {message}",
                               param="structured_outputs")


# ---- the front-end's check ------------------------------------------------------------------
def validate(spec: StructuredOutputsParams) -> None:
    """Check a spec as its backend reads it, without compiling it against the vocabulary
    (that part can take seconds; this well under a millisecond, after the backend's first
    import); fills `spec.key`. An InvalidRequestError says what is wrong."""
    spec.key = spec.key or spec_key(spec)
    try:
        if choose_backend(spec) == "guidance":
            guidance.check(build_guidance_grammar(spec))
        else:
            build_grammar(spec)
    except InvalidRequestError:
        raise
    except Exception as exc:
        raise _unusable(spec, exc) from exc


async def validate_async(spec: StructuredOutputsParams) -> None:
    """`validate` off the event loop (xgrammar's first import takes seconds)."""
    await asyncio.to_thread(validate, spec)


def build_grammar(spec: StructuredOutputsParams):
    """xgrammar's Grammar for one spec: what a compile starts from, without the vocabulary."""
    grammar = xgrammar().Grammar
    kind = spec.kinds()[0]
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else '{"type": "object"}'
        return grammar.from_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                        max_whitespace_cnt=MAX_WHITESPACE_RUN)
    if kind == "regex":
        return grammar.from_regex(spec.regex)
    if kind == "choice":
        return grammar.from_ebnf(_choice_ebnf(spec.choice))
    if kind == "grammar":
        if "::=" in spec.grammar:  # EBNF / GBNF
            return grammar.from_ebnf(spec.grammar)
        return grammar.from_lark(spec.grammar)
    return grammar.from_structural_tag(spec.structural_tag)


def build_guidance_grammar(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a spec it serves (JSON schemas, regexes)."""
    kind = spec.kinds()[0]
    if kind == "regex":
        return guidance.regex_grammar(spec.regex)
    schema = spec.json if kind == "json" else '{"type": "object"}'
    return guidance.json_schema_grammar(schema, any_whitespace=not spec.disable_any_whitespace)


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


# ---- one compiler per model in a process ------------------------------------------------
_shared: dict[tuple[str, int], GrammarCompiler] = {}
_shared_lock = threading.Lock()


def shared_compiler(model: str, vocab_size: int, tokenizer_loader) -> GrammarCompiler:
    """The process's compiler for this model: the engine core's gate, its forced spans and a
    worker in the same process compile each spec once between them. `tokenizer_loader` is
    used by the first caller only."""
    with _shared_lock:
        compiler = _shared.get((model, vocab_size))
        if compiler is None:
            compiler = _shared[(model, vocab_size)] = GrammarCompiler(tokenizer_loader,
                                                                      vocab_size)
        return compiler


def compile_spec(compiler, spec: StructuredOutputsParams):
    """xgrammar's CompiledGrammar for one spec: the front-end's grammar, compiled against the
    vocabulary (what xgrammar's compile_json_schema etc. do in one call)."""
    return compiler.compile_grammar(build_grammar(spec))
