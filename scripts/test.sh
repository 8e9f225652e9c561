#!/usr/bin/env bash
# The test command (README): installs what the tests need into .venv, builds the extension,
# then runs the lints, cargo test, pytest and the fuzz targets briefly. Downloads are cached
# under ~/.cache/freetoken.
set -euo pipefail
cd "$(dirname "$0")/.."

export FREETOKEN_CACHE="${FREETOKEN_CACHE:-$HOME/.cache/freetoken}"
export PIP_CACHE_DIR="$FREETOKEN_CACHE/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -r requirements-dev.txt
# The venv's bin holds cmake (requirements-dev.txt) for ggml's build: no system cmake needed.
# shellcheck disable=SC1091
. .venv/bin/activate

maturin develop --release -q
python -m mypy.stubtest freetoken._core --allowlist scripts/stubtest-allowlist.txt

cargo fmt --all --check
cargo clippy --workspace --all-targets -q -- -D warnings
ruff check python tests benches scripts tools fuzz
ruff format --check python tests benches scripts tools fuzz
mypy

cargo test --workspace -q
pytest -q
# Each fuzz target for a few seconds: a regression on a seed or a near mutation fails here.
bash scripts/fuzz.sh 10

# The executor and model tests again on the AVX2 kernels (the kernel tests run every level the
# host has in either run).
export FREETOKEN_CPU_ISA=avx2
cargo test -p ft-cpu -q
pytest -q tests/test_quant_matmul.py tests/test_moe_executor.py tests/test_moe_models.py \
    tests/test_models_vs_llamacpp.py tests/test_cpu_isa.py tests/test_repack.py
