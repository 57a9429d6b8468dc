# Everyday recipes. `just --list` shows them all.
venv := ".venv"
py := venv / "bin/python"
# Runs a command with OpenBLAS preloaded on Linux (see semantic/launch.py).
fast := py + " -m semantic.launch"

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

# Lint, type-check and run the test suite.
test *ARGS: lint
    {{fast}} {{py}} -m pytest -q {{ARGS}}

# ruff (lint and format check) and mypy.
lint:
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{venv}}/bin/mypy

# Reformat the code.
fmt:
    {{venv}}/bin/ruff format .
    {{venv}}/bin/ruff check --fix .

# Run the benchmarks; figures go to bench/results/.
bench:
    {{fast}} {{py}} -m bench.batching
    {{fast}} {{py}} -m bench.agent_resume

# Fetch and convert the default model into the user cache.
fetch-model *ARGS:
    {{fast}} {{py}} scripts/fetch_default_model.py {{ARGS}}
