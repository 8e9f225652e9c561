"""The llama.cpp reference: a build of it, and a ctypes binding to its libllama.

llama.cpp is built once from the same pinned source tree as our ggml crate (the `vendor/llama.cpp`
tree of the PyPI sdist `llama-cpp-python==0.3.36`, unpacked by `ggml/build.rs`) with the same CPU
options, into `<cache>/llama-ref-<sdist sha[:16]>-<options hash>/` (`bin/`, `lib/`, `build/`),
under a file lock, with a marker file written last. `<cache>` is `$FREETOKEN_CACHE` or
`~/.cache/freetoken`.

Environment (the same semantics as `ggml/build.rs`):

- `FREETOKEN_LLAMA_SRC`: an unpacked llama.cpp tree to use instead of the cached sdist tree.
- `FREETOKEN_LLAMA_SDIST`: a local copy of the sdist, used if the tree must be unpacked.
- `FREETOKEN_CPU_BASELINE=1`: a portable AVX2/FMA/F16C build instead of `GGML_NATIVE=ON`.
- `FREETOKEN_GGML_CPU_OPTIONS="GGML_AVX512=ON;..."`: explicit ggml CPU options.

Python API: `LlamaRef.load(path, ...)` gives `.tokenize`, `.detokenize`, `.logits` (teacher-forced,
`[n_tokens, n_vocab]` float32), `.greedy` / `.greedy_with_logits`; `tokenize_cli` and
`completion_cli` run the built tools. Kernels: `plain` (the default; batch-invariant `vec_dot`
kernels) or `fast` (llama.cpp's repacked and tiled matmuls, as its tools use by default); see
`KERNELS`.

Usage: `python tools/llama_ref.py build` builds (if needed) and prints the install directory;
`python tools/llama_ref.py tokenize MODEL TEXT` and `python tools/llama_ref.py greedy MODEL TEXT N`
are small manual checks of the binding.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

SDIST_NAME = "llama_cpp_python-0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz"
)

#: Instruction sets of the portable baseline build (`FREETOKEN_CPU_BASELINE=1`).
BASELINE_OPTIONS = (
    "GGML_SSE42=ON",
    "GGML_AVX=ON",
    "GGML_AVX2=ON",
    "GGML_FMA=ON",
    "GGML_F16C=ON",
    "GGML_BMI2=ON",
)

#: The build targets: the shared libllama (which pulls in libggml*) and three tools.
TARGETS = ("llama", "llama-bench", "llama-tokenize", "llama-completion")
TOOLS = ("llama-bench", "llama-tokenize", "llama-completion")

#: Fixed cmake options: CPU only, shared libraries, no network, no optional dependencies, none
#: of the tests, examples, server, web UI or unified app.
FIXED_OPTIONS = (
    ("CMAKE_BUILD_TYPE", "Release"),
    ("BUILD_SHARED_LIBS", "ON"),
    ("GGML_BACKEND_DL", "OFF"),
    ("GGML_OPENMP", "OFF"),
    ("GGML_CCACHE", "OFF"),
    ("GGML_BLAS", "OFF"),
    ("GGML_METAL", "OFF"),
    ("GGML_CUDA", "OFF"),
    ("GGML_VULKAN", "OFF"),
    ("GGML_RPC", "OFF"),
    ("GGML_CPU_ALL_VARIANTS", "OFF"),
    ("GGML_BUILD_TESTS", "OFF"),
    ("GGML_BUILD_EXAMPLES", "OFF"),
    ("LLAMA_BUILD_COMMON", "ON"),
    ("LLAMA_BUILD_TOOLS", "ON"),
    ("LLAMA_BUILD_TESTS", "OFF"),
    ("LLAMA_BUILD_EXAMPLES", "OFF"),
    ("LLAMA_BUILD_SERVER", "OFF"),
    ("LLAMA_BUILD_APP", "OFF"),
    ("LLAMA_BUILD_UI", "OFF"),
    ("LLAMA_USE_PREBUILT_UI", "OFF"),
    ("LLAMA_BUILD_MTMD", "OFF"),
    ("LLAMA_OPENSSL", "OFF"),
    ("LLAMA_LLGUIDANCE", "OFF"),
    ("LLAMA_CURL", "OFF"),
    ("LLAMA_TOOLS_INSTALL", "OFF"),
    # The tools find libllama in `lib/` next to `bin/`, and in `build/bin/`.
    ("CMAKE_BUILD_RPATH", "$ORIGIN;$ORIGIN/../lib"),
)

#: Bumped whenever the build recipe changes in a way the marker's configure line does not show.
RECIPE_VERSION = 2

MARKER = ".freetoken-complete"


def log(msg: str) -> None:
    """Prints a progress line to stderr (stdout of `build` is the install directory only)."""
    print(f"llama_ref: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Source tree and CPU options
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The FreeToken cache directory: `$FREETOKEN_CACHE` or `~/.cache/freetoken`."""
    env = os.environ.get("FREETOKEN_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "freetoken"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on `path` (created if missing) for the duration of the block.

    `ggml/build.rs` locks with Rust's `File::lock`, which is `flock` too, so the two cooperate.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_sdist(cache: Path) -> Path:
    """The sdist, hash-checked: `$FREETOKEN_LLAMA_SDIST`, a cached download, or a fresh one."""
    env = os.environ.get("FREETOKEN_LLAMA_SDIST")
    if env:
        path = Path(env)
    else:
        path = cache / "downloads" / f"{SDIST_NAME}.tar.gz"
        if not path.is_file() or _sha256_file(path) != SDIST_SHA256:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            log(f"downloading {SDIST_URL}")
            with urllib.request.urlopen(SDIST_URL, timeout=120) as r, open(part, "wb") as f:
                shutil.copyfileobj(r, f)
            part.replace(path)
    got = _sha256_file(path)
    if got != SDIST_SHA256:
        raise RuntimeError(f"{path} has sha256 {got}, expected {SDIST_SHA256}")
    return path


def _unpack_vendor_tree(sdist: Path, tree: Path) -> None:
    """Unpacks `<sdist>/vendor/llama.cpp/` into `tree` through a temporary sibling directory."""
    prefix = f"{SDIST_NAME}/vendor/llama.cpp/"
    tmp = tree.with_name(tree.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix) :]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    if tree.exists():
        shutil.rmtree(tree)
    tmp.rename(tree)


