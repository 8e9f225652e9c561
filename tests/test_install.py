"""The install's GPU option and the GPU library's checks, as a user meets them: a request the
build cannot meet stops it with one line, and a library of another build gives one line at run
time (the CLI exits 2 only where the GPU was demanded), never a traceback or a crash."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cargo_env(target: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FREETOKEN_CUDA", "CUDA"))}
    # Only cargo's, Python's and the system's folders: no CUDA toolkit on PATH.
    cargo = shutil.which("cargo")
    assert cargo is not None
    dirs = [str(Path(cargo).parent), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
    env.update(PATH=os.pathsep.join(dirs), CARGO_TARGET_DIR=str(target), **extra)
    env.pop("CUDACXX", None)
    return env


@pytest.fixture(scope="module")
def cargo_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A target folder of its own: the requests below re-run ggml's build script, which must not
    # leave the workspace's build to be redone.
    return tmp_path_factory.mktemp("target")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"FREETOKEN_CUDA": "1"},
            "error: FREETOKEN_CUDA=1 needs the CUDA toolkit's compiler nvcc: none on PATH",
        ),
        (
            {"FREETOKEN_CUDA": "1", "FREETOKEN_CUDA_ARCHS": "sm_90"},
            "error: FREETOKEN_CUDA_ARCHS=sm_90: `sm_90` is not a CUDA architecture",
        ),
        (
            {"FREETOKEN_CUDA": "1", "FREETOKEN_CUDA_ARCHS": "86;9000"},
            "error: FREETOKEN_CUDA_ARCHS=86;9000: `9000` is not a CUDA architecture",
        ),
        ({"FREETOKEN_CUDA": "maybe"}, "error: FREETOKEN_CUDA=maybe: use 1"),
    ],
)
def test_gpu_request_the_build_cannot_meet_stops_it_in_one_line(
    cargo_target: Path, env: dict[str, str], line: str
) -> None:
    if Path("/usr/local/cuda/bin/nvcc").is_file() and "FREETOKEN_CUDA_ARCHS" not in env:
        pytest.skip("this machine has a CUDA toolkit at /usr/local/cuda")
    r = subprocess.run(
        ["cargo", "build", "-q", "-p", "freetoken-ggml"],
        cwd=ROOT,
        env=_cargo_env(cargo_target, **env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode != 0
    ours = [x.strip() for x in r.stderr.splitlines() if x.strip().startswith("error: FREETOKEN")]
    assert len(ours) == 1, r.stderr
    assert ours[0].startswith(line), r.stderr
    assert "panicked" not in r.stderr


@pytest.fixture(scope="module")
def other_abi_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared library that exports the ABI probe of another version, and nothing else."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("abi")
    (d / "other.c").write_text(
        "#include <stdint.h>\nuint32_t ft_cuda_abi_version(void) { return 999; }\n"
    )
    lib = d / "libfreetoken_cuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib, d / "other.c"], check=True)
    return lib


def _freetoken(lib: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FREETOKEN_CUDA_LIB=str(lib))
    return subprocess.run(
        [sys.executable, "-m", "freetoken", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_info_names_a_library_of_another_abi(other_abi_library: Path) -> None:
    r = _freetoken(other_abi_library, "info")
    assert r.returncode == 0, r.stderr
    gpu = [x for x in r.stdout.splitlines() if x.startswith("GPU:")]
    assert len(gpu) == 1
    assert "speaks C ABI 999, this build needs" in gpu[0]
    assert "Traceback" not in r.stderr


def test_generate_with_a_library_of_another_abi_runs_on_the_cpu(other_abi_library: Path) -> None:
    r = _freetoken(other_abi_library, "generate", "-p", "Hello", "-n", "2", "--temp", "0")
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if "GPU library" in x]
    assert len(notes) == 1, r.stderr
    assert notes[0].startswith("freetoken: the GPU library cannot be used, running on the CPU")
    assert "C ABI 999" in notes[0]
    assert "Traceback" not in r.stderr


def test_device_cuda_with_a_library_of_another_abi_is_one_line_and_exit_2(
    other_abi_library: Path,
) -> None:
    r = _freetoken(other_abi_library, "generate", "-p", "Hello", "-n", "2", "--device", "cuda")
    assert r.returncode == 2
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "C ABI 999" in errors[0]
    assert "Traceback" not in r.stderr


def test_without_a_gpu_library_the_notice_is_one_short_line(tmp_path: Path) -> None:
    missing = tmp_path / "libfreetoken_cuda.so"
    r = _freetoken(missing, "generate", "-p", "Hello", "-n", "2", "--temp", "0")
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if "GPU" in x]
    assert notes == [
        "freetoken: no GPU library in this install, running on the CPU (`freetoken info` says more)"
    ]
    r = _freetoken(missing, "generate", "-p", "Hello", "-n", "2", "--temp", "0", "-v")
    notes = [x for x in r.stderr.splitlines() if "GPU" in x]
    assert len(notes) == 2 and str(missing) in notes[1], r.stderr
