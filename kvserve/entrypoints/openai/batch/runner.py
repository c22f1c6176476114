"""`kvserve run-batch`: every line of an OpenAI batch file through the server's own app, in
this process, many at a time so the engine batches them; results appended as they finish.

Each line's body goes to its route through `httpx.ASGITransport` over `build_app`, so a batch
line gets exactly what the same request over HTTP would (every endpoint the server has, its
validation, its error bodies), with no second copy of the request handling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Iterator

import httpx

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai.batch.lines import (
    BatchLine,
    error_record,
    is_failed,
    read_lines,
    response_record,
    scan_keys,
)
from kvserve.entrypoints.openai.batch.progress import Progress
from kvserve.entrypoints.openai.batch.results import ResultsWriter, recover_results
from kvserve.entrypoints.openai.server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.options import option as _opt

# how often the start-up wait asks /health
_HEALTH_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class RunBatchConfig:
    input_file: str | None = _opt(None, "the batch: one OpenAI batch request per line "
                                  "(custom_id, method, url, body)", aliases=["-i"])
    output_file: str | None = _opt(None, "where results are appended, one line per input line; "
                                   "lines already answered there are skipped (resume)",
                                   aliases=["-o"])
    max_concurrency: int | None = _opt(None, "lines in flight at once, for the engine to batch "
                                       "(default: --max-num-seqs)")
    progress: bool = _opt(True, "show progress on stderr (--no-progress: none)")


@dataclass
class BatchSummary:
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    stopped: str | None = None  # why the run ended before the last line, if it did


class EngineStopped(RuntimeError):
    """The engine failed to start or died: the lines not yet answered stay unanswered."""


def run_batch(engine_config, server_config: ServerConfig, config: RunBatchConfig) -> int:
    """Run the batch; 0 when every line is answered (failed lines included: they are in the
    results), 1 when the engine failed, 2 for a batch that cannot be run as given."""
    try:
        if config.max_concurrency is not None and config.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got "
                             f"{config.max_concurrency}")
        keys = scan_keys(config.input_file)
        done = recover_results(config.output_file)
    except (OSError, ValueError) as exc:  # duplicate ids and a corrupt results file included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = BatchSummary(skipped=sum(1 for key in keys if key in done))
    todo = (line for line in read_lines(config.input_file) if line.key not in done)
    if summary.skipped < len(keys):
        _run_with_engine(engine_config, server_config, config, todo, len(keys) - summary.skipped,
                         summary)
    _print_summary(config, summary)
    return 0 if summary.stopped is None else 1


def _run_with_engine(engine_config, server_config: ServerConfig, config: RunBatchConfig,
                     todo: Iterator[BatchLine], total: int, summary: BatchSummary) -> None:
    # the run's concurrency bounds what is in flight; the server's own 503 bound would only
    # turn a large `n` or many prompts in one line into a failed line
    server_config = dataclasses.replace(server_config, max_waiting_requests=sys.maxsize)
    engine = AsyncEngine(engine_config, server_config.served_model_name)
    app = build_app(engine, server_config)
    writer = ResultsWriter(config.output_file)
    run = _BatchRun(engine, writer, summary)
    concurrency = config.max_concurrency or engine_config.max_num_seqs
    try:
        engine.start()
        asyncio.run(run.run(app, todo, concurrency, Progress(total, config.progress)))
    except EngineStopped as exc:
        summary.stopped = str(exc)
    except KeyboardInterrupt:
        summary.stopped = "interrupted"
    finally:
        writer.close()
        engine.stop()


def _print_summary(config: RunBatchConfig, summary: BatchSummary) -> None:
    print(f"run-batch: {summary.succeeded} succeeded, {summary.failed} failed, "
          f"{summary.skipped} skipped (already in {config.output_file})")
    if summary.stopped is not None:
        print(f"run-batch: stopped early: {summary.stopped}; run the same command again to "
              "finish the remaining lines", file=sys.stderr)


class _BatchRun:
    """One run: workers take lines from a queue, send each to the app, append its result."""

    def __init__(self, engine: AsyncEngine, writer: ResultsWriter, summary: BatchSummary):
        self.engine = engine
        self.writer = writer
        self.summary = summary
        self.progress: Progress | None = None

    async def run(self, app, todo: Iterator[BatchLine], concurrency: int,
                  progress: Progress) -> None:
        """Wait for the engine, then answer every line of `todo`; `progress` starts counting
        once the model is loaded, so its rate is the batch's."""
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve-batch",
                                     timeout=None) as client:
            await self._wait_ready(client)
            self.progress = progress.start()
            try:
                await self._answer_all(client, todo, concurrency)
            finally:
                self.progress.close()
        self._check_engine()

    async def _answer_all(self, client: httpx.AsyncClient, todo: Iterator[BatchLine],
                          concurrency: int) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=concurrency)
        async with asyncio.TaskGroup() as tasks:
            for _ in range(concurrency):
                tasks.create_task(self._worker(client, queue))
            await self._feed(queue, todo, concurrency)

    async def _wait_ready(self, client: httpx.AsyncClient) -> None:
        """/health is 200 once the model is loaded and warmed up."""
        while (await client.get("/health")).status_code != 200:
            self._check_engine()
            await asyncio.sleep(_HEALTH_POLL_SECONDS)

    def _check_engine(self) -> None:
        engine = self.engine
        if engine.startup_error is not None:
            raise EngineStopped(f"the engine failed to start: {engine.startup_error}")
        if not engine.is_alive:
            raise EngineStopped(f"the engine died: {engine.fatal_error or 'stopped'}")

    async def _feed(self, queue: asyncio.Queue, todo: Iterator[BatchLine],
                    concurrency: int) -> None:
        for line in todo:
            if not self.engine.is_alive:
                break
            await queue.put(line)
        for _ in range(concurrency):
            await queue.put(None)

    async def _worker(self, client: httpx.AsyncClient, queue: asyncio.Queue) -> None:
        while (line := await queue.get()) is not None:
            record = await self._answer(client, line)
            # an engine that died answered 503 for reasons not the line's: leave it unanswered
            if record is not None and self.engine.is_alive:
                self._record(record)

    async def _answer(self, client: httpx.AsyncClient, line: BatchLine) -> dict | None:
        if line.error is not None:
            return error_record(line)
        if not self.engine.is_alive:
            return None
        response = await client.post(line.url, content=json.dumps(line.body),
                                     headers={"content-type": "application/json"})
        try:
            body = response.json()
        except ValueError:  # a route that answers with text: kept as it came
            body = response.text
        return response_record(line.custom_id, response.status_code, body)

    def _record(self, record: dict) -> None:
        self.writer.append(record)
        failed = is_failed(record)
        if failed:
            self.summary.failed += 1
        else:
            self.summary.succeeded += 1
        self.progress.update(failed)