def llama_source() -> Path:
    """The llama.cpp source tree: `$FREETOKEN_LLAMA_SRC`, or the sdist tree in the cache.

    The cached tree is normally unpacked by `ggml/build.rs`; if it is missing it is unpacked here
    the same way (same lock file, same marker).
    """
    env = os.environ.get("FREETOKEN_LLAMA_SRC")
    if env:
        src = Path(env)
        if not (src / "ggml" / "CMakeLists.txt").is_file():
            raise RuntimeError(
                f"FREETOKEN_LLAMA_SRC={src} is not a llama.cpp tree (no ggml/CMakeLists.txt)"
            )
        return src
    cache = cache_dir()
    tree = cache / f"llama.cpp-{SDIST_SHA256}"
    done = tree / MARKER
    if done.is_file():
        return tree
    with file_lock(cache / f"llama.cpp-{SDIST_SHA256}.lock"):
        if not done.is_file():
            log(f"unpacking the llama.cpp tree into {tree}")
            _unpack_vendor_tree(_fetch_sdist(cache), tree)
            done.touch()
    return tree


def cpu_options(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The ggml CPU options as `(NAME, VALUE)` pairs, as `ggml/build.rs` computes them.

    `FREETOKEN_GGML_CPU_OPTIONS` (items separated by `;`, `,` or spaces) gives `GGML_NATIVE=OFF`
    plus those items; else `FREETOKEN_CPU_BASELINE=1` gives `GGML_NATIVE=OFF` plus the baseline
    set; else `GGML_NATIVE=ON`.
    """
    env = os.environ if env is None else env
    explicit = env.get("FREETOKEN_GGML_CPU_OPTIONS", "")
    baseline = env.get("FREETOKEN_CPU_BASELINE") == "1"
    if explicit.strip():
        items = [s for s in re.split(r"[; ,]", explicit) if s]
    elif baseline:
        items = list(BASELINE_OPTIONS)
    else:
        return [("GGML_NATIVE", "ON")]
    opts = [("GGML_NATIVE", "OFF")]
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"FREETOKEN_GGML_CPU_OPTIONS: `{item}` is not NAME=VALUE")
        opts.append((name, value))
    return opts


def _host_cpu_flags() -> str:
    """The host's CPU feature flags (a native build is only valid on a CPU that has them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def options_key(opts: Sequence[tuple[str, str]]) -> str:
    """A short hash of the CPU options (and, for a native build, of the host CPU's flags)."""
    text = ";".join(f"{k}={v}" for k, v in opts)
    if ("GGML_NATIVE", "ON") in opts:
        text += "|" + _host_cpu_flags()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def install_dir(src: Path | None = None, opts: Sequence[tuple[str, str]] | None = None) -> Path:
    """Where the reference for this source tree and these CPU options is (or will be) built."""
    src = llama_source() if src is None else src
    opts = cpu_options() if opts is None else opts
    if os.environ.get("FREETOKEN_LLAMA_SRC"):
        tag = "src" + hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:13]
    else:
        tag = SDIST_SHA256[:16]
    return cache_dir() / f"llama-ref-{tag}-{options_key(opts)}"


