#!/usr/bin/env bash
# The fuzz targets, each for a bounded time:
#
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]     default 60 s each, every target
#
# Targets: gguf-rust (crates/ft-core/fuzz: the Rust GGUF parser and tensor bounds, cargo fuzz on
# nightly), gguf, tokenizer, chat_template, requests (fuzz/fuzz_python.py, atheris). Seeds come
# from fuzz/seeds.py (made once into $FREETOKEN_CACHE/fuzz/seeds); each target's corpus grows in
# $FREETOKEN_CACHE/fuzz/corpus/TARGET across runs. A finding (crash, leak, timeout, out of
# memory) is written to $FREETOKEN_CACHE/fuzz/findings and fails the script. Run inside the test
# command's .venv (atheris, freetoken built).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_EACH=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(gguf-rust gguf tokenizer chat_template requests)

CACHE=${FREETOKEN_CACHE:-$HOME/.cache/freetoken}
FUZZ=$CACHE/fuzz
FINDINGS=$FUZZ/findings
mkdir -p "$FINDINGS"
CARGO_FUZZ_ROOT=$CACHE/cargo-fuzz
export PATH=$CARGO_FUZZ_ROOT/bin:$PATH

log() { echo "fuzz.sh: $*" >&2; }

# Findings: crashes, leaks, timeouts, out of memory (not libFuzzer's slow-unit notes, which a
# loaded host writes for inputs that are only slow to be scheduled).
findings() { find "$FINDINGS" -type f | grep -Ec -- '-(crash|leak|timeout|oom)-' || true; }

if [ ! -f "$FUZZ/seeds/.complete" ]; then
    rm -rf "$FUZZ/seeds"
    python fuzz/seeds.py "$FUZZ/seeds"
    touch "$FUZZ/seeds/.complete"
fi

# libFuzzer's flags for every target: a time budget, a per-input timeout, a memory cap, and
# where findings go; GGUF inputs are whole small models (about 2 MB).
flags() {
    local max_len=65536
    case $1 in gguf | gguf-rust) max_len=4000000 ;; esac
    echo "-max_total_time=$SECONDS_EACH -timeout=30 -rss_limit_mb=4096 -max_len=$max_len" \
        "-artifact_prefix=$FINDINGS/$1-"
}

corpus() {
    local dir=$FUZZ/corpus/$1 seeds=$FUZZ/seeds/${1%-rust}
    mkdir -p "$dir"
    [ -n "$(ls -A "$dir")" ] || cp "$seeds"/* "$dir"/
    echo "$dir"
}

rust_target() {
    if ! cargo +nightly --version >/dev/null 2>&1 &&
        ! rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
        # Like the GPU tests without a GPU: said loudly, not failed, where no nightly can be had.
        log "gguf-rust SKIPPED: no nightly toolchain and rustup could not install one"
        echo "Done (skipped: no nightly toolchain)" >&2
        return 0
    fi
    if ! command -v cargo-fuzz >/dev/null; then
        log "installing cargo-fuzz into $CARGO_FUZZ_ROOT"
        cargo install -q cargo-fuzz --version 0.13.1 --locked --root "$CARGO_FUZZ_ROOT"
    fi
    local dir
    dir=$(corpus gguf-rust)
    # shellcheck disable=SC2046
    (cd crates/ft-core && cargo +nightly fuzz run -s address gguf "$dir" -- $(flags gguf-rust))
}

python_target() {
    local dir
    dir=$(corpus "$1")
    # shellcheck disable=SC2046
    python fuzz/fuzz_python.py "$1" "$dir" $(flags "$1")
}

status=0
for t in "${TARGETS[@]}"; do
    log "$t for $SECONDS_EACH s"
    before=$(findings)
    case $t in
    gguf-rust) rust_target 2>"$FUZZ/$t.log" || true ;;
    gguf | tokenizer | chat_template | requests) python_target "$t" 2>"$FUZZ/$t.log" || true ;;
    *)
        log "unknown target $t"
        exit 2
        ;;
    esac
    grep -aE "^(#[0-9]+|Done)" "$FUZZ/$t.log" | tail -1 >&2 || true
    if [ "$(findings)" -gt "$before" ]; then
        log "$t FOUND something: $(ls -t "$FINDINGS" | head -1) (log: $FUZZ/$t.log)"
        status=1
    elif ! grep -aq "^Done" "$FUZZ/$t.log"; then
        log "$t did not finish (log: $FUZZ/$t.log)"
        tail -20 "$FUZZ/$t.log" >&2
        status=1
    fi
done
cd "$ROOT"
exit $status
