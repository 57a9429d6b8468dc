"""Shared bench helpers: the machine's description and writing results (servers: tests.server_process)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
    }


def percentile(values: list[float], q: float) -> float:
    """The value at quantile `q` of `values`, by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_results(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **results}, indent=2))
    print(json.dumps(results, indent=2))
    return path