def _configure_command(src: Path, build: Path, opts: Sequence[tuple[str, str]]) -> list[str]:
    cmd = ["cmake", "-S", str(src), "-B", str(build)]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    else:
        cmd += ["-G", "Unix Makefiles"]
    for name, value in (*FIXED_OPTIONS, *opts):
        cmd.append(f"-D{name}={value}")
    return cmd


def _run(cmd: list[str], log_path: Path) -> None:
    log("$ " + " ".join(cmd))
    with open(log_path, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        last = 0.0
        for line in proc.stdout:
            f.write(line)
            # Ninja / make progress lines, at most one every 15 s, keep CI logs alive but short.
            now = time.monotonic()
            if line.startswith(b"[") and now - last > 15:
                last = now
                log(line.decode(errors="replace").rstrip()[:120])
        rc = proc.wait()
    if rc != 0:
        with open(log_path, "rb") as f:
            tail = f.read()[-6000:].decode(errors="replace")
        raise RuntimeError(f"command failed ({rc}): {' '.join(cmd)}\n{tail}\n(log: {log_path})")


def build(jobs: int = 2, force: bool = False) -> Path:
    """Builds the reference once (if not built yet) and returns its install directory.

    The directory holds `bin/` (the tools), `lib/` (libllama and libggml*), `build/` (the cmake
    build tree), `build.log`, and the marker file, written last, with the configure command.
    Concurrent callers serialize on a lock file next to the directory.
    """
    src = llama_source()
    opts = cpu_options()
    root = install_dir(src, opts)
    marker = root / MARKER
    build_dir = root / "build"
    configure = _configure_command(src, build_dir, opts)
    stamp = f"recipe {RECIPE_VERSION}\n{' '.join(configure)}\n"

    def is_done() -> bool:
        return not force and marker.is_file() and marker.read_text().startswith(stamp)

    if is_done():
        return root
    with file_lock(root.with_name(root.name + ".lock")):
        if is_done():
            return root
        if marker.exists():
            marker.unlink()
        root.mkdir(parents=True, exist_ok=True)
        log_path = root / "build.log"
        log_path.write_bytes(b"")
        log(f"building llama.cpp from {src} into {root} (log: {log_path})")
        t0 = time.monotonic()
        _run(configure, log_path)
        t1 = time.monotonic()
        _run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], log_path)
        t2 = time.monotonic()
        _install_layout(build_dir / "bin", root)
        _probe_layout(src, root)
        log(f"configure {t1 - t0:.0f} s, build {t2 - t1:.0f} s")
        marker.write_text(stamp + f"configure_s {t1 - t0:.1f}\nbuild_s {t2 - t1:.1f}\n")
    return root


def tool_path(name: str) -> Path:
    """The path of a built tool (`llama-bench`, `llama-tokenize`, `llama-completion`)."""
    if name not in TOOLS:
        raise ValueError(f"{name} is not one of the built tools {TOOLS}")
    return build() / "bin" / name


def _install_layout(out: Path, root: Path) -> None:
    """Copies the tools into `root/bin` and the shared libraries (symlinks kept) into `root/lib`."""
    bin_dir, lib_dir = root / "bin", root / "lib"
    for d in (bin_dir, lib_dir):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
    for tool in TOOLS:
        shutil.copy2(out / tool, bin_dir / tool)
    for lib in sorted(out.glob("lib*.so*")):
        shutil.copy2(lib, lib_dir / lib.name, follow_symlinks=False)
    if not (lib_dir / "libllama.so").exists():
        raise RuntimeError(f"no libllama.so in {out}")


# --------------------------------------------------------------------------------------------
# ctypes binding to libllama
# --------------------------------------------------------------------------------------------

