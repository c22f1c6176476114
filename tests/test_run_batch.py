"""`kvserve run-batch` (OpenAI batch files offline) on the tiny model: a 200-line batch killed
mid-run and run again ends with every line answered once, bad lines recorded as failed the way
the server answers them, and greedy outputs (from both runs) equal to `kvserve serve`'s for the
same bodies;
a torn last line, duplicate custom_ids and a corrupt results file are handled."""

from __future__ import annotations

import io
import json
import random
import re
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path

import httpx
import pytest

from kvserve.cli import main
from kvserve.entrypoints.openai.batch.progress import Progress
from kvserve.entrypoints.openai.batch.results import recover_results
from kvserve.testing.server import ServerProcess
from tests.helpers import kill_server_tree, tiny_server_flags

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _good_lines() -> list[str]:
    lines = []
    for i in range(91):
        lines.append(_line(f"chat-{i}", CHAT, {
            "model": "tiny", "messages": [{"role": "user", "content": f"Tell me about item {i}"}],
            "max_tokens": 4 + i % 9, "temperature": 0}))
        lines.append(_line(f"cmpl-{i}", COMPLETIONS, {
            "model": "tiny", "prompt": f"Story number {i}: once upon a time",
            "max_tokens": 4 + i % 7, "temperature": 0}))
    return lines


