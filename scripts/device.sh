#!/usr/bin/env bash
# The GPU script, in phases (docs/gpu.md; figures in benches/README.md).
#
#   bash scripts/device.sh prepare        here, on a dev machine: fills .ft-device/ (ignored)
#   bash scripts/device.sh build test     on the GPU machine, with .ft-device carried
#                                         (FT_TOOLS=0: no llama.cpp tools, the library only)
#   bash scripts/device.sh bench          on the GPU machine, after build (same /tmp)
#   bash scripts/device.sh bench-e2e      on the GPU machine: the 48-layer model (written by
#                                         bench-model if missing) against llama-bench
#   bash scripts/device.sh bench-hybrid   on the GPU machine: --moe-strategy hybrid against
#                                         llama-bench -ncmoe on the uniform and zipf models
#   bash scripts/device.sh bench-preset   on the GPU machine: a released model's shape
#                                         (FT_PRESET: qwen3.5-35b-a3b, gemma-4-26b-a4b), all
#                                         resident against llama-bench -ngl 99, or
#                                         (FT_ROWS=hybrid) hybrid against -ncmoe
#   bash scripts/device.sh bench-streams  on the GPU machine: 4, 16 and 32 concurrent streams
#                                         and 4096-token prompts, freetoken serve (hybrid)
#                                         against llama-server -ncmoe, 3 rounds in turn; the
#                                         48-layer model, or FT_PRESET's
#   bash scripts/device.sh bench-spec     on the GPU machine: speculative decoding (draft-mtp,
#                                         synthetic acceptance) on the Qwen3.5-35B-A3B preset
#                                         with its MTP layer, hybrid against llama-server -ncmoe
#   bash scripts/device.sh profile        on the GPU machine: where a step's time goes
#                                         (benches/profile_gpu_step.py; FT_PROFILE_ARGS)
#   bash scripts/device.sh profile-serve  on the GPU machine: py-spy samples of freetoken
#                                         serve's threads under concurrent streams
#   bash scripts/device.sh bench-jobs     on the GPU machine's host, no CUDA build: the CPU
#                                         executor's cost per one-token job (bench_moe_jobs.py)
#   FT_ALT_REF=REF FT_ALT_NAME=NAME bash scripts/device.sh prepare-alt
#                                         here: the wheel of git REF into .ft-device/alt/NAME
#   bash scripts/device.sh bench-jobs-ab  on the GPU machine's host: bench-jobs with the main
#                                         wheel and each .ft-device/alt wheel, rounds in turn
#
# prepare: a trimmed copy of the pinned llama.cpp tree (no docs, models, tests, examples, web
#   UI sources or unused backends: about 32 MB) and the abi3 wheel, built with the explicit GGML CPU
#   options below (never native) so that it runs on the GPU machine too; gguf-py's and the
#   `openai` client's wheels for the tests.
# build:   one cmake/ninja tree in $FT_BUILD (default /tmp/ft-build) builds libfreetoken_cuda.so
#   through cuda/CMakeLists.txt, the entry point `FREETOKEN_CUDA=1 pip install` builds it with
#   (crates/ft-cuda/build.rs), and llama.cpp's llama-bench and llama-server (no web UI), so
#   ggml-cuda compiles once; the wheel is installed into $FT_SITE (default /tmp/ft-site) with
#   the working tree's Python sources over it and the library next to the extension, as such a
#   wheel ships it; `freetoken --version` then goes to $OUT/version.txt.
# test:    pytest -m gpu on that install (builds first if $FT_BUILD has no library).
# bench:   benches/bench_gpu_experts.py, and llama-bench when FT_BENCH_MODEL names a GGUF.
# bench-hybrid: benches/bench_hybrid.py on $FT_HYBRID_MODELS (space separated; default the
#   uniform and zipf 48-layer models, written if missing: bench-models), configs
#   $FT_HYBRID_CONFIGS, more bench_hybrid.py arguments in $FT_HYBRID_ARGS (--ncmoe 31 ...).
# bench-preset: the shape of make-test-model --preset $FT_PRESET (default qwen3.5-35b-a3b: 40
#   layers, 30 of them Gated DeltaNet, 256 experts top-8 and a shared expert; gemma-4-26b-a4b:
#   30 layers, 128 experts top-8 beside the dense FFN), Q4_K experts, Q8_0 the rest, 4 layers'
#   experts tiled, written if missing; FT_ROUTING=zipf for per-layer hot experts (default
#   uniform). FT_ROWS=resident (default): every expert on the GPU (gpu, dense weights quant)
#   against llama-bench -ngl 99, pp512 and tg64; FT_ROWS=hybrid: bench_hybrid.py with the
#   expert cache at FT_FRACTION (default 0.25) of the expert bytes, configs FT_PRESET_CONFIGS
#   (hybrid, hybrid+adaptive, hybrid+profile) against -ncmoe swept at about the same VRAM, tg64
#   and (FT_PROMPTS, default 512,4096) prompt rates. One preset, routing and fraction per call.
# preset-model: only writes bench-preset's model (FT_PRESET, FT_ROUTING; FT_NEXTN=1 the one
#   with an MTP layer, bench-spec's), for instance into another FT_SITE while `build` runs.
# bench-streams: benches/bench_server_streams.py (see bench_streams below); with FT_PRESET set
#   on bench-preset's model, the cache at 25% of its expert bytes and the -ncmoe of its hybrid
#   rows' VRAM.
# bench-spec: the preset model with FT_NEXTN (default 1) nextn layers, the cache at
#   FT_FRACTION (0.25) of the expert bytes, rates FT_SPEC_RATES (0.8,0.6,0.4, one per draft
#   token): benches/bench_speculative.py (freetoken bench hybrid without and with draft-mtp,
#   the verify step's cost by tokens), then bench_server_streams.py with one stream: freetoken
#   serve against llama-server with the same --spec-* flags at each -ncmoe of FT_SPEC_NCMOE
#   (default: benches/moe_budget.py's sweep about the same VRAM), drafted and accepted tokens
#   beside tokens/s, peak VRAM and RSS.
# Each device phase fits one 10-minute call; logs and figures go to $OUT (or ./.ft-device/out).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEV=$ROOT/.ft-device
OUT=${OUT:-$DEV/out}
FT_BUILD=${FT_BUILD:-/tmp/ft-build}
FT_SITE=${FT_SITE:-/tmp/ft-site}
ARCHS=${FREETOKEN_CUDA_ARCHS:-90}
# The pinned sdist's sha256 (python/freetoken/llama_pin.toml, one `key = "value"` per line).
SHA=$(sed -n 's/^sha256 = "\([0-9a-f]*\)"$/\1/p' python/freetoken/llama_pin.toml)
[ ${#SHA} = 64 ] || { echo "device.sh: no sha256 in python/freetoken/llama_pin.toml" >&2; exit 2; }
# The families' vocabularies the GPU tests read besides llama-spm and qwen2.
PACKED_VOCABS="llama-bpe qwen35 gemma-4"
# The official client the live-server checks drive, and what it needs that the GPU machine's
# image lacks (or holds at other versions): wheels at the versions of this checkout's .venv.
CLIENT_PACKAGES="openai httpx2 httpcore2 truststore h11 anyio sniffio jiter pydantic \
pydantic-core annotated-types typing-inspection typing-extensions"

# Instruction sets both the dev machines and the GPU machine have.
CPU_OPTIONS="GGML_SSE42=ON GGML_AVX=ON GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON GGML_BMI2=ON \
GGML_AVX512=ON GGML_AVX512_VBMI=ON GGML_AVX512_VNNI=ON GGML_AVX512_BF16=ON"
mkdir -p "$OUT"

log() { echo "device.sh: $*" >&2; }

# dev_tools: maturin and cmake (ggml's build) from .venv, as the test command installs them.
dev_tools() {
    [ -x "$ROOT/.venv/bin/maturin" ] && [ -x "$ROOT/.venv/bin/cmake" ] || {
        log "no .venv with maturin and cmake: python3 -m venv .venv &&" \
            ".venv/bin/pip install -r requirements-dev.txt (or run bash scripts/test.sh once)"
        exit 2
    }
    export PATH=$ROOT/.venv/bin:$PATH
}

prepare() {
    dev_tools
    local src=${FREETOKEN_LLAMA_SRC:-$HOME/.cache/freetoken/llama.cpp-$SHA}
    [ -f "$src/ggml/CMakeLists.txt" ] || {
        log "no pinned tree at $src: build the workspace once (cargo build) to unpack it"
        exit 2
    }
    log "trimming $src into $DEV/llama.cpp"
    mkdir -p "$DEV"
    rm -rf "$DEV/llama.cpp"
    cp -a "$src" "$DEV/llama.cpp"
    (
        cd "$DEV/llama.cpp"
        # The test models' vocabularies stay (llama-spm for the small ones, qwen2 for the
        # Qwen3-30B-A3B-shaped benchmark model); the families' own ones travel compressed
        # (the carried tree's size limit) and are unpacked there before the tests.
        mkdir -p ../vocab
        cp models/ggml-vocab-llama-spm.gguf models/ggml-vocab-qwen2.gguf ../vocab/
        for v in $PACKED_VOCABS; do xz -6 -T2 -c "models/ggml-vocab-$v.gguf" >"../vocab/ggml-vocab-$v.gguf.xz"; done
        rm -rf docs models tests examples pocs media gguf-py benches tools/server/tests \
            tools/server/bench .freetoken-complete
        # llama-server is built without its web UI: only the UI's CMake file and templates stay.
        find tools/ui -mindepth 1 ! -name CMakeLists.txt ! -name '*.in' -exec rm -rf {} +
        mkdir models
        mv ../vocab/* models/
        rmdir ../vocab
        for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan \
            webgpu zdnn zendnn; do
            rm -rf "ggml/src/ggml-$b"
        done
    )
    du -sh "$DEV/llama.cpp" >&2
    log "building the abi3 wheel (CPU options: $CPU_OPTIONS)"
    rm -rf "$DEV/wheels"
    CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/ft-wheel-target} \
        FREETOKEN_GGML_CPU_OPTIONS="$CPU_OPTIONS" \
        maturin build --release --out "$DEV/wheels"
    # gguf-py (pure Python) is not on the GPU machine's image; py-spy samples the server there
    # (profile-serve).
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$DEV/wheels" gguf==0.19.0
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        -d "$DEV/wheels/tools" py-spy==0.4.3
    local pins
    # shellcheck disable=SC2086
    pins=$(.venv/bin/python -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $CLIENT_PACKAGES)
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$DEV/wheels/client" $pins
    du -sh "$DEV" >&2
}

# prepare-alt: another commit's wheel beside the main one, for bench-jobs-ab (built in a
# temporary worktree with the same CPU options).
prepare_alt() {
    local ref=${FT_ALT_REF:?set FT_ALT_REF to a git commit} name=${FT_ALT_NAME:?set FT_ALT_NAME}
    local tree
    dev_tools
    tree=$(mktemp -d)
    git worktree add -f --detach "$tree" "$ref" >/dev/null
    rm -rf "$DEV/alt/$name"
    (cd "$tree" && CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/ft-wheel-target} \
        FREETOKEN_GGML_CPU_OPTIONS="$CPU_OPTIONS" maturin build --release --out "$DEV/alt/$name")
    git worktree remove --force "$tree"
    du -sh "$DEV" >&2
}

build() {
    local t0=$SECONDS
    [ -d "$DEV/llama.cpp" ] || {
        log "no $DEV/llama.cpp: run the prepare phase here and carry .ft-device"
        exit 2
    }
    command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
    { nvcc --version | tail -1; cmake --version | head -1; } >&2
    local defs=(-DGGML_NATIVE=OFF)
    for o in $CPU_OPTIONS; do defs+=("-D$o"); done
    cmake -S cuda -B "$FT_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DFREETOKEN_LLAMA_SRC="$DEV/llama.cpp" -DFREETOKEN_CUDA_ARCHS="$ARCHS" \
        -DFREETOKEN_WITH_LLAMA_BENCH=ON "${defs[@]}" >"$OUT/configure.log" 2>&1 || {
        tail -40 "$OUT/configure.log"
        exit 1
    }
    # FT_TOOLS=0: the library alone (a call that only runs the GPU tests).
    local targets=(freetoken_cuda)
    [ "${FT_TOOLS:-1}" = 0 ] || targets+=(llama-bench)
    cmake --build "$FT_BUILD" --target "${targets[@]}" -j "$(nproc)" \
        >"$OUT/build.log" 2>&1 || {
        grep -B2 -A12 -m5 "error" "$OUT/build.log" | head -80
        tail -20 "$OUT/build.log"
        exit 1
    }
    # The server reference for the concurrent-stream comparison; its failure does not stop
    # the rest.
    if [ "${FT_TOOLS:-1}" != 0 ]; then
        cmake --build "$FT_BUILD" --target llama-server -j "$(nproc)" >"$OUT/build-server.log" 2>&1 ||
            log "llama-server did not build (see build-server.log)"
    fi
    log "built in $((SECONDS - t0)) s: $(du -h "$FT_BUILD/libfreetoken_cuda.so" | cut -f1) library"
    nm -D --defined-only "$FT_BUILD/libfreetoken_cuda.so" | awk '{print $3}' | sort >"$OUT/exports.txt"
    log "exported symbols: $(tr '\n' ' ' <"$OUT/exports.txt")"
    install_wheel
    # What the install reports (freetoken --version), the library next to the extension.
    PYTHONPATH=$FT_SITE python3 -m freetoken --version 2>&1 | tee "$OUT/version.txt" >&2
}

# install_wheel [SITE [WHEEL]]: the main wheel (or WHEEL) and gguf into SITE ($FT_SITE).
install_wheel() {
    local site=${1:-$FT_SITE} wheel=${2:-$(ls "$DEV"/wheels/freetoken-*.whl)}
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "$wheel" "$DEV"/wheels/gguf-*.whl "$DEV"/wheels/client/*.whl
    # The working tree's Python sources over the wheel's: a Python-only change needs no new
    # wheel (the extension module stays the wheel's). Another commit's wheel ("bare") keeps its
    # own, which match its extension module.
    [ "${3:-}" = bare ] || {
        (cd python && find freetoken -name '*.py' -exec cp --parents {} "$site/" \;)
        # The GPU library where a wheel built with FREETOKEN_CUDA=1 has it: next to the
        # extension, found by the loader as a user's install finds it.
        if [ -f "$FT_BUILD/libfreetoken_cuda.so" ]; then
            cp "$FT_BUILD/libfreetoken_cuda.so" "$site/freetoken/"
        fi
    }
}

env_for_tests() {
    local f
    for f in "$DEV"/llama.cpp/models/*.gguf.xz; do
        if [ -f "$f" ] && [ ! -f "${f%.xz}" ]; then
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
                "$f" "${f%.xz}"
        fi
    done
    export PYTHONPATH=$FT_SITE PYTHONUNBUFFERED=1
    export FREETOKEN_LLAMA_SRC=$DEV/llama.cpp
}

run_tests() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    [ -d "$FT_SITE/freetoken" ] || install_wheel
    env_for_tests
    # Every test file that marks a test `gpu` (the rest would only be collected and skipped),
    # or those FT_TESTS names.
    local files
    if [ -n "${FT_TESTS:-}" ]; then
        read -r -a files <<<"$FT_TESTS"
    else
        mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
    fi
    python3 -m pytest -m gpu -v -p no:cacheprovider --junitxml="$OUT/test-junit.xml" \
        "${files[@]}" 2>&1 | tee "$OUT/test.log"
}

bench() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    [ -d "$FT_SITE/freetoken" ] || install_wheel
    env_for_tests
    python3 benches/bench_gpu_experts.py --json "$OUT/bench_gpu_experts.json" 2>&1 |
        tee "$OUT/bench.log"
    if [ -n "${FT_BENCH_MODEL:-}" ]; then
        "$FT_BUILD/bin/llama-bench" -m "$FT_BENCH_MODEL" -ngl 99 -fa 0 -p 512 -n 64 -o json \
            >"$OUT/llama-bench.json"
        cat "$OUT/llama-bench.json"
    fi
}

# The Qwen3-30B-A3B-shaped benchmark model: 48 layers, 128 experts, top-8, Q4_0
# experts, Q8_0 attention and output, uniform routing; 4 layers' experts tiled (make-test-model
# --tile-experts) so it is written in about two minutes. ZIPF_MODEL: the same with per-layer
# hot experts (--routing zipf), for the hybrid strategy's cache.
BENCH_MODEL=${FT_BENCH_MODEL:-/tmp/ft-models/qwen3moe-30b-a3b-48l-q4_0.gguf}
ZIPF_MODEL=${FT_ZIPF_MODEL:-/tmp/ft-models/qwen3moe-30b-a3b-48l-q4_0-zipf.gguf}

# bench_model [PATH [MAKE-TEST-MODEL ARGS...]]: writes that model (default $BENCH_MODEL) if
# missing, the extra arguments added to the benchmark model's.
bench_model() {
    local out=${1:-$BENCH_MODEL}
    if [ $# -gt 0 ]; then shift; fi
    [ -d "$FT_SITE/freetoken" ] || install_wheel
    env_for_tests
    [ -f "$out" ] && return
    mkdir -p "$(dirname "$out")"
    local t0=$SECONDS
    python3 -m freetoken make-test-model --arch qwen3moe --layers 48 --hidden 2048 --heads 32 \
        --kv-heads 4 --head-dim 128 --experts 128 --top-k 8 --expert-ffn 768 --ffn 768 \
        --quant q8_0,exps=q4_0 --vocab "$DEV/llama.cpp/models/ggml-vocab-qwen2.gguf" \
        --tile-experts 4 --seed 1 "$@" -o "$out" 2>&1 | tail -5
    log "wrote $out ($(du -h "$out" | cut -f1)) in $((SECONDS - t0)) s"
}

# Both 48-layer models: uniform ($BENCH_MODEL) and zipf ($ZIPF_MODEL) routing.
bench_models() {
    bench_model
    bench_model "$ZIPF_MODEL" --routing zipf
}

# FreeToken (all experts resident; dense weights both ways) against llama-bench -ngl 99.
bench_e2e() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    bench_model
    python3 benches/bench_gpu_vs_llamacpp.py -m "$BENCH_MODEL" \
        --llama-bench "$FT_BUILD/bin/llama-bench" -p 512 -n 64 -r 3 -t "$(nproc)" \
        --configs "${FT_CONFIGS:-gpu/quant,gpu/bf16}" --json "$OUT/bench_e2e.json" 2>&1 |
        tee "$OUT/bench_e2e.log"
}

# --moe-strategy hybrid (and offload, cpu) with a quarter of the experts cached on the GPU
# against llama-bench -ncmoe, on the uniform and zipf models (or $FT_HYBRID_MODELS).
bench_hybrid() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    local configs=${FT_HYBRID_CONFIGS:-hybrid+adaptive,hybrid,offload,cpu}
    local models=() args=() extra=() m
    if [ -n "${FT_HYBRID_MODELS:-}" ]; then
        read -r -a models <<<"$FT_HYBRID_MODELS"
        [ -d "$FT_SITE/freetoken" ] || install_wheel
        env_for_tests
    else
        bench_models
        models=("$BENCH_MODEL" "$ZIPF_MODEL")
    fi
    for m in "${models[@]}"; do args+=(--model "$m"); done
    read -r -a extra <<<"${FT_HYBRID_ARGS:-}"
    python3 benches/bench_hybrid.py "${args[@]}" --llama-bench "$FT_BUILD/bin/llama-bench" \
        -n 64 -r 3 -t "$(nproc)" --configs "$configs" "${extra[@]}" \
        --json "$OUT/bench_hybrid.json" 2>&1 | tee "$OUT/bench_hybrid.log"
}

# preset_model: the bench-preset model of $FT_PRESET and $FT_ROUTING, with $FT_NEXTN (default
# 0) multi-token-prediction layers after the trunk (their own file), written if missing; its
# path in PRESET_MODEL (set here, not printed: the test environment it exports stays in the
# caller's shell).
preset_model() {
    local preset=${FT_PRESET:-qwen3.5-35b-a3b} routing=${FT_ROUTING:-uniform} vocab
    local nextn=${FT_NEXTN:-0}
    case $preset in
    qwen3.5-35b-a3b) vocab=qwen35 ;;
    gemma-4-26b-a4b) vocab=gemma-4 ;;
    *)
        log "FT_PRESET=$preset: qwen3.5-35b-a3b or gemma-4-26b-a4b"
        exit 2
        ;;
    esac
    local out=/tmp/ft-models/$preset-q4_k-$routing.gguf
    [ "$nextn" = 0 ] || out=${out%.gguf}-nextn$nextn.gguf
    [ -d "$FT_SITE/freetoken" ] || install_wheel
    env_for_tests
    if [ ! -f "$out" ]; then
        mkdir -p "$(dirname "$out")"
        local t0=$SECONDS
        # No flatness check: a speed benchmark needs no peaked next-token distribution (the
        # Gemma 4 preset's is flat at this seed).
        python3 -m freetoken make-test-model --preset "$preset" --quant q8_0,exps=q4_k \
            --vocab "$DEV/llama.cpp/models/ggml-vocab-$vocab.gguf" --tile-experts 4 \
            --routing "$routing" --nextn-layers "$nextn" --seed 1 --check none -o "$out" 2>&1 |
            tail -5 >&2
        log "wrote $out ($(du -h "$out" | cut -f1)) in $((SECONDS - t0)) s"
    fi
    PRESET_MODEL=$out
}

# pick_model: preset_model's model with FT_PRESET set, else the 48-layer benchmark model
# (each written if missing); its path in MODEL.
pick_model() {
    if [ -n "${FT_PRESET:-}" ]; then
        preset_model
        MODEL=$PRESET_MODEL
    else
        bench_model
        MODEL=$BENCH_MODEL
    fi
}

bench_preset() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    local model tag
    preset_model
    model=$PRESET_MODEL
    tag=${FT_PRESET:-qwen3.5-35b-a3b}_${FT_ROUTING:-uniform}
    case ${FT_ROWS:-resident} in
    resident)
        python3 benches/bench_gpu_vs_llamacpp.py -m "$model" \
            --llama-bench "$FT_BUILD/bin/llama-bench" -p 512 -n 64 -r 3 -t "$(nproc)" \
            --configs gpu/quant --json "$OUT/bench_${tag}_resident.json" 2>&1 |
            tee "$OUT/bench_${tag}_resident.log"
        ;;
    hybrid)
        local fraction=${FT_FRACTION:-0.25}
        python3 benches/bench_hybrid.py --model "$model" \
            --llama-bench "$FT_BUILD/bin/llama-bench" -n 64 -r 3 -t "$(nproc)" \
            --fraction "$fraction" --prompt "${FT_PROMPTS-512,4096}" --no-handoff-cost \
            --configs "${FT_PRESET_CONFIGS:-hybrid,hybrid+adaptive,hybrid+profile}" \
            --json "$OUT/bench_${tag}_hybrid_$fraction.json" 2>&1 |
            tee "$OUT/bench_${tag}_hybrid_$fraction.log"
        ;;
    *)
        log "FT_ROWS=${FT_ROWS}: resident or hybrid"
        exit 2
        ;;
    esac
}

# The llama.cpp -ncmoe of the bench-preset hybrid rows (H200, 25% expert cache, uniform
# routing; benches/README.md) whose peak VRAM was next to hybrid's: Qwen3.5-35B-A3B 27 of
# 40 layers (8681 MiB against 8761), Gemma 4 26B-A4B 17 of 30 (9097 against 9027).
preset_ncmoe() {
    case ${FT_PRESET:-qwen3.5-35b-a3b} in
    qwen3.5-35b-a3b) echo 27 ;;
    gemma-4-26b-a4b) echo 17 ;;
    esac
}

# Concurrent streams: freetoken serve --moe-strategy hybrid at a 25% cache against
# llama-server with the experts of FT_STREAMS_NCMOE layers on the CPU, each server started
# once; on the 48-layer model (31 layers: the same VRAM; a 3888 MiB cache), or with FT_PRESET
# set on preset_model's model (the cache 25% of its expert bytes: moe_budget.py; the layers
# preset_ncmoe's). FT_STREAMS (4,16,32) concurrent decode streams and FT_PROMPT_STREAMS (4)
# prompts of FT_PROMPT_TOKENS (4096) tokens, FT_STREAMS_ROUNDS (3) rounds in turn, the
# median of each row; FreeToken's step split (uploaded and CPU bytes and times per step)
# beside its rows. FT_STREAMS_ARGS adds freetoken serve flags (--moe-fetch-share 0 ...).
# FT_STREAMS_NCMOE overrides the -ncmoe; a comma-separated list starts a llama-server per
# value, each row's ratio against the fastest within FreeToken's peak VRAM + 5%.
# FT_STREAMS_TAG is added to the output names: the decode rows (FT_PROMPT_TOKENS=0) and the
# prompt rows (FT_STREAMS=4 FT_STREAMS_RESIDENT=) of one model in two calls keep both files.
# An all-resident freetoken serve (FT_STREAMS_RESIDENT, default "--moe-strategy gpu -b 2048";
# empty: none) runs the decode rows too: its step bounds each split row's.
# bench-bw runs first (1 s a figure; FT_STREAMS_BENCH_BW=0 skips it) for the fetch rule.
bench_streams() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    local cache=3888 ncmoe=31 tag=""
    pick_model
    if [ -n "${FT_PRESET:-}" ]; then
        read -r cache _ < <(python3 benches/moe_budget.py -m "$MODEL" --fraction 0.25)
        ncmoe=$(preset_ncmoe)
        tag=_${FT_PRESET}_${FT_ROUTING:-uniform}
    fi
    tag=$tag${FT_STREAMS_TAG:+_$FT_STREAMS_TAG}
    if [ "${FT_STREAMS_BENCH_BW:-1}" != 0 ]; then
        python3 -m freetoken bench-bw -m "$MODEL" --seconds 1 2>&1 | tee "$OUT/bench_bw$tag.md"
    fi
    local llama=(--llama-server "$FT_BUILD/bin/llama-server")
    if [ ! -x "$FT_BUILD/bin/llama-server" ]; then
        log "no llama-server in $FT_BUILD (FT_TOOLS=0): freetoken's rows only"
        llama=()
    fi
    python3 benches/bench_server_streams.py -m "$MODEL" "${llama[@]}" \
        --streams "${FT_STREAMS:-4,16,32}" -n 64 \
        --rounds "${FT_STREAMS_ROUNDS:-3}" --prompt-tokens "${FT_PROMPT_TOKENS:-4096}" \
        --prompt-streams "${FT_PROMPT_STREAMS:-4}" -t "$(nproc)" \
        "--freetoken-args=--moe-strategy hybrid --moe-cache-mib ${FT_CACHE_MIB:-$cache} -b 2048 ${FT_STREAMS_ARGS:-}" \
        "--llama-args=-ngl 99 -fa off" --ncmoe "${FT_STREAMS_NCMOE:-$ncmoe}" \
        "--resident-args=${FT_STREAMS_RESIDENT---moe-strategy gpu -b 2048}" \
        --json "$OUT/bench_streams$tag.json" 2>&1 | tee "$OUT/bench_streams$tag.log"
}

# Speculative decoding on preset_model's model with FT_NEXTN (default 1) MTP layers (the
# Qwen3.5-35B-A3B preset's; Gemma 4 has none), the expert cache at FT_FRACTION (0.25) of the
# expert bytes, synthetic acceptance rates FT_SPEC_RATES (0.8,0.6,0.4; as many draft tokens),
# FT_SPEC_TOKENS (128) tokens a run. First bench_speculative.py: freetoken bench hybrid
# without and with draft-mtp (tg, peak VRAM and RSS, drafted and accepted) and the verify
# step's time for 1 to n_max + 1 tokens on the GPU. Then bench_server_streams.py, one stream,
# FT_SPEC_ROUNDS (3) rounds in turn: freetoken serve hybrid with draft-mtp against
# llama-server -ngl 99 -fa off with the same speculative flags at each -ncmoe of FT_SPEC_NCMOE
# (default bench_hybrid's sweep about the same VRAM, moe_budget.py), each engine's drafted and
# accepted tokens beside. A failed first half does not stop the second. FT_SPEC_PARTS (default
# "bench server") runs one half alone, for a second call that finishes a cut one.
bench_spec() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    local model cache sweep n_max tag
    FT_NEXTN=${FT_NEXTN:-1} preset_model
    model=$PRESET_MODEL
    local fraction=${FT_FRACTION:-0.25} rates=${FT_SPEC_RATES:-0.8,0.6,0.4}
    local n=${FT_SPEC_TOKENS:-128}
    read -r cache sweep < <(python3 benches/moe_budget.py -m "$model" --fraction "$fraction")
    n_max=$(awk -F, '{print NF}' <<<"$rates")
    local spec="--spec-type draft-mtp --spec-draft-n-max $n_max --spec-synth-rates $rates"
    tag=$(basename "$model" .gguf)_$fraction
    local parts=" ${FT_SPEC_PARTS:-bench server} "
    if [[ $parts == *" bench "* ]]; then
        python3 benches/bench_speculative.py -m "$model" --device cuda --moe-strategy hybrid \
            --moe-cache-mib "$cache" --rates "$rates" -n "$n" -r 3 \
            --json "$OUT/bench_spec_$tag.json" 2>&1 | tee "$OUT/bench_spec_$tag.log" ||
            log "bench_speculative.py failed (bench_spec_$tag.log)"
    fi
    [[ $parts == *" server "* ]] || return 0
    python3 benches/bench_server_streams.py -m "$model" \
        --llama-server "$FT_BUILD/bin/llama-server" --streams 1 -n "$n" \
        --rounds "${FT_SPEC_ROUNDS:-3}" --prompt-tokens 0 -t "$(nproc)" \
        "--freetoken-args=--moe-strategy hybrid --moe-cache-mib $cache $spec" \
        "--llama-args=-ngl 99 -fa off $spec" --ncmoe "${FT_SPEC_NCMOE:-$sweep}" \
        --json "$OUT/bench_spec_server_$tag.json" 2>&1 | tee "$OUT/bench_spec_server_$tag.log"
}

# The CPU expert executor's cost per one-token job on the benchmark model, mapped and read
# into memory, by threads ($FT_JOB_THREADS) and wait between jobs ($FT_JOB_GAPS, µs).
bench_jobs() {
    bench_model
    python3 benches/bench_moe_jobs.py -m "$BENCH_MODEL" -t "${FT_JOB_THREADS:-1,4,12}" \
        --gap-us "${FT_JOB_GAPS:-0,100}" --calls 300 --json "$OUT/bench_moe_jobs.json" 2>&1 |
        tee "$OUT/bench_moe_jobs.log"
}

# The executor's per-job cost with the main wheel ("base") and each wheel of $DEV/alt/NAME,
# $FT_AB_ROUNDS rounds (default 2) of every build in turn (the host drifts within a lease),
# at $FT_JOB_THREADS (default 12) threads and gaps $FT_JOB_GAPS (default 0,150).
bench_jobs_ab() {
    bench_model
    local builds=(base) name round
    for name in "$DEV"/alt/*/; do
        [ -d "$name" ] && builds+=("$(basename "$name")")
    done
    install_wheel /tmp/ft-site-base
    for name in "${builds[@]:1}"; do
        install_wheel "/tmp/ft-site-$name" "$(ls "$DEV/alt/$name"/freetoken-*.whl)" bare
    done
    for round in $(seq "${FT_AB_ROUNDS:-2}"); do
        for name in "${builds[@]}"; do
            log "$name, round $round"
            PYTHONPATH=/tmp/ft-site-$name python3 benches/bench_moe_jobs.py -m "$BENCH_MODEL" \
                -t "${FT_JOB_THREADS:-12}" --gap-us "${FT_JOB_GAPS:-0,150}" --calls 300 \
                --json "$OUT/jobs_${name}_$round.json" 2>&1 | tee -a "$OUT/bench_jobs_ab.log"
        done
    done
}

# Where a step's time goes (benches/profile_gpu_step.py) on the benchmark model, or with
# FT_PRESET set on preset_model's; FT_PROFILE_ARGS adds the script's flags (--batch 4,16 ...).
profile_step() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    local extra
    pick_model
    read -r -a extra <<<"${FT_PROFILE_ARGS:-}"
    python3 benches/profile_gpu_step.py -m "$MODEL" -p 512 "${extra[@]}" 2>&1 |
        tee "$OUT/profile${FT_PRESET:+_$FT_PRESET}.log"
}

# The served step from the inside: py-spy samples of every thread of freetoken serve
# (FT_SERVE_ARGS, default all experts resident: "--moe-strategy gpu -b 2048") while
# bench_server_streams.py drives FT_STREAMS (16) streams for 2 rounds, on the benchmark model
# or FT_PRESET's; benches/spy_summary.py's table of them beside (the share inside
# forward_batch against the scheduler's own work and the event loop's).
profile_serve() {
    [ -f "$FT_BUILD/libfreetoken_cuda.so" ] || build
    local tools=/tmp/ft-tools
    pick_model
    [ -x "$tools/bin/py-spy" ] ||
        python3 -m pip install -q --no-index --no-deps --target "$tools" "$DEV"/wheels/tools/py_spy-*.whl
    "$tools/bin/py-spy" record --subprocesses --threads --nonblocking -r 200 -f raw \
        -o "$OUT/serve_spy.txt" -- python3 benches/bench_server_streams.py -m "$MODEL" \
        --streams "${FT_STREAMS:-16}" -n 64 --rounds 2 --prompt-tokens 0 \
        "--freetoken-args=${FT_SERVE_ARGS:---moe-strategy gpu -b 2048}" --resident-args= \
        --json "$OUT/serve_spy_streams.json" 2>&1 | tail -8
    python3 benches/spy_summary.py "$OUT/serve_spy.txt" --inside forward_batch \
        --inside Scheduler._step --top 25 | tee "$OUT/serve_spy.md"
}

[ $# -gt 0 ] || {
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
    exit 2
}
for phase in "$@"; do
    case $phase in
    prepare) prepare ;;
    prepare-alt) prepare_alt ;;
    build) build ;;
    test) run_tests ;;
    bench) bench ;;
    bench-model) bench_model ;;
    bench-models) bench_models ;;
    bench-e2e) bench_e2e ;;
    bench-hybrid) bench_hybrid ;;
    bench-preset) bench_preset ;;
    preset-model) preset_model ;;
    bench-streams) bench_streams ;;
    bench-spec) bench_spec ;;
    bench-jobs) bench_jobs ;;
    bench-jobs-ab) bench_jobs_ab ;;
    profile) profile_step ;;
    profile-serve) profile_serve ;;
    *)
        log "unknown phase $phase (prepare, prepare-alt, build, test, bench, bench-model," \
            "bench-e2e, bench-hybrid, bench-preset, preset-model, bench-streams, bench-spec," \
            "bench-jobs, bench-jobs-ab, profile, profile-serve)"
        exit 2
        ;;
    esac
done