_c_token_p = ctypes.POINTER(ctypes.c_int32)


class LlamaModelParams(ctypes.Structure):
    """`struct llama_model_params` of `include/llama.h`, field for field."""

    _fields_ = [
        ("devices", ctypes.c_void_p),
        ("tensor_buft_overrides", ctypes.c_void_p),
        ("n_gpu_layers", ctypes.c_int32),
        ("split_mode", ctypes.c_int),
        ("load_mode", ctypes.c_int),
        ("lazy_mode", ctypes.c_int),
        ("main_gpu", ctypes.c_int32),
        ("tensor_split", ctypes.c_void_p),
        ("progress_callback", ctypes.c_void_p),
        ("progress_callback_user_data", ctypes.c_void_p),
        ("kv_overrides", ctypes.c_void_p),
        ("vocab_only", ctypes.c_bool),
        ("check_tensors", ctypes.c_bool),
        ("use_extra_bufts", ctypes.c_bool),
        ("no_host", ctypes.c_bool),
        ("no_alloc", ctypes.c_bool),
        ("load_mtp", ctypes.c_bool),
    ]


class LlamaContextParams(ctypes.Structure):
    """`struct llama_context_params` of `include/llama.h`, field for field."""

    _fields_ = [
        ("n_ctx", ctypes.c_uint32),
        ("n_batch", ctypes.c_uint32),
        ("n_ubatch", ctypes.c_uint32),
        ("n_seq_max", ctypes.c_uint32),
        ("n_rs_seq", ctypes.c_uint32),
        ("n_outputs_max", ctypes.c_uint32),
        ("n_outputs_max_per_seq", ctypes.c_uint32),
        ("n_threads", ctypes.c_int32),
        ("n_threads_batch", ctypes.c_int32),
        ("ctx_type", ctypes.c_int),
        ("rope_scaling_type", ctypes.c_int),
        ("pooling_type", ctypes.c_int),
        ("attention_type", ctypes.c_int),
        ("flash_attn_type", ctypes.c_int),
        ("rope_freq_base", ctypes.c_float),
        ("rope_freq_scale", ctypes.c_float),
        ("yarn_ext_factor", ctypes.c_float),
        ("yarn_attn_factor", ctypes.c_float),
        ("yarn_beta_fast", ctypes.c_float),
        ("yarn_beta_slow", ctypes.c_float),
        ("yarn_orig_ctx", ctypes.c_uint32),
        ("defrag_thold", ctypes.c_float),
        ("cb_eval", ctypes.c_void_p),
        ("cb_eval_user_data", ctypes.c_void_p),
        ("type_k", ctypes.c_int),
        ("type_v", ctypes.c_int),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("embeddings", ctypes.c_bool),
        ("offload_kqv", ctypes.c_bool),
        ("no_perf", ctypes.c_bool),
        ("op_offload", ctypes.c_bool),
        ("swa_full", ctypes.c_bool),
        ("kv_unified", ctypes.c_bool),
        ("samplers", ctypes.c_void_p),
        ("n_samplers", ctypes.c_size_t),
        ("ctx_other", ctypes.c_void_p),
    ]


class LlamaBatch(ctypes.Structure):
    """`struct llama_batch` of `include/llama.h`, field for field."""

    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("token", _c_token_p),
        ("embd", ctypes.POINTER(ctypes.c_float)),
        ("pos", ctypes.POINTER(ctypes.c_int32)),
        ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
        ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
        ("logits", ctypes.POINTER(ctypes.c_int8)),
    ]


#: The C structs mirrored here, by their C name; their layout is checked against the header.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "llama_model_params": LlamaModelParams,
    "llama_context_params": LlamaContextParams,
    "llama_batch": LlamaBatch,
}

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}

#: Kernel choices, as `(repack, tiled)`. `plain` (the default here): every matmul goes through
#: the type traits' `vec_dot` row kernels (the ones FreeToken calls) whatever the batch size, so
#: logits do not depend on batching: teacher-forced rows equal the incremental ones bitwise.
#: `fast` is llama.cpp as its tools run by default: weights repacked into ggml's interleaved CPU
#: layouts (GEMM kernels from 4 rows) and the tiled K-quant matmul (from 8 rows); its logits
#: differ from `plain` and between batch sizes (on Gemma 3 270M Q4_K_M, mean KL ~0.004).
KERNELS = {"plain": (False, False), "fast": (True, True)}

