#!/usr/bin/env bash
# The README's install as a new user meets it: a fresh clone of this repository's HEAD, a new
# virtual environment, no cmake on PATH (it must come from PyPI as a build requirement), the
# README's first command, then `freetoken generate -n 8` must print text. Prints the install's
# time. Downloads go through pip's cache under ~/.cache/freetoken.
#
#   bash scripts/check-install.sh            the CPU install
#   FREETOKEN_CUDA=1 bash scripts/check-install.sh   the same with the GPU library
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-${FREETOKEN_CACHE:-$HOME/.cache/freetoken}/pip}
export PIP_DISABLE_PIP_VERSION_CHECK=1

git clone -q "$repo" "$work/freetoken"
python3 -m venv "$work/venv"
# PATH without any folder that holds a cmake.
path=
IFS=: read -r -a dirs <<<"$PATH"
for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ ! -x "$d/cmake" ] && path=${path:+$path:}$d
done
export PATH=$work/venv/bin:$path
if command -v cmake >/dev/null; then
    echo "check-install: a cmake is still on PATH ($(command -v cmake))" >&2
    exit 1
fi

cd "$work/freetoken"
t0=$SECONDS
pip install -q '.[default-model]'
echo "check-install: pip install '.[default-model]' took $((SECONDS - t0)) s" >&2
cd "$work"
out=$(freetoken generate -p "The capital of France is" -n 8 --temp 0)
echo "$out"
[ -n "$(echo "$out" | tr -d '[:space:]')" ] || {
    echo "check-install: freetoken generate printed no text" >&2
    exit 1
}
freetoken --version
