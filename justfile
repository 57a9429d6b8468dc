# Everyday recipes. `just --list` shows them all.
venv := ".venv"
py := venv / "bin/python"
# Runs a command with OpenBLAS preloaded on Linux (see semantic/launch.py).
fast := py + " -m semantic.launch"
claude_dir := env("XDG_CACHE_HOME", env("HOME") / ".cache") / "semantic/claude-code"

default:
    @just --list

# Create the virtual environment and install semantic with its dev tools.
setup:
    test -x {{py}} || python3 -m venv {{venv}}
    {{py}} -m pip install --quiet --upgrade pip
    {{py}} -m pip install --quiet -e '.[dev]'

# Serve the default model (or pass --model and other flags).
serve *ARGS:
    {{venv}}/bin/semantic serve {{ARGS}}

# Lint, type-check and run the test suite (with Claude Code installed first where npm exists); the
# slowest tests are listed at the end, to keep the suite short.
test *ARGS: lint
    -command -v npm >/dev/null && {{just_executable()}} claude-code
    {{fast}} {{py}} -m pytest -q --durations=20 {{ARGS}}

# The long soaks and exhaustive variants left out of `just test` (tests marked slow); CI runs them too.
test-slow *ARGS:
    {{fast}} {{py}} -m pytest -q --durations=10 -m slow {{ARGS}}

# Install the Claude Code CLI into the user cache (tests look for it there).
claude-code:
    mkdir -p {{claude_dir}}
    cd {{claude_dir}} && npm install --silent --no-audit --no-fund @anthropic-ai/claude-code
    {{claude_dir}}/node_modules/.bin/claude --version

# ruff (lint and format check), mypy, and the docs site built with every link checked.
lint:
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{py}} scripts/typecheck.py
    {{venv}}/bin/mkdocs build --strict --quiet

# Reformat the code.
fmt:
    {{venv}}/bin/ruff format .
    {{venv}}/bin/ruff check --fix .

# Build the tool-calling test model: the default model with the committed LoRA adapter fused in
# (trained with mlx-lm's LoRA on real Claude Code sub-agent sessions recorded against a scripted
# model; `--train` trains it again); cached beside the default model.
tool-model *ARGS:
    {{fast}} {{py}} scripts/make_tool_model.py {{ARGS}}

# Run the benchmarks (about 45 minutes on a 2-core CPU); figures and plots go to bench/results/.
bench:
    {{fast}} {{py}} -m bench.batching
    {{fast}} {{py}} -m bench.agent_resume
    {{fast}} {{py}} -m bench.model_swap
    {{fast}} {{py}} -m bench.agent_replay
    {{fast}} {{py}} -m bench.hostile_load
    {{fast}} {{py}} -m bench.structured_output
    {{fast}} {{py}} -m bench.arrivals
    {{fast}} {{py}} -m bench.kv_footprint
    {{fast}} {{py}} -m bench.decode_limit
    {{fast}} {{py}} -m bench.idle_kv
    {{fast}} {{py}} -m bench.history_ttft
    {{fast}} {{py}} -m bench.hybrid_resume
    {{fast}} {{py}} -m bench.distributed
    {{fast}} {{py}} -m bench.step_overhead
    {{fast}} {{py}} -m bench.speculative_edit

# Only the multi-agent replay against mlx_lm.server (pass e.g. --agents 1 4).
bench-replay *ARGS:
    {{fast}} {{py}} -m bench.agent_replay {{ARGS}}

# Returning-turn TTFT against cold, a hybrid (Qwen3-Next) and a dense model beside mlx_lm.server
# (about 10 minutes on a 2-core CPU; pass e.g. --models dense --lengths 500 2000 --samples 3).
bench-hybrid *ARGS:
    {{fast}} {{py}} -m bench.hybrid_resume {{ARGS}}

# The engine stepped by hand under the replay's first turns: each tick's chunk, time and budget.
tick-trace *ARGS:
    {{fast}} {{py}} -m bench.tick_trace {{ARGS}}

# Fetch and convert the default model into the user cache.
fetch-model *ARGS:
    {{fast}} {{py}} scripts/fetch_default_model.py {{ARGS}}

# A long mixed workload with small budgets (pass --minutes, --workers): leaks, failures, lost turns.
soak *ARGS:
    {{fast}} {{py}} -m bench.soak {{ARGS}}
