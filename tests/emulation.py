"""Builds a CPU emulation of kernels of ``cuda/src`` (``tests/cuda_cpu/``): g++ compiles a
driver that includes ``cuda_emulation.h`` and the kernels' header into a shared library for
ctypes."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_emulator(driver: str, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """``tests/cuda_cpu/<driver>`` built and loaded (the test skips without g++)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++ (C++20)")
    lib = tmp_path_factory.mktemp("emulated") / Path(driver).with_suffix(".so").name
    cmd = [gxx, "-std=c++20", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"]
    cmd += ["-shared", "-fPIC", "-pthread", f"-I{ROOT / 'cuda/include'}", f"-I{ROOT / 'cuda/src'}"]
    cmd += [str(ROOT / "tests/cuda_cpu" / driver), "-o", str(lib)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return ctypes.CDLL(str(lib))
