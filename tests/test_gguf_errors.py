"""Bad GGUF input gives a FreeTokenError naming the cause, and the CLI prints one line and
exits 2: never a crash or a traceback."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from freetoken.errors import FreeTokenError, GGUFError, ShapeError, UnsupportedError
from freetoken.gguf import GGUFFile
from freetoken.models import load_model


def write_gguf(
    path: Path, arch: str = "llama", tensors: dict[str, np.ndarray] | None = None
) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for name, a in (tensors or {"a.weight": np.ones((4, 32), np.float32)}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "good.gguf")


def test_valid_file_reads_like_gguf_py(good: Path) -> None:
    ours = GGUFFile(good)
    ref = gguf.GGUFReader(str(good))
    assert ours.architecture == "llama"
    t = ref.tensors[0]
    assert ours.info(t.name).shape == tuple(reversed([int(d) for d in t.shape]))
    np.testing.assert_array_equal(ours.array(t.name), np.asarray(t.data))


def test_no_mmap_reads_the_same_bytes_as_gguf_py(tmp_path: Path) -> None:
    """``--no-mmap``: the data read into memory is the file's, tensor by tensor (gguf-py's
    reader of the same file), and the progress callback reaches the file's size."""
    rng = np.random.default_rng(3)
    tensors = {
        f"t{i}.weight": rng.standard_normal((8 + i, 64)).astype(np.float32) for i in range(3)
    }
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    seen: list[tuple[int, int]] = []
    ours = GGUFFile(path, mmap=False, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (path.stat().st_size, path.stat().st_size)
    ref = gguf.GGUFReader(str(path))
    for t in ref.tensors:
        np.testing.assert_array_equal(ours.array(t.name), np.asarray(t.data))


def test_text_file(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is not a model\n")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FreeTokenError, match=re.escape("nope.gguf")):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0, 3, 8, 20, 40, 100, -1])
def test_truncated(good: Path, tmp_path: Path, keep: int) -> None:
    data = good.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(GGUFError):
        GGUFFile(p)


def test_unsupported_version(good: Path, tmp_path: Path) -> None:
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    p = tmp_path / "v99.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="version 99"):
        GGUFFile(p)


def _tensor_info_offset_pos(data: bytes, name: str) -> int:
    """Byte position of the named tensor's data-offset field in the header."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, i)
    return i + 4 + 8 * n_dims + 4


def test_tensor_past_end_of_file(good: Path, tmp_path: Path) -> None:
    data = bytearray(good.read_bytes())
    pos = _tensor_info_offset_pos(bytes(data), "a.weight")
    data[pos : pos + 8] = struct.pack("<Q", 1 << 20)
    p = tmp_path / "past.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=re.escape("a.weight")):
        GGUFFile(p)


def test_huge_counts_do_not_allocate(good: Path, tmp_path: Path) -> None:
    data = bytearray(good.read_bytes())
    data[8:16] = struct.pack("<Q", 1 << 60)  # tensor count
    p = tmp_path / "count.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="tensor count"):
        GGUFFile(p)


def test_unknown_tensor_type(good: Path, tmp_path: Path) -> None:
    data = bytearray(good.read_bytes())
    pos = _tensor_info_offset_pos(bytes(data), "a.weight") - 4
    data[pos : pos + 4] = struct.pack("<I", 28)  # F64
    p = tmp_path / "f64.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match=re.escape("a.weight")):
        GGUFFile(p)


def test_missing_and_misshapen_tensors(good: Path) -> None:
    f = GGUFFile(good)
    with pytest.raises(GGUFError, match=re.escape("missing tensor `b.weight`")):
        f.info("b.weight")
    with pytest.raises(ShapeError, match=re.escape("a.weight")):
        f.expect("a.weight", (32, 4))


def test_unsupported_architecture(tmp_path: Path) -> None:
    f = GGUFFile(write_gguf(tmp_path / "arch.gguf", arch="mamba"))
    with pytest.raises(UnsupportedError, match="mamba"):
        load_model(f)


def test_model_missing_tensor_names_it(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_context_length(64)
    w.add_tensor("token_embd.weight", np.ones((10, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=re.escape("blk.0.attn_norm.weight")):
        load_model(GGUFFile(tmp_path / "m.gguf"))


@pytest.mark.parametrize("content", [b"not a model", b"GGUF\x03\x00\x00\x00"])
def test_cli_prints_one_line_and_exits_2(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    for cmd in (["inspect", str(p)], ["generate", "-m", str(p), "-n", "1", "-p", "hi"]):
        r = subprocess.run(
            [sys.executable, "-m", "freetoken.cli", *cmd], capture_output=True, text=True
        )
        assert r.returncode == 2, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
        assert "Traceback" not in r.stderr
