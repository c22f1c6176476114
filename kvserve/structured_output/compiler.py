"""Grammars compiled off the engine loop: a request's structured-output spec is compiled by
xgrammar on a small thread pool, once per distinct spec (an LRU keyed by the normalised spec,
bounded in bytes); concurrent requests for one spec share one compile. The front-end compiles
to check a request (a spec xgrammar rejects, or one that compiles for longer than the time
limit, is an InvalidRequestError: a 400 that says why), the sampling worker to mask with; the
event loop never waits on it, and the worker starts its compile when the request arrives, so
it runs beside the request's prefill."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured_output.backend import tokenizer_info, xgrammar

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
    text = json.dumps([kind, value, spec.disable_any_whitespace], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


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

    # ---- what the front-end calls ----------------------------------------------------------
    def attach(self, params: SamplingParams) -> None:
        """Check that the request's grammar compiles (here, waiting for it)."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            self.submit(spec).result(self.timeout_s)
        except FutureTimeout:
            raise self._too_slow() from None

    async def attach_async(self, params: SamplingParams) -> None:
        """`attach` without blocking the event loop: the request waits for its grammar, nobody
        else does."""
        spec = params.structured_outputs
        if spec is None:
            return
        future = self.submit(spec)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow() from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- inside -----------------------------------------------------------------------------
    def _compile(self, key: str, spec: StructuredOutputsParams):
        try:
            grammar = compile_spec(self._xgr_compiler(), spec)
        except Exception as exc:
            with self._lock:
                self._pending.pop(key, None)
            if isinstance(exc, InvalidRequestError):
                raise
            # xgrammar's errors (RuntimeError, ValueError, its own) say what is wrong, after a
            # "[time] /project/cpp/file.cc:line:" prefix of its build's
            kind = spec.kinds()[0].replace("_", " ")
            what = "grammar" if kind == "grammar" else f"{kind} grammar"
            raise InvalidRequestError(f"the {what} cannot be used: {_xgrammar_message(exc)}",
                                      param="structured_outputs") from exc
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = grammar
            self._cached_bytes += grammar.memory_size_bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.memory_size_bytes
        return grammar

    def _xgr_compiler(self):
        with self._compiler_lock:  # not the cache's lock: building it takes seconds
            if self._compiler is None:
                self._info = tokenizer_info(self._tokenizer_loader(), self.vocab_size)
                self._compiler = xgrammar().GrammarCompiler(self._info, max_threads=1,
                                                            cache_enabled=False)
            return self._compiler

    def _too_slow(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"the grammar took longer than {self.timeout_s:g} s to compile; simplify it",
            param="structured_outputs")


def _xgrammar_message(exc: Exception) -> str:
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(exc).strip())


def compile_spec(compiler, spec: StructuredOutputsParams):
    """xgrammar's CompiledGrammar for one spec."""
    kind = spec.kinds()[0]
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else '{"type": "object"}'
        return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                            max_whitespace_cnt=MAX_WHITESPACE_RUN)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if kind == "grammar":
        if "::=" in spec.grammar:  # EBNF / GBNF
            return compiler.compile_grammar(spec.grammar)
        return compiler.compile_lark(spec.grammar)
    return compiler.compile_structural_tag(spec.structural_tag)
