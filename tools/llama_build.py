"""Building the llama.cpp reference: the CPU options (as `ggml/build.rs` computes them), one
cmake build per source and options into `<cache>/llama-ref-<sdist sha[:16]>-<options hash>/`
under a file lock, with a marker file written last."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from llama_source import MARKER, SDIST_SHA256, cache_dir, file_lock, llama_source, log
from llama_structs import probe_layout

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
        probe_layout(src, root)
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
