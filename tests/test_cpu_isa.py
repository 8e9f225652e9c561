"""``FREETOKEN_CPU_ISA`` caps the CPU kernel level; ``freetoken --version`` names the level in
use, and a cap that is unknown, or that this host cannot run, is one line (``freetoken info``)
and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _host_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (the reference for the level)."""
    text = Path("/proc/cpuinfo").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _host_level() -> str:
    flags = _host_flags()
    if {"avx2", "fma", "f16c"} <= flags:
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            return "avx512"
        return "avx2"
    return "generic"


def _cli(cap: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FREETOKEN_CPU_ISA"}
    if cap is not None:
        env["FREETOKEN_CPU_ISA"] = cap
    cmd = [sys.executable, "-m", "freetoken", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


pytestmark = pytest.mark.skipif(
    not Path("/proc/cpuinfo").is_file() or os.uname().machine != "x86_64",
    reason="the levels are x86-64 instruction sets, read from /proc/cpuinfo",
)


def test_version_names_the_best_level_uncapped_and_the_cap_when_set() -> None:
    out = _cli(None, "--version")
    assert out.returncode == 0, out.stderr
    assert f"\nCPU: kernels {_host_level()}, " in out.stdout, out.stdout
    levels = ["generic", "avx2", "avx512"]
    for cap in levels[: levels.index(_host_level()) + 1]:
        out = _cli(cap.upper(), "--version")
        assert out.returncode == 0, out.stderr
        assert f"\nCPU: kernels {cap}, " in out.stdout, out.stdout


@pytest.mark.parametrize("cap", ["sse9", "avx-512", "AVX2;avx512"])
def test_unknown_cap_is_one_line_and_exit_2(cap: str) -> None:
    out = _cli(cap, "info")
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: FREETOKEN_CPU_ISA={cap}: not a CPU kernel level"), (
        out.stderr
    )


def test_cap_above_the_host_is_one_line_and_exit_2() -> None:
    if _host_level() == "avx512":
        pytest.skip("this host runs every level")
    out = _cli("avx512", "info")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1, out.stderr
    assert "this host cannot run it" in out.stderr, out.stderr


def test_bad_cap_reaches_the_products_as_a_freetoken_error() -> None:
    """Outside the CLI: the first quantized product raises the error, never a crash."""
    code = (
        "import numpy as np\n"
        "from freetoken import quant\n"
        "from freetoken.errors import InvalidInputError\n"
        "w = quant.QuantMatrix(quant.quantize(np.ones((4, 32), np.float32), 'q8_0'),"
        " 'q8_0', (4, 32))\n"
        "try:\n"
        "    w.matmul(np.ones((1, 32), np.float32))\n"
        "except InvalidInputError as e:\n"
        "    print('raised', e)\n"
    )
    env = dict(os.environ, FREETOKEN_CPU_ISA="sse9")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised FREETOKEN_CPU_ISA=sse9: not a CPU kernel level"), (
        out.stdout
    )
