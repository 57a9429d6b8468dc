#!/usr/bin/env bash
# The benchmarks on a lent CUDA machine that reaches no package index or model hub, in three steps:
#
#   scripts/cuda_bench.sh prepare  here: fetch the wheels for Python 3.12 into .gpu1/ and .gpu2/
#                                  (the mlx-cuda-13 library, stripped and xz-compressed, split in
#                                  two), and the default model's config and tokenizer
#   scripts/cuda_bench.sh stash    there, carrying .gpu1: keep the first half in /tmp
#   scripts/cuda_bench.sh run S    there, carrying .gpu2, on the same warm machine: join the halves,
#                                  install the wheels, write a random-weight model of the default
#                                  model's shape, then run the benchmarks in order of importance for
#                                  at most S seconds (BENCHES="name args,name" picks them)
#
# The mlx-cuda-13 wheel (~70 MB compressed) is larger than one call may carry (64 MiB), hence two
# calls. The real weights cannot travel at all, so the figures come from bench/shaped_model.py's
# copy: speed depends on the shape, not on the values. Each finished benchmark's JSON and plot are
# added to $OUT/results.tar at once, so a run cut short keeps them.
set -uo pipefail
stash=/tmp/semantic-stash
out=${OUT:-/tmp/semantic-out}
mkdir -p "$stash" "$out"

if [ "${1:-}" = prepare ]; then
    python=${PYTHON:-.venv/bin/python}
    version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
    mlx=$(version mlx)
    download() {
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 "$@"
    }
    work=$(mktemp -d)
    rm -rf .gpu1 .gpu2 && mkdir -p .gpu1 .gpu2/whl .gpu2/model_src || exit 1
    download -d .gpu2/whl "mlx==$mlx" "mlx-lm==$(version mlx-lm)" "msgspec==$(version msgspec)" \
        "loguru==$(version loguru)" "llguidance==$(version llguidance)" "py-spy==$(version py-spy)" || exit 1
    download -d "$work" "mlx-cuda-13==$mlx" || exit 1
    (cd "$work" && mkdir lib && cd lib && unzip -q ../mlx_cuda_13-*.whl && strip --strip-unneeded mlx/lib/libmlx.so \
        && tar cf - . | xz -T0 -9 > ../cuda.tar.xz) || exit 1
    head -c 38000000 "$work/cuda.tar.xz" > .gpu1/cuda.part1
    tail -c +38000001 "$work/cuda.tar.xz" > .gpu2/cuda.part2
    model=$("$python" -c 'from semantic.engine.default_model import ensure_default_model as m; print(m())')
    for name in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
        cp "$model/$name" .gpu2/model_src/ || exit 1
    done
    rm -rf "$work" && du -sh .gpu1 .gpu2
    exit 0
fi
if [ "${1:-}" = stash ]; then
    cp .gpu1/* "$stash"/ && ls -la "$stash"
    nvidia-smi --query-gpu=name,memory.total --format=csv
    exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 prepare | stash | run SECONDS" >&2; exit 2; }
deadline=$(( $(date +%s) + ${2:-540} ))

site=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu2/whl/*.whl || exit 1
cat "$stash"/cuda.part1 .gpu2/cuda.part2 | xz -d | tar x -C "$site" || exit 1
# libmlx.so finds CUDA's libraries through $ORIGIN/../../nvidia/...: the image has them in its venv.
nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null)
if [ -n "$nvidia" ] && [ ! -e "$site/nvidia" ]; then ln -s "$nvidia" "$site/nvidia"; fi
if [ -n "$nvidia" ]; then
    LD_LIBRARY_PATH=$(find -L "$nvidia" -maxdepth 3 -type d -name lib | paste -sd:):${LD_LIBRARY_PATH:-}
    export LD_LIBRARY_PATH
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg PATH=$site/bin:$PATH
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if ! python3 -c 'import mlx.core as mx; a = mx.ones((2048, 2048)); print(mx.default_device(), (a @ a).sum().item())'
then
    ldd "$site/mlx/lib/libmlx.so" | grep -i "not found"; echo "nvidia: $nvidia"; ls "$nvidia" "$nvidia"/*/
    exit 1
fi

model=$XDG_CACHE_HOME/semantic/models/SmolLM2-135M-Instruct-float32
python3 -m bench.shaped_model .gpu2/model_src "$model" || exit 1
cp .gpu2/model_src/generation_config.json "$model"/

rm -rf bench/results && mkdir -p bench/results/logs
run_bench() {  # NAME [ARGS...]: run one benchmark in the time left, then bank the results
    local left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 30 ]; then echo "== $1: skipped, ${left}s left"; return; fi
    echo "== $1 $(date +%T) (${left}s left)"
    timeout -k 5 "$left" python3 -m "bench.$1" "${@:2}" > "bench/results/logs/$1.log" 2>&1
    echo "   exit $? $(date +%T): $(tail -c 400 "bench/results/logs/$1.log" | tr '\n' ' ')"
    tar cf "$out/results.tar" -C bench/results .
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
benches=${BENCHES:-decode_limit,batching,agent_resume,arrivals,history_ttft,agent_replay --agents 8,kv_footprint,http_profile}
IFS=, read -ra list <<< "$benches"
for bench in "${list[@]}"; do
    run_bench $bench  # unquoted: a benchmark's name, then its arguments
done
