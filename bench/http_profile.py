"""Where the time goes while 8 streams decode: the HTTP path against a bare BatchGenerator.

First the steady state: 8 streams of 512 tokens each through the server and through a bare
`BatchGenerator` in this process, in pairs (the order flipped each pair), and the same at 96 tokens,
`bench/batching.py`'s length, where a request's fixed costs weigh more. Then, where py-spy is
installed, three profiles at 200 Hz while 8 streams decode: the server's threads with their idle
samples, the server's GIL holder alone (`--gil`), and the bare generator. Each profile's collapsed
stacks go to `bench/results/http_profile_<name>.txt`; the JSON keeps, for each thread, its samples
as a share of the profile's length and the leaf frames that took most of them.

Written for a GPU, where a small model's step is bound by launching kernels and the server's Python
work could compete with it (`scripts/cuda_bench.sh` runs it); it runs on any backend.
`python -m bench.http_profile [--model DIR] [--seconds S]`; writes bench/results/http_profile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_lm import load

from bench.batching import http_tokens_per_s, raw_tokens_per_s
from bench.common import RESULTS, ROOT, write_results
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess

STREAMS = 8
SHORT = 96  # tokens per stream: bench/batching.py's length
PAIRS = 3
RATE_HZ = 200
TOP_LEAVES = 8
# "func (path/to/site-packages/pkg/file.py:12)" -> "func (pkg/file.py:12)"
_PATH_PREFIX = re.compile(r"\((?:[^()]*/(?:site-packages|lib/python3\.\d+)/)")


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return os.environ.get("PY_SPY") or (str(beside) if beside.exists() else shutil.which("py-spy"))


def record(spy: str, pid: int, output: Path, seconds: int, *flags: str) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `seconds` in the background, without pausing it (--nonblocking),
    its collapsed stacks written to `output`."""
    cmd = [spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--duration", str(seconds)]
    cmd += ["--nonblocking", "--format", "raw", "--output", str(output), *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarise(stacks: Path, seconds: int) -> dict[str, Any]:
    """Each thread's samples (as a share of the profile's length) and its most frequent leaves."""
    totals: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        thread = thread.split(": ", 1)[-1]  # "thread (0x7f..): semantic-engine" -> "semantic-engine"
        totals[thread] += int(count)
        if frames:
            leaf = _PATH_PREFIX.sub("(", frames[-1]).replace(f"({ROOT}/", "(")
            leaves[thread][leaf] += int(count)
    return {
        thread: {
            "share_of_profile": round(total / (RATE_HZ * seconds), 3),
            "top_leaves": {leaf: round(n / total, 3) for leaf, n in leaves[thread].most_common(TOP_LEAVES)},
        }
        for thread, total in totals.most_common()
    }


def profile_while(
    spy: str, pid: int, name: str, seconds: int, decode: Callable[[], float], *flags: str
) -> dict[str, Any]:
    """Profile `pid` while `decode()` runs again and again (8 streams each time)."""
    stacks = RESULTS / f"http_profile_{name}.txt"
    proc = record(spy, pid, stacks, seconds, *flags)
    rates, stop = [], time.monotonic() + seconds + 1
    while time.monotonic() < stop:
        rates.append(round(decode(), 1))
    _, errors = proc.communicate(timeout=60)
    if proc.returncode or not stacks.exists():
        return {"error": errors.decode(errors="replace")[-500:], "tok_s_while_profiled": rates}
    return {"flags": list(flags), "tok_s_while_profiled": rates, "threads": summarise(stacks, seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    parser.add_argument("--seconds", type=int, default=10, help="each profile's length")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per stream in the steady state")
    args = parser.parse_args()
    model_dir = args.model or ensure_default_model()
    model, tokenizer = load(str(model_dir))
    spy = py_spy()
    RESULTS.mkdir(parents=True, exist_ok=True)

    def raw(tokens: int) -> float:
        return raw_tokens_per_s(model, tokenizer, STREAMS, tokens)

    results: dict[str, Any] = {"model": model_dir.name, "streams": STREAMS, "py_spy": spy}
    with tempfile.TemporaryDirectory() as cache:
        # bench/batching.py's server: up to 8 prompts prefilled together in 512-token chunks.
        flags = ("--model", str(model_dir), "--prefill-batch-size", "8", "--prefill-step-size", "512")
        server = ServerProcess(Path(cache), *flags).start()
        assert server.proc is not None

        def http(tokens: int) -> float:
            return asyncio.run(http_tokens_per_s(server.base_url, tokenizer, STREAMS, max_tokens=tokens))

        try:
            for n in (1, 2, 4, 8):  # each batch size once on both sides (a GPU compiles its kernels)
                raw_tokens_per_s(model, tokenizer, n, 16)
                asyncio.run(http_tokens_per_s(server.base_url, tokenizer, n, max_tokens=16))
            for tokens in (args.tokens, SHORT):
                pairs = []
                for run in range(PAIRS):
                    sides = ("raw", "http") if run % 2 == 0 else ("http", "raw")
                    pairs.append(
                        {side: round(raw(tokens) if side == "raw" else http(tokens), 1) for side in sides}
                    )
                raw_median = statistics.median(p["raw"] for p in pairs)
                http_median = statistics.median(p["http"] for p in pairs)
                results[f"tokens_{tokens}"] = {
                    "pairs_tok_s": pairs,
                    "http_over_raw": round(http_median / raw_median, 3),
                }
            if spy:
                results["server_all_threads"] = profile_while(
                    spy,
                    server.proc.pid,
                    "server",
                    args.seconds,
                    lambda: http(args.tokens),
                    "--idle",
                    "--threads",
                )
                results["server_gil_holder"] = profile_while(
                    spy,
                    server.proc.pid,
                    "server_gil",
                    args.seconds,
                    lambda: http(args.tokens),
                    "--gil",
                    "--threads",
                )
        finally:
            server.stop()
    if spy:
        results["bare_generator"] = profile_while(
            spy, os.getpid(), "bare", args.seconds, lambda: raw(args.tokens), "--idle", "--threads"
        )
    write_results("http_profile", results)


if __name__ == "__main__":
    main()