# custom_id -> (its raw line, what its result must be)
BAD = {
    "unknown-url": (_line("unknown-url", "/v1/nope", {"prompt": "x"}), ("status", 404)),
    "unknown-url-2": (_line("unknown-url-2", "/v2/completions", {"prompt": "x"}),
                      ("status", 404)),
    "field-400": (_line("field-400", COMPLETIONS, {"prompt": "x", "frobnicate": 1}),
                  ("param", "frobnicate")),
    "max-tokens-400": (_line("max-tokens-400", COMPLETIONS, {"prompt": "x", "max_tokens": -1}),
                       ("param", "max_tokens")),
    "no-messages-400": (_line("no-messages-400", CHAT, {"model": "tiny"}), ("param", "messages")),
    "model-404": (_line("model-404", CHAT, {"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}]}), ("code", "model_not_found")),
    "stream": (_line("stream", COMPLETIONS, {"prompt": "x", "stream": True}),
               ("error", "stream_unsupported")),
    "stream-chat": (_line("stream-chat", CHAT, {"messages": [], "stream": True}),
                    ("error", "stream_unsupported")),
    "get": (_line("get", "/v1/models", {}, method="GET"), ("error", "invalid_method")),
    "no-method": (json.dumps({"custom_id": "no-method", "url": CHAT, "body": {}}),
                  ("error", "invalid_method")),
    "body-list": (_line("body-list", COMPLETIONS, ["x"]), ("error", "invalid_body")),
    "embedding": (_line("embedding", "/v1/embeddings", {"model": "tiny", "input": "hello"}),
                  ("embedding", None)),
    "embedding-2": (_line("embedding-2", "/v1/embeddings", {"model": "tiny",
                                                             "input": ["a", "b"]}),
                    ("embedding", None)),
}
# lines without a usable custom_id: keyed by their line number in the results
NAMELESS = ['{"custom_id": "cut-short", "method": "POST", "url"', "not json at all", "[1, 2]",
            json.dumps({"method": "POST", "url": CHAT, "body": {"messages": []}}),
            json.dumps({"custom_id": 7, "method": "POST", "url": CHAT, "body": {}})]
NAMELESS_CODES = ["invalid_json", "invalid_json", "invalid_json", "invalid_custom_id",
                  "invalid_custom_id"]


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> tuple[Path, list[str]]:
    """200 lines, shuffled (bad lines among good ones), with a blank line in the middle."""
    lines = _good_lines() + [raw for raw, _ in BAD.values()] + NAMELESS
    assert len(lines) == 200
    random.Random(0).shuffle(lines)
    lines.insert(100, "")
    path = tmp_path_factory.mktemp("batch") / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, lines


def _input_keys(lines: list[str]) -> list:
    keys = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            custom_id = json.loads(raw).get("custom_id")
        except (ValueError, AttributeError):
            custom_id = None
        keys.append(custom_id if isinstance(custom_id, str) else ("line", number))
    return keys


def _command(model_dir, batch: Path, results: Path) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", "run-batch", "-i", str(batch), "-o",
            str(results), "--max-concurrency", "4", "--served-model-name", "tiny",
            *tiny_server_flags(model_dir, kv_blocks=128, max_model_len=512)]


def _read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _crash_after(command: list[str], results: Path, lines: int, log: Path) -> int:
    """Start the run, kill -9 it (and its engine core) once `lines` results are written;
    returns how many were written by then."""
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while not results.exists() or results.read_text().count("\n") < lines:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no results after 300 s"
            time.sleep(0.05)
    finally:
        kill_server_tree(types.SimpleNamespace(process=process))
    return results.read_text().count("\n")


def _tear_last_line(results: Path) -> str:
    """Cut the last result line in half, as a crash inside its write would; its custom_id."""
    data = results.read_bytes()
    head, _, last = data[:-1].rpartition(b"\n")
    results.write_bytes(head + b"\n" + last[:len(last) // 2])
    return json.loads(last)["custom_id"]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_killed_run_resumes_to_every_line_once(tiny_model_dir, batch_file, tmp_path):
    batch, lines = batch_file
    results = tmp_path / "results.jsonl"
    command = _command(tiny_model_dir, batch, results)
    written = _crash_after(command, results, 30, tmp_path / "first-run.log")
    assert 30 <= written < 200, "the kill must land mid-run"
    torn_id = _tear_last_line(results)
    rerun = subprocess.run(command + ["--no-progress"], capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "torn last line" in rerun.stderr
    succeeded, failed, skipped = map(int, re.search(
        r"(\d+) succeeded, (\d+) failed, (\d+) skipped", rerun.stdout).groups())
    assert skipped == written - 1 and succeeded + failed + skipped == 200
    records = _read_results(results)
    keys = Counter(_key(record) for record in records)
    assert sorted(keys.items(), key=str) == sorted(Counter(_input_keys(lines)).items(), key=str)
    assert keys[torn_id] == 1
    by_id = {record["custom_id"]: record for record in records if record["custom_id"]}
    _check_bad_lines(by_id, records, lines)
    _check_good_lines(by_id)
    _check_against_server(tiny_model_dir, records)
    assert sum(1 for r in records if _failed(r)) == len(BAD) + len(NAMELESS) - sum(
        _is_200_embedding(by_id[k]) for k in ("embedding", "embedding-2"))


def _key(record: dict):
    if isinstance(record["custom_id"], str):
        return record["custom_id"]
    return ("line", record["error"]["line"])


def _failed(record: dict) -> bool:
    return record["error"] is not None or record["response"]["status_code"] >= 400


def _is_200_embedding(record: dict) -> bool:
    return record["response"] is not None and record["response"]["status_code"] == 200


def _check_bad_lines(by_id: dict, records: list[dict], lines: list[str]) -> None:
    for custom_id, (_, (kind, expected)) in BAD.items():
        record = by_id[custom_id]
        assert record["id"].startswith("batch_req_")
        response, error = record["response"], record["error"]
        if kind == "error":
            assert response is None and error["code"] == expected, record
        elif kind == "embedding":  # a generate runner refuses embeddings (test_pooling.py
            _check_embedding(record)  # runs them on a pooling runner)
        else:
            assert error is None and response["status_code"] >= 400, record
            body_error = response["body"]["error"]
            assert {"status": response["status_code"], "param": body_error["param"],
                    "code": body_error["code"]}[kind] == expected, record
    nameless = {record["error"]["line"]: record for record in records
                if record["custom_id"] is None}
    for raw, code in zip(NAMELESS, NAMELESS_CODES):
        record = nameless[lines.index(raw) + 1]
        assert record["response"] is None and record["error"]["code"] == code, record


def _check_embedding(record: dict) -> None:
    response = record["response"]
    assert response["status_code"] == 400, record
    assert "--runner pooling" in response["body"]["error"]["message"], record


def _check_good_lines(by_id: dict) -> None:
    for i in range(91):
        for custom_id in (f"chat-{i}", f"cmpl-{i}"):
            record = by_id[custom_id]
            assert record["error"] is None and record["response"]["status_code"] == 200
            body = record["response"]["body"]
            assert record["response"]["request_id"] == body["id"]
            assert body["choices"][0]["finish_reason"] in ("stop", "length")


def _check_against_server(model_dir, records: list[dict]) -> None:
    """Greedy answers from before the crash and from the rerun against `kvserve serve` with
    the same engine flags, one request at a time."""
    requests = {json.loads(raw)["custom_id"]: json.loads(raw) for raw in _good_lines()}
    good = [r for r in records if r["custom_id"] in requests]
    chosen = good[:3] + good[-3:]  # written by the first run, then by the rerun
    flags = ["--served-model-name", "tiny",
             *tiny_server_flags(model_dir, kv_blocks=128, max_model_len=512)]
    with ServerProcess(flags) as server:
        for record in chosen:
            request = requests[record["custom_id"]]
            served = httpx.post(server.base_url + request["url"], json=request["body"],
                                timeout=120)
            assert served.status_code == 200, served.text
            assert _answer(record["response"]["body"]) == _answer(served.json()), record


def _answer(body: dict) -> tuple:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"], body["usage"]["completion_tokens"]


def test_duplicate_custom_ids_are_refused_before_anything_runs(tmp_path, capsys):
    batch = tmp_path / "dup.jsonl"
    batch.write_text("\n".join([_line("a", CHAT, {}), _line("b", CHAT, {}),
                                _line("a", COMPLETIONS, {})]) + "\n")
    results = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(batch), "-o", str(results),
                 "--model", "not-loaded"]) == 2
    err = capsys.readouterr().err
    assert "duplicate custom_id" in err and "'a' (lines 1 and 3)" in err
    assert not results.exists()


def test_an_engine_that_cannot_start_ends_the_run_non_zero(tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    batch.write_text(_line("a", CHAT, {"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    results = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(batch), "-o", str(results), "--no-progress",
                 "--model", str(tmp_path / "no-such-model")]) == 1
    captured = capsys.readouterr()
    assert "the engine failed to start" in captured.err
    assert "0 succeeded, 0 failed, 0 skipped" in captured.out
    assert results.read_text() == ""  # nothing recorded: a rerun runs the line


def test_max_concurrency_below_one_is_refused(tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    batch.write_text(_line("a", CHAT, {}) + "\n")
    assert main(["run-batch", "-i", str(batch), "-o", str(tmp_path / "out.jsonl"),
                 "--max-concurrency", "0", "--model", "not-loaded"]) == 2
    assert "--max-concurrency must be at least 1" in capsys.readouterr().err


def test_a_corrupt_results_line_before_the_end_is_refused(tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    batch.write_text(_line("a", CHAT, {}) + "\n")
    results = tmp_path / "out.jsonl"
    results.write_text('{"custom_id": "a", "error": null}\ngarbage\n{"custom_id": "b"}\n')
    assert main(["run-batch", "-i", str(batch), "-o", str(results),
                 "--model", "not-loaded"]) == 2
    assert "line 2 is not a result line" in capsys.readouterr().err
    assert results.read_text().count("\n") == 3  # left as it was


def test_a_torn_last_line_is_dropped_and_the_rest_kept(tmp_path):
    results = tmp_path / "out.jsonl"
    whole = [{"custom_id": "a", "response": {"status_code": 200}, "error": None},
             {"custom_id": None, "response": None, "error": {"code": "x", "line": 4}}]
    text = "".join(json.dumps(r) + "\n" for r in whole)
    results.write_text(text + '{"custom_id": "b", "resp')
    assert recover_results(str(results)) == {"a", ("line", 4)}
    assert results.read_text() == text


def test_plain_progress_line_without_tqdm():
    stream = io.StringIO()
    progress = Progress(3, enabled=True, stream=stream, use_tqdm=False).start()
    for failed in (False, True, False):
        progress.update(failed)
    progress.close()
    assert stream.getvalue().splitlines()[-1] == "run-batch: 3/3 lines (1 failed)"
    quiet = io.StringIO()
    Progress(1, enabled=False, stream=quiet).start().update(False)
    assert quiet.getvalue() == ""
