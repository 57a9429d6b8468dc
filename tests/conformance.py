"""The architecture conformance suite (issue 64): for each architecture in tests/arch_configs.py, a tiny
random-weight model served through semantic's engine, token for token against mlx-lm's own greedy
generation, on five checks (tests/conformance_checks.py: cold, resume, restart, share, batch).

    python -m semantic.launch .venv/bin/python -m tests.conformance [--only NAME...] \\
        [--default-suite] --out bench/results/conformance.json
    .venv/bin/python scripts/conformance_table.py bench/results/conformance.json  # docs/models.md's table

Each architecture runs in a process of its own, so one that aborts in C++ is reported ("crashed")
and the rest still run. An architecture whose system does not start is "refused", with the reason;
"pass" needs all five checks to pass.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import msgspec

from tests.arch_configs import ARCHITECTURES
from tests.arch_spec import ArchSpec
from tests.conformance_checks import CheckResult, RefusedError, judge, run_engine_checks
from tests.conformance_models import build_model, layer_kinds, save_model_dir
from tests.server_process import run_module

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT_S = 1800.0
LOG_TAIL_CHARS = 2000


class ArchResult(msgspec.Struct, omit_defaults=True):
    name: str
    model_type: str
    outcome: str  # pass | fail | refused | crashed | unbuildable
    layer_kinds: list[str] = msgspec.field(default_factory=list)
    quantization: str = ""
    reason: str = ""  # why refused, crashed or unbuildable
    checks: list[CheckResult] = msgspec.field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> str:
        checks = ", ".join(f"{check.check} {check.status}" for check in self.checks)
        failures = "; ".join(f"{check.check}: {check.failure}" for check in self.checks if check.failure)
        return f"{self.name}: {self.outcome} ({checks or self.reason}){' | ' + failures if failures else ''}"


class Report(msgspec.Struct):
    mlx_lm_version: str
    device: str
    platform: str
    wall_s: float
    results: list[ArchResult]


def check_architecture(spec: ArchSpec, work_dir: Path, tokenizer_dir: Path) -> ArchResult:
    """Build the spec's model under `work_dir`, run the checks, judge them (in this process)."""
    started = time.monotonic()
    result = ArchResult(spec.name, spec.model_type, "unbuildable")
    result.quantization = spec.quantization.label if spec.quantization else ""
    try:
        run_checks(spec, work_dir, tokenizer_dir, result)
    finally:
        result.wall_s = round(time.monotonic() - started, 1)
    return result


def run_checks(spec: ArchSpec, work_dir: Path, tokenizer_dir: Path, result: ArchResult) -> None:
    try:
        model, config = build_model(spec)
        result.layer_kinds = layer_kinds(model, config)
        model_dir = save_model_dir(model, config, work_dir / "model", tokenizer_dir)
        del model
        loaded = mlx_lm.load(str(model_dir))
        reference, tokenizer = loaded[0], loaded[1]
    except Exception as error:
        result.reason = f"{type(error).__name__}: {error}"
        return
    eos_token_ids = set(tokenizer.eos_token_ids)
    try:
        observed = asyncio.run(run_engine_checks(model_dir, work_dir / "cache", eos_token_ids))
    except RefusedError as refusal:
        result.outcome, result.reason = "refused", str(refusal)
        return
    result.checks = [judge(check, reference, eos_token_ids) for check in observed]
    result.outcome = "pass" if all(check.status == "pass" for check in result.checks) else "fail"


def check_isolated(
    spec: ArchSpec, work_dir: Path, tokenizer_dir: Path, timeout_s: float = WORKER_TIMEOUT_S
) -> ArchResult:
    """`check_architecture` in a process of its own: a C++ abort or a hang is reported, not fatal."""
    arch_dir = work_dir / spec.name
    arch_dir.mkdir(parents=True, exist_ok=True)
    result_path, log_path = arch_dir / "result.json", arch_dir / "log.txt"
    result_path.unlink(missing_ok=True)
    argv = ["--worker", spec.name, "--work-dir", str(arch_dir), "--tokenizer-dir", str(tokenizer_dir)]
    started = time.monotonic()
    code = run_module("tests.conformance", argv, log_path, timeout_s)
    if result_path.exists():
        return msgspec.json.decode(result_path.read_bytes(), type=ArchResult)
    tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    reason = f"no result after {timeout_s:.0f} s" if code is None else f"exit code {code}"
    return ArchResult(
        spec.name,
        spec.model_type,
        "crashed",
        quantization=spec.quantization.label if spec.quantization else "",
        reason=f"{reason}; log tail: {tail}",
        wall_s=round(time.monotonic() - started, 1),
    )


def run_suite(specs: list[ArchSpec], work_dir: Path, tokenizer_dir: Path) -> Report:
    started = time.monotonic()
    results = []
    for spec in specs:
        result = check_isolated(spec, work_dir, tokenizer_dir)
        print(f"[{time.monotonic() - started:6.0f} s] {result.summary()}", flush=True)
        results.append(result)
    return Report(
        mlx_lm.__version__,
        mx.default_device().type.name,  # cpu or gpu
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        round(time.monotonic() - started, 1),
        results,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="+", choices=sorted(ARCHITECTURES), metavar="NAME", help="these architectures"
    )
    parser.add_argument(
        "--default-suite", action="store_true", help="only those the default pytest suite runs"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/conformance.json")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="default: the default model's")
    parser.add_argument("--worker", choices=sorted(ARCHITECTURES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokenizer_dir is None:
        from semantic.engine.model.default_model import ensure_default_model

        args.tokenizer_dir = ensure_default_model("float32")
    if args.worker is not None:
        result = check_architecture(ARCHITECTURES[args.worker], args.work_dir, args.tokenizer_dir)
        (args.work_dir / "result.json").write_bytes(msgspec.json.encode(result))
        return
    specs = [ARCHITECTURES[name] for name in args.only] if args.only else list(ARCHITECTURES.values())
    if args.default_suite:
        specs = [spec for spec in specs if spec.in_default_suite]
    with tempfile.TemporaryDirectory() as scratch:
        report = run_suite(specs, args.work_dir or Path(scratch), args.tokenizer_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    counts = {
        outcome: sum(r.outcome == outcome for r in report.results)
        for outcome in ("pass", "fail", "refused", "crashed", "unbuildable")
    }
    print(f"{len(report.results)} architectures in {report.wall_s:.0f} s: {counts}; written to {args.out}")


if __name__ == "__main__":
    main()