#: ggml-cpu reads this once per process, at the first matmul that could take the tiled path.
TILED_ENV = "GGML_CPU_TILED_MM"
_tiled_in_process: bool | None = None


def _fix_tiled(tiled: bool) -> None:
    """Sets `GGML_CPU_TILED_MM` for this process, once: ggml-cpu caches it at first use."""
    global _tiled_in_process
    if _tiled_in_process is None:
        os.environ[TILED_ENV] = "1" if tiled else "0"
        _tiled_in_process = tiled
    elif _tiled_in_process != tiled:
        raise RuntimeError(
            f"this process already runs llama.cpp with {TILED_ENV}={int(_tiled_in_process)}; "
            "ggml-cpu reads it once per process, so `plain` and `fast` kernels cannot mix"
        )


def tool_env(kernels: str = "plain") -> dict[str, str]:
    """The environment for running a llama.cpp tool with the given `KERNELS` choice (the tool
    also needs `--repack 0|1` (llama-bench) or `--repack`/`--no-repack` (llama-completion))."""
    env = dict(os.environ)
    env[TILED_ENV] = "1" if KERNELS[kernels][1] else "0"
    return env


GGML_LOG_LEVEL_ERROR = 4
LLAMA_LOAD_MODE_MMAP = 1

_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _probe_layout(src: Path, root: Path) -> None:
    """Compiles a small C program against `include/llama.h` that prints the size and field offsets
    of every struct in `STRUCTS`, and saves its output as `root/layout.txt`."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "llama.h"', "int main(void) {"]
    for cname, cls in STRUCTS.items():
        lines.append(f'  printf("{cname} sizeof %zu\\n", sizeof(struct {cname}));')
        for field, *_ in cls._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof(struct {cname}, {field}));')
    lines += ["  return 0;", "}"]
    probe_dir = root / "build" / "layout-probe"
    probe_dir.mkdir(parents=True, exist_ok=True)
    (probe_dir / "probe.c").write_text("\n".join(lines) + "\n")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    exe = probe_dir / "probe"
    includes = ["-I", str(src / "include"), "-I", str(src / "ggml" / "include")]
    subprocess.run(
        [cc, *includes, "probe.c", "-o", "probe"],
        cwd=probe_dir,
        check=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    (root / "layout.txt").write_text(out)


def check_layout(root: Path) -> None:
    """Checks the ctypes structs against the C layout recorded at build time (`layout.txt`).

    Raises RuntimeError on any difference in struct size or field offset.
    """
    want: dict[tuple[str, str], int] = {}
    for line in (root / "layout.txt").read_text().splitlines():
        cname, field, value = line.split()
        want[cname, field] = int(value)
    errors = []
    for cname, cls in STRUCTS.items():
        got = {"sizeof": ctypes.sizeof(cls)}
        got.update({f: getattr(cls, f).offset for f, *_ in cls._fields_})
        for field, value in got.items():
            if want.get((cname, field)) != value:
                errors.append(f"{cname}.{field}: ctypes {value}, C {want.get((cname, field))}")
    if errors:
        raise RuntimeError("ctypes struct layout differs from llama.h: " + "; ".join(errors))


class _Lib:
    """libllama loaded through ctypes, with the signatures of the functions used here."""

    def __init__(self, root: Path, quiet: bool) -> None:
        check_layout(root)
        self.root = root
        lib = ctypes.CDLL(str(root / "lib" / "libllama.so"))
        vp, i32, b = ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool
        sig = {
            "llama_backend_init": (None, []),
            "llama_log_set": (None, [_LOG_CALLBACK, vp]),
            "llama_model_default_params": (LlamaModelParams, []),
            "llama_context_default_params": (LlamaContextParams, []),
            "llama_model_load_from_file": (vp, [ctypes.c_char_p, LlamaModelParams]),
            "llama_model_free": (None, [vp]),
            "llama_init_from_model": (vp, [vp, LlamaContextParams]),
            "llama_free": (None, [vp]),
            "llama_model_get_vocab": (vp, [vp]),
            "llama_vocab_n_tokens": (i32, [vp]),
            "llama_vocab_is_eog": (b, [vp, i32]),
            "llama_vocab_bos": (i32, [vp]),
            "llama_vocab_eos": (i32, [vp]),
            "llama_n_ctx": (ctypes.c_uint32, [vp]),
            "llama_get_memory": (vp, [vp]),
            "llama_memory_clear": (None, [vp, b]),
            "llama_decode": (i32, [vp, LlamaBatch]),
            "llama_get_logits": (ctypes.POINTER(ctypes.c_float), [vp]),
            "llama_get_logits_ith": (ctypes.POINTER(ctypes.c_float), [vp, i32]),
            "llama_tokenize": (i32, [vp, ctypes.c_char_p, i32, _c_token_p, i32, b, b]),
            "llama_token_to_piece": (i32, [vp, i32, ctypes.c_char_p, i32, i32, b]),
            "llama_print_system_info": (ctypes.c_char_p, []),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        self.lib = lib

        def on_log(level: int, text: bytes | None, _user: int | None) -> None:
            if text and (not quiet or level == GGML_LOG_LEVEL_ERROR):
                sys.stderr.write(text.decode(errors="replace"))

        # Kept alive as long as the library: libllama calls it from any thread.
        self._log_cb = _LOG_CALLBACK(on_log)
        self.llama_log_set(self._log_cb, None)
        self.llama_backend_init()
        self._sanity_check_defaults()

    def detach_logger(self) -> None:
        """Restores llama.cpp's own logger, so that no log line reaches Python at exit."""
        self.llama_log_set(_LOG_CALLBACK(), None)

    def _sanity_check_defaults(self) -> None:
        """Known defaults of `llama.cpp` 0c1e570, a second check that the structs line up."""
        mp = self.llama_model_default_params()
        cp = self.llama_context_default_params()
        ok = (
            mp.n_gpu_layers == -1
            and mp.main_gpu == 0
            and not mp.vocab_only
            and mp.use_extra_bufts
            and cp.n_batch == 2048
            and cp.n_ubatch == 512
            and cp.n_seq_max == 1
            and cp.flash_attn_type == FLASH_ATTN["auto"]
            and cp.type_k == 1  # GGML_TYPE_F16
            and cp.type_v == 1
            and cp.offload_kqv
            and cp.ctx_other is None
        )
        if not ok:
            raise RuntimeError("libllama default params do not look like llama.cpp 0c1e570's")


