"""`kvserve doctor --url URL`: what bounds a live server, in words and numbers, and which flag
would move it. Reads the server's /metrics a few times a second over a window and diagnoses
the window with kvserve.bottleneck, the rules the server's own /doctor and
kvserve:bottleneck_regime use (over their own last seconds)."""

from __future__ import annotations

import json
import sys
import time

import httpx

from kvserve.bottleneck import Diagnosis, Sample, diagnose
from kvserve.router.replicas import parse_metrics

SAMPLE_PERIOD_S = 0.25


def add_doctor_parser(commands) -> None:
    doctor = commands.add_parser("doctor", help="read a live server's metrics and say what "
                                 "bounds it (compute, bandwidth, overhead, capacity, queueing)")
    doctor.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server's base URL")
    doctor.add_argument("--api-key", default=None, help="the server's --api-key")
    doctor.add_argument("--window", type=float, default=5.0,
                        help="seconds of the server's steps to read (default 5)")
    doctor.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def read_window(url: str, window: float, headers: dict) -> list[Sample]:
    """Samples of /metrics every SAMPLE_PERIOD_S over `window` seconds (at least two)."""
    samples = []
    deadline = time.monotonic() + window
    with httpx.Client(headers=headers, timeout=10) as client:
        while True:
            response = client.get(url.rstrip("/") + "/metrics")
            response.raise_for_status()
            samples.append(Sample.from_metrics(time.monotonic(), parse_metrics(response.text)))
            if len(samples) >= 2 and time.monotonic() >= deadline:
                return samples
            time.sleep(SAMPLE_PERIOD_S)


def describe(diagnosis: Diagnosis, url: str) -> str:
    lines = [f"{url}: {diagnosis.regime}-bound", f"  {diagnosis.summary}"]
    if diagnosis.advice:
        lines.append(f"  to move it: {diagnosis.advice}")
    numbers = ", ".join(f"{key} {value:g}" for key, value in diagnosis.numbers.items())
    lines.append(f"  ({numbers})")
    return "\n".join(lines)


def run_doctor(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        samples = read_window(args.url, args.window, headers)
    except httpx.HTTPStatusError as exc:
        print(f"error: {args.url}/metrics answered {exc.response.status_code}"
              + (" (pass --api-key)" if exc.response.status_code == 401 else ""),
              file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"error: cannot read {args.url}/metrics: {exc}", file=sys.stderr)
        return 2
    diagnosis = diagnose(samples)
    print(json.dumps({"url": args.url, **diagnosis.as_dict()}, indent=1) if args.json
          else describe(diagnosis, args.url))
    return 0
