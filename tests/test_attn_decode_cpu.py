"""The split-K decode attention of ``cuda/src/attn_decode.cuh`` run on the CPU: g++ compiles
its kernels with the CUDA emulation of ``tests/cuda_cpu/cuda_emu.h`` (a std::thread per CUDA
thread, barriers, warp shuffles, NaN-filled shared memory, workspace and output) and a driver
that launches them as the shim does; each case's output is compared with a float64 torch
attention (``tests/attn_reference.py``), and its split with the chunk length the case is
built around. Skipped without g++."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attn_reference import CASES, AttnCase, attn_inputs, attn_reference, min_chunk  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: SMs the plan is made for: enough blocks per group that every case's chunks are at their
#: shortest (the chunk length ``min_chunk`` names).
N_SM = 64


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The emulation driver, built once per module."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++")
    exe = tmp_path_factory.mktemp("attn_emu") / "attn_decode_driver"
    subprocess.run(
        [
            gxx,
            "-std=c++20",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unknown-pragmas",  # CUDA's unroll hints
            "-pthread",
            "-I",
            str(ROOT / "cuda" / "include"),
            str(ROOT / "tests" / "cuda_cpu" / "attn_decode_driver.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    return exe


def _write(t: torch.Tensor, path: Path) -> None:
    """The whole buffer under the view ``t`` (which starts it), as float32."""
    assert t.storage_offset() == 0
    torch.empty(0).set_(t.untyped_storage()).numpy().tofile(path)


def _run(
    driver: Path, tmp: Path, case: AttnCase, v_transposed: bool, pos_dev: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """The driver's output and the reference for ``case``, and the driver's split."""
    q, k, v, sinks = attn_inputs(case, v_transposed)
    for name, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if t is not None:
            _write(t, tmp / name)
    scale = case.d**-0.5
    sizes = (case.heads, case.kv, case.d, case.dv, case.n_keys, k.stride(0))
    args = [*sizes, v.stride(0), v.stride(2), case.window, case.pos, scale]
    args += [int(sinks is not None), int(pos_dev), N_SM]
    done = subprocess.run(
        [str(driver), str(tmp), *map(str, args)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    words = done.stdout.split()
    plan = {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}
    got = torch.from_numpy(np.fromfile(tmp / "out", dtype=np.float32)).reshape(1, -1)
    want = attn_reference(q, k, v, case.pos, scale, case.window, sinks)
    return got, want, plan


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("v_transposed", [False, True])
def test_emulated_kernels_match_float64(
    driver: Path, tmp_path: Path, case: AttnCase, v_transposed: bool
) -> None:
    # The position through a pointer (a captured step's) with the transposed cache, which is
    # what captured steps read.
    got, want, plan = _run(driver, tmp_path, case, v_transposed, pos_dev=v_transposed)
    chunk = min(min_chunk(case.d, case.dv), -(-case.n_keys // 32) * 32)
    assert plan["chunk"] == chunk and plan["chunks"] == math.ceil(case.n_keys / chunk)
    assert got.shape == want.shape and not got.isnan().any()
    err = (got.double() - want).abs().max().item()
    assert err <= 2e-5 * max(want.abs().max().item(), 1.0), err