_LIB: _Lib | None = None


def load_library(root: Path | None = None, quiet: bool = True) -> _Lib:
    """Loads libllama from `root` (default: `build()`, which builds it if needed), once per
    process (its logger and backends are process-global); `quiet` drops all but error logs."""
    global _LIB
    root = build() if root is None else Path(root)
    if _LIB is None:
        _LIB = _Lib(root, quiet)
        atexit.register(_LIB.detach_logger)
    elif _LIB.root != root:
        raise RuntimeError(f"libllama is already loaded from {_LIB.root}, not {root}")
    return _LIB


class LlamaRef:
    """A GGUF model loaded in llama.cpp (CPU only, mmap) with one context, for reference outputs.

    Every call that evaluates tokens starts from an empty KV cache, at position 0.
    """

    def __init__(self, lib: _Lib, model: int, ctx: int | None, n_batch: int) -> None:
        self._lib = lib
        self._model: int | None = model
        self._ctx = ctx
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self._vocab)
        self.n_ctx: int = lib.llama_n_ctx(ctx) if ctx else 0
        self.n_batch = n_batch

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_threads: int | None = None,
        flash_attn: str = "auto",
        vocab_only: bool = False,
        kernels: str = "plain",
        quiet: bool = True,
        root: Path | None = None,
    ) -> LlamaRef:
        """Loads a GGUF model and creates a context.

        `n_threads` defaults to the number of CPUs; `flash_attn` is `auto` (llama.cpp's default),
        `on` or `off`; `vocab_only` loads just the tokenizer (no context: only `tokenize` and
        `detokenize` work); `kernels` is `plain` or `fast` (see `KERNELS`; one choice per process,
        since ggml reads its switch once). `root` is the reference install directory (default:
        `build()`).
        """
        lib = load_library(root, quiet)
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.load_mode = LLAMA_LOAD_MODE_MMAP
        mp.vocab_only = vocab_only
        repack, tiled = KERNELS[kernels]
        mp.use_extra_bufts = repack
        if not vocab_only:
            _fix_tiled(tiled)
        model = lib.llama_model_load_from_file(os.fsencode(path), mp)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        if vocab_only:
            return cls(lib, model, None, n_batch)
        cp = lib.llama_context_default_params()
        threads = n_threads or os.cpu_count() or 1
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_batch, cp.n_ubatch)
        cp.n_outputs_max = 0  # = n_batch: every token of a batch may output logits
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.flash_attn_type = FLASH_ATTN[flash_attn]
        cp.no_perf = True
        ctx = lib.llama_init_from_model(model, cp)
        if not ctx:
            lib.llama_model_free(model)
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        return cls(lib, model, ctx, n_batch)

    def close(self) -> None:
        """Frees the context and the model (idempotent)."""
        if self._ctx:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaRef:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # Tokenizer ------------------------------------------------------------------------------

    def tokenize(
        self, text: str | bytes, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text` by `llama_tokenize` (`add_special`: BOS/EOS as the model asks;
        `parse_special`: special tokens written in the text are parsed as such)."""
        data = text.encode() if isinstance(text, str) else text
        cap = len(data) + 16
        while True:
            buf = (ctypes.c_int32 * cap)()
            n = self._lib.llama_tokenize(
                self._vocab, data, len(data), buf, cap, add_special, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            if n == -(2**31):
                raise OverflowError("tokenization overflows int32")
            cap = -n

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token by `llama_token_to_piece` (`special`: render control tokens)."""
        cap = 64
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, cap, 0, special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """The text of `tokens`: their pieces concatenated (as llama-completion prints them)."""
        return b"".join(self.token_bytes(t, special) for t in tokens).decode(errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether `token` ends generation (EOS, EOT, ...)."""
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    # Evaluation -----------------------------------------------------------------------------

    def _need_ctx(self) -> int:
        if not self._ctx:
            raise RuntimeError("no context (closed, or loaded with vocab_only=True)")
        return self._ctx

    def _reset(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._need_ctx()), True)

    def _decode(self, tokens: Sequence[int], pos0: int, outputs: np.ndarray) -> None:
        """Decodes `tokens` at positions `pos0...` in sequence 0 (one `llama_decode` call)."""
        n = len(tokens)
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        n_seq = np.ones(n, dtype=np.int32)
        seq0 = ctypes.c_int32(0)
        seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(*([ctypes.pointer(seq0)] * n))
        out = np.ascontiguousarray(outputs, dtype=np.int8)
        batch = LlamaBatch(
            n_tokens=n,
            token=tok.ctypes.data_as(_c_token_p),
            embd=None,
            pos=pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            n_seq_id=n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=seq_ptrs,
            logits=out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        rc = self._lib.llama_decode(self._need_ctx(), batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) on {n} tokens at position {pos0}")

    def _check_len(self, n: int) -> None:
        if n == 0:
            raise ValueError("no tokens")
        if n > self.n_ctx:
            raise ValueError(f"{n} tokens do not fit in the context ({self.n_ctx})")

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits: float32 `[len(tokens), n_vocab]`, row i the logits after
        `tokens[: i + 1]`, evaluated from an empty cache in batches of `n_batch`."""
        self._check_len(len(tokens))
        self._reset()
        rows = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self._decode(chunk, start, np.ones(len(chunk), dtype=np.int8))
            ptr = self._lib.llama_get_logits(self._need_ctx())
            rows.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_vocab)).copy())
        return np.concatenate(rows, axis=0)

    def _last_logits(self) -> np.ndarray:
        ptr = self._lib.llama_get_logits_ith(self._need_ctx(), -1)
        if not ptr:
            raise RuntimeError("llama_get_logits_ith returned NULL")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def greedy(self, tokens: Sequence[int], n: int, stop_at_eog: bool = False) -> list[int]:
        """Greedy continuation: the prompt `tokens` evaluated from an empty cache, then `n` tokens,
        each the argmax (lowest id on ties) of the last logits, fed back one at a time.

        With `stop_at_eog`, stops after an end-of-generation token (which is included).
        """
        return self.greedy_with_logits(tokens, n, stop_at_eog)[0]

    def greedy_with_logits(
        self, tokens: Sequence[int], n: int, stop_at_eog: bool = False
    ) -> tuple[list[int], np.ndarray]:
        """`greedy`, and the logits each token was chosen from: float32 `[len(ids), n_vocab]`.

        These are the incremental (one token per `llama_decode`) logits; teacher-forced `logits`
        of the same sequence differ slightly (other kernels and summation order for a batch).
        """
        self._check_len(len(tokens) + max(n - 1, 0))
        self._reset()
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            out = np.zeros(len(chunk), dtype=np.int8)
            if start + len(chunk) == len(tokens):
                out[-1] = 1
            self._decode(chunk, start, out)
        generated: list[int] = []
        rows: list[np.ndarray] = []
        pos = len(tokens)
        while len(generated) < n:
            rows.append(self._last_logits())
            tok = int(np.argmax(rows[-1]))
            generated.append(tok)
            if (stop_at_eog and self.is_eog(tok)) or len(generated) == n:
                break
            self._decode([tok], pos, np.ones(1, dtype=np.int8))
            pos += 1
        logits = np.stack(rows) if rows else np.zeros((0, self.n_vocab), np.float32)
        return generated, logits


# --------------------------------------------------------------------------------------------
# The tools
# --------------------------------------------------------------------------------------------


def tokenize_cli(
    model: str | os.PathLike[str],
    text: str | bytes,
    add_special: bool = True,
    parse_special: bool = True,
) -> list[int]:
    """Token ids of `text` by the `llama-tokenize` tool (text passed verbatim through a file).

    `add_special=False` passes `--no-bos`; note that the tool adds only BOS (when the model asks
    for it), never EOS. `parse_special=False` passes `--no-parse-special`.
    """
    import tempfile

    data = text.encode() if isinstance(text, str) else text
    with tempfile.NamedTemporaryFile(prefix="llama-ref-", suffix=".txt") as f:
        f.write(data)
        f.flush()
        cmd = [str(tool_path("llama-tokenize")), "-m", os.fspath(model), "-f", f.name]
        cmd += ["--ids", "--no-escape", "--log-disable"]
        if not add_special:
            cmd.append("--no-bos")
        if not parse_special:
            cmd.append("--no-parse-special")
        res = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, check=False)
    if res.returncode != 0:
        raise RuntimeError(
            f"llama-tokenize failed ({res.returncode}): {res.stderr.decode()[-2000:]}"
        )
    lines = [ln for ln in res.stdout.decode().splitlines() if ln.startswith("[")]
    if not lines:
        raise RuntimeError(f"no id list in llama-tokenize output: {res.stdout!r}")
    body = lines[-1].strip()[1:-1]
    return [int(x) for x in body.split(",")] if body.strip() else []


def completion_cli(
    model: str | os.PathLike[str],
    prompt: str,
    n: int,
    n_ctx: int = 4096,
    n_threads: int | None = None,
    flash_attn: str = "auto",
    seed: int = 42,
    kernels: str = "plain",
) -> str:
    """The text `llama-completion` generates for `prompt` with greedy sampling (`--temp 0`),
    at most `n` tokens, without chat template, prompt echo or escape processing; `kernels` as in
    `LlamaRef.load`."""
    threads = n_threads or os.cpu_count() or 1
    cmd = [str(tool_path("llama-completion")), "-m", os.fspath(model), "-p", prompt]
    cmd += ["-n", str(n), "--temp", "0", "--seed", str(seed), "-c", str(n_ctx)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-fa", flash_attn]
    cmd += ["-no-cnv", "--no-display-prompt", "--no-escape", "--simple-io", "-ngl", "0"]
    cmd.append("--repack" if KERNELS[kernels][0] else "--no-repack")
    res = subprocess.run(
        cmd, capture_output=True, stdin=subprocess.DEVNULL, env=tool_env(kernels), check=False
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"llama-completion failed ({res.returncode}): {res.stderr.decode()[-2000:]}"
        )
    out = res.stdout.decode(errors="replace")
    # The tool ends with "\n\n", after " [end of text]\n" when it stopped at an EOG token.
    out = out.removesuffix("\n\n").removesuffix(" [end of text]\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `build` | `tokenize MODEL TEXT` | `greedy MODEL TEXT N`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["build"] and len(args) == 1:
        t0 = time.monotonic()
        root = build()
        log(f"ready in {time.monotonic() - t0:.0f} s")
        print(root)
        return 0
    if args[:1] == ["tokenize"] and len(args) == 3:
        with LlamaRef.load(args[1], vocab_only=True) as ref:
            print(ref.tokenize(args[2]))
        print(tokenize_cli(args[1], args[2]))
        return 0
    if args[:1] == ["greedy"] and len(args) == 4:
        with LlamaRef.load(args[1]) as ref:
            ids = ref.greedy(ref.tokenize(args[2]), int(args[3]))
            print(ids)
            print(repr(ref.detokenize(ids)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
