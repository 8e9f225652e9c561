"""The host-array boundary of ``_core``: every entry point that takes host arrays refuses a
wrong dtype, a non-contiguous or misaligned array, a too-short buffer, a read-only or
overlapping output and a non-array with a ``freetoken.errors`` exception, and leaves its
outputs untouched. numpy arrays and CPU torch tensors alike; the checks are Rust's
(``crates/ft-py/src/host.rs``), so these call ``_core`` directly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from freetoken import _core
from freetoken.errors import FreeTokenError, InvalidInputError, ShapeError
from freetoken.gguf import GGUFFile
from freetoken.quant import quantize, type_info

Q8_0 = type_info("Q8_0").id
H, FFN, E, K = 64, 32, 4, 2  # hidden, expert width, experts, routes per token


def unaligned(a: np.ndarray) -> np.ndarray:
    """``a``'s values in memory one byte off its alignment."""
    raw = np.zeros(a.nbytes + 1, dtype=np.uint8)
    out = np.frombuffer(raw, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out.flags.writeable = True
    out[...] = a
    return out


def strided(a: np.ndarray) -> np.ndarray:
    """A non-contiguous view with ``a``'s shape and dtype."""
    wide = np.zeros((*a.shape[:-1], a.shape[-1] * 2), dtype=a.dtype)
    view = wide[..., ::2]
    view[...] = a
    return view


def read_only(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b.flags.writeable = False
    return b


def refused(
    err: type[FreeTokenError], call: Callable[[], Any], untouched: np.ndarray | None = None
) -> None:
    """``call()`` raises ``err`` (a FreeTokenError) and leaves ``untouched`` as it was."""
    before = None if untouched is None else untouched.copy()
    with pytest.raises(err):
        call()
    if untouched is not None:
        np.testing.assert_array_equal(untouched, before)


# -- quantization ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights() -> np.ndarray:
    """An 8 x 64 Q8_0 matrix's bytes."""
    rng = np.random.default_rng(1)
    return np.frombuffer(quantize(rng.standard_normal((8, H)).astype(np.float32), "Q8_0"), np.uint8)


def test_dequantize(weights: np.ndarray) -> None:
    dst = np.full(8 * H, 7.0, dtype=np.float32)
    _core.dequantize(Q8_0, weights, dst)  # the call as it should be
    dst[:] = 7.0
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, weights.view(np.int8), dst), dst)
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, weights, dst.astype(np.float64)))
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, weights, strided(dst)))
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, weights, unaligned(dst)))
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, weights, read_only(dst)))
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, weights, list(dst)))
    refused(ShapeError, lambda: _core.dequantize(Q8_0, weights, dst[:-1]), dst)
    refused(ShapeError, lambda: _core.dequantize(Q8_0, weights[:-1], dst), dst)
    # The output over the input's bytes.
    buf = np.zeros(weights.nbytes + dst.nbytes, dtype=np.uint8)
    buf[: weights.nbytes] = weights
    src, out = buf[: weights.nbytes], buf[: dst.nbytes].view(np.float32)
    refused(InvalidInputError, lambda: _core.dequantize(Q8_0, src, out), buf)


def test_quantize() -> None:
    x = np.ones((2, H), dtype=np.float32)
    assert len(_core.quantize(Q8_0, x, H)) == 2 * type_info("Q8_0").row_size(H)
    refused(InvalidInputError, lambda: _core.quantize(Q8_0, x.astype(np.float64), H))
    refused(InvalidInputError, lambda: _core.quantize(Q8_0, strided(x), H))
    refused(InvalidInputError, lambda: _core.quantize(Q8_0, torch.ones(2, H).t(), H))
    refused(ShapeError, lambda: _core.quantize(Q8_0, x, H, np.ones(H - 1, np.float32)))
    refused(InvalidInputError, lambda: _core.quantize(Q8_0, x, H, np.ones(H, np.float16)))


def test_quant_weight(weights: np.ndarray) -> None:
    """A weight's bytes are checked once, when it is made."""
    assert _core.QuantWeight(Q8_0, weights, 8, H).n == 8
    refused(ShapeError, lambda: _core.QuantWeight(Q8_0, weights[:-1], 8, H))
    refused(ShapeError, lambda: _core.QuantWeight(Q8_0, weights, 9, H))
    refused(InvalidInputError, lambda: _core.QuantWeight(Q8_0, weights.view(np.int8), 8, H))
    refused(InvalidInputError, lambda: _core.QuantWeight(Q8_0, weights[::2], 4, H))
    refused(InvalidInputError, lambda: _core.QuantWeight(Q8_0, list(weights), 8, H))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_matmul(weights: np.ndarray, lib: str) -> None:
    def arr(a: np.ndarray) -> Any:
        return torch.from_numpy(a) if lib == "torch" else a

    w = _core.QuantWeight(Q8_0, weights, 8, H)
    x = np.ones((3, H), dtype=np.float32)
    y = np.full((3, 8), 7.0, dtype=np.float32)
    _core.matmul(w, arr(x), arr(y))
    y[:] = 7.0
    ty = arr(y)
    refused(InvalidInputError, lambda: _core.matmul(w, arr(x.astype(np.float64)), ty), y)
    refused(InvalidInputError, lambda: _core.matmul(w, arr(strided(x)), ty), y)
    refused(InvalidInputError, lambda: _core.matmul(w, arr(x), arr(strided(y))))
    refused(InvalidInputError, lambda: _core.matmul(w, arr(unaligned(x)), ty), y)
    refused(InvalidInputError, lambda: _core.matmul(w, arr(x).tolist(), ty), y)
    refused(ShapeError, lambda: _core.matmul(w, arr(x), arr(y[:2])), y)
    refused(ShapeError, lambda: _core.matmul(w, arr(x.reshape(-1)[:-1]), ty), y)
    # y over x: the product would read what it writes.
    both = np.ones((3, H), dtype=np.float32)
    over = both.reshape(-1)[: 3 * 8].reshape(3, 8)
    refused(InvalidInputError, lambda: _core.matmul(w, arr(both), arr(over)), both)


def test_matmul_on_gpu_memory_is_refused(weights: np.ndarray) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device for a device tensor")
    w = _core.QuantWeight(Q8_0, weights, 8, H)
    x = torch.ones((1, H), device="cuda")
    refused(InvalidInputError, lambda: _core.matmul(w, x, torch.empty((1, 8))))


def test_matmul_group(weights: np.ndarray) -> None:
    x = np.ones((2, H), dtype=np.float32)
    y1, y2 = (np.full((2, 8), 7.0, dtype=np.float32) for _ in range(2))
    w = _core.QuantWeight(Q8_0, weights, 8, H)
    _core.matmul_group([w, w], x, [y1, y2])
    y1[:] = y2[:] = 7.0
    refused(InvalidInputError, lambda: _core.matmul_group([w, w], x, [y1, y1]), y1)
    refused(InvalidInputError, lambda: _core.matmul_group([w, w], x, [y1, y2.astype(np.int32)]), y1)
    refused(ShapeError, lambda: _core.matmul_group([w, w], x, [y1, y2[:1]]), y1)
    refused(ShapeError, lambda: _core.matmul_group([w, w], x, [y1]), y1)
    # Weights of different row lengths cannot share x.
    other = np.frombuffer(quantize(np.ones((8, 2 * H), np.float32), "Q8_0"), np.uint8)
    w2 = _core.QuantWeight(Q8_0, other, 8, 2 * H)
    refused(ShapeError, lambda: _core.matmul_group([w, w2], x, [y1, y2]), y1)
    # An output over a weight's bytes.
    raw = weights.copy()
    wo = _core.QuantWeight(Q8_0, raw, 8, H)
    over = raw[: 2 * 8 * 4].view(np.float32).reshape(2, 8)
    refused(InvalidInputError, lambda: _core.matmul_group([wo], x, [over]), raw)


# -- the expert executor ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    """One Q8_0 MoE layer of ``E`` experts."""
    rng = np.random.default_rng(2)
    path: Path = tmp_path_factory.mktemp("ffi") / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    for kind, (n, k) in {"gate": (FFN, H), "up": (FFN, H), "down": (H, FFN)}.items():
        raw = quantize(rng.standard_normal((E * n, k)).astype(np.float32), "Q8_0")
        data = np.frombuffer(raw, dtype=np.int8)
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", data, raw_shape=(E, n, k), raw_dtype=Q8_0)  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


@pytest.fixture(scope="module")
def layer(moe_file: GGUFFile) -> _core.MoeLayer:
    return _core.MoeLayer(
        moe_file.handle,
        0,
        _core.MoeCounters(1),
        up=["blk.0.ffn_up_exps.weight"],
        down=["blk.0.ffn_down_exps.weight"],
        gate=["blk.0.ffn_gate_exps.weight"],
    )


@pytest.fixture(scope="module")
def executor() -> _core.MoeExecutor:
    return _core.MoeExecutor(1)


def call_arrays(t: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x = np.ones((t, H), dtype=np.float32)
    ids = np.tile(np.arange(K, dtype=np.int32), (t, 1))
    w = np.full((t, K), 0.5, dtype=np.float32)
    out = np.full((t, H), 7.0, dtype=np.float32)
    return x, ids, w, out


@pytest.mark.parametrize("mode", ["run", "submit"])
def test_executor_calls(layer: _core.MoeLayer, executor: _core.MoeExecutor, mode: str) -> None:
    def call(*args: Any) -> None:
        if mode == "run":
            executor.run(layer, *args)
        else:
            executor.submit(layer, *args).wait()

    x, ids, w, out = call_arrays()
    call(x, ids, w, out)
    assert np.isfinite(out).all() and not (out == 7.0).any()
    out[:] = 7.0
    bad = [
        (InvalidInputError, (x.astype(np.float64), ids, w, out)),
        (InvalidInputError, (x, ids.astype(np.int64), w, out)),
        (InvalidInputError, (x, ids, w.astype(np.float16), out)),
        (InvalidInputError, (strided(x), ids, w, out)),
        (InvalidInputError, (x, strided(ids), w, out)),
        (InvalidInputError, (x, ids, w, strided(out))),
        (InvalidInputError, (x, ids, w, read_only(out))),
        (InvalidInputError, (unaligned(x), ids, w, out)),
        (InvalidInputError, (x, None, w, out)),
        (InvalidInputError, (torch.from_numpy(x).t(), ids, w, out)),
        (InvalidInputError, (x, torch.from_numpy(ids).double(), w, out)),
        (ShapeError, (x[:2], ids, w, out)),
        (ShapeError, (x, ids, w[:2], out)),
        (ShapeError, (x, ids[:, :1].copy(), w, out)),
        (ShapeError, (x.reshape(-1)[:-1], ids, w, out)),
        (InvalidInputError, (out, ids, w, out)),  # in place: out is x
        (InvalidInputError, (x, ids, w, w.view(np.float32))),  # out over weights
    ]
    for err, args in bad:
        refused(err, lambda args=args: call(*args), out)
    # Torch tensors are taken as numpy arrays are.
    tx, tids, tw, tout = (torch.from_numpy(a) for a in (x, ids, w, out))
    call(tx, tids, tw, tout)
    assert not (out == 7.0).any()


def test_serve_handoffs_checks_every_buffer(
    layer: _core.MoeLayer, executor: _core.MoeExecutor
) -> None:
    max_t = 4
    good = {
        "block": np.zeros(_core.HANDOFF_WORDS, dtype=np.int64),
        "x": np.zeros((max_t, H), dtype=np.float32),
        "out": np.zeros((max_t, H), dtype=np.float32),
        "ids": np.zeros((1, max_t, K), dtype=np.int32),
        "weights": np.zeros((1, max_t, K), dtype=np.float32),
        "resident": np.full((1, E), -1, dtype=np.int32),
    }

    def serve(**change: Any) -> None:
        a = {**good, **change}
        t = executor.serve_handoffs(
            [layer], a["block"], a["x"], a["out"], a["ids"], a["weights"], a["resident"], max_t, K
        )
        a["block"][_core.HANDOFF_STOP] = 1
        t.wait()

    serve()
    cases: list[tuple[type[FreeTokenError], dict[str, Any]]] = [
        (ShapeError, {"block": np.zeros(_core.HANDOFF_WORDS - 1, dtype=np.int64)}),
        (InvalidInputError, {"block": np.zeros(_core.HANDOFF_WORDS, dtype=np.int32)}),
        (InvalidInputError, {"block": read_only(good["block"])}),
        (InvalidInputError, {"x": good["x"].astype(np.float64)}),
        (ShapeError, {"x": good["x"][:-1]}),
        (InvalidInputError, {"out": strided(good["out"])}),
        (ShapeError, {"ids": good["ids"][:, :-1]}),
        (InvalidInputError, {"weights": good["weights"].astype(np.int32)}),
        (ShapeError, {"resident": good["resident"][:, :-1]}),
        (InvalidInputError, {"out": good["x"]}),  # the answer over the activations
    ]
    for err, change in cases:
        refused(err, lambda change=change: serve(**change))


# -- the slot cache --------------------------------------------------------------------------


def test_slot_cache_calls() -> None:
    cache = _core.SlotCache(4, E)
    ids = np.array([[0, 1], [2, 3]], dtype=np.int32)
    out = np.full(ids.shape, -7, dtype=np.int32)
    for method in ("place", "lookup"):
        call = getattr(cache, method)
        call(0, ids, K, np.empty_like(ids))
        refused(InvalidInputError, lambda c=call: c(0, ids.astype(np.int64), K, out), out)
        refused(InvalidInputError, lambda c=call: c(0, strided(ids), K, out), out)
        refused(InvalidInputError, lambda c=call: c(0, ids, K, out.astype(np.float32)))
        refused(InvalidInputError, lambda c=call: c(0, ids, K, read_only(out)))
        refused(FreeTokenError, lambda c=call: c(0, ids, K, out[:1]), out)
        both = ids.copy()
        refused(InvalidInputError, lambda c=call, b=both: c(0, b, K, b), both)
    assert cache.split_tokens(ids, K) == [(0, 2)]
    refused(InvalidInputError, lambda: cache.split_tokens(ids.astype(np.uint32), K))
    refused(InvalidInputError, lambda: cache.split_tokens(strided(ids), K))


# -- the GPU hand-off's host buffers (checked before the library is needed) ------------------


def test_handoff_host_buffers() -> None:
    block = np.zeros(_core.HANDOFF_WORDS, dtype=np.int64)
    src = np.zeros(8, dtype=np.float32)
    wait = _core.cuda_handoff_wait_add
    refused(ShapeError, lambda: wait(0, 8, block[:-1], 0, src, 8, 1))
    refused(InvalidInputError, lambda: wait(0, 8, block.astype(np.int32), 0, src, 8, 1))
    refused(InvalidInputError, lambda: wait(0, 8, block, 0, src.astype(np.float64), 8, 1))
    refused(InvalidInputError, lambda: wait(0, 8, block, 0, strided(src), 8, 1))
    refused(InvalidInputError, lambda: wait(0, 8, block, 0, block.view(np.float32), 8, 1))
    host = (
        np.zeros((2, H), dtype=np.float32),
        np.zeros((2, K), dtype=np.int32),
        np.zeros((2, K), dtype=np.float32),
    )
    routes = _core.cuda_handoff_routes
    sizes, dev = (2, H, K, E, 4), (8, 8, 8, 8, 8, 8)
    refused(ShapeError, lambda: routes(0, 8, block, 0, 0, sizes, dev, (host[0][:1], *host[1:])))
    refused(
        InvalidInputError,
        lambda: routes(0, 8, block, 0, 0, sizes, dev, (host[0], host[2], host[2])),
    )
    refused(
        InvalidInputError,
        lambda: routes(0, 8, block, 0, 0, sizes, dev, (host[0], host[1], read_only(host[2]))),
    )
    refused(
        InvalidInputError,
        lambda: routes(0, 8, block, 0, 0, sizes, dev, (host[0], host[1], host[0][:, :K])),
    )


def test_mapped_tensor_bytes_are_read_only(moe_file: GGUFFile) -> None:
    """A tensor's bytes are exported read-only, and the export keeps the mapping alive."""
    f = _core.GGUFFile(moe_file.path)
    name = "blk.0.ffn_up_exps.weight"
    view = memoryview(f.tensor_data(name))
    assert view.readonly and view.nbytes == moe_file.info(name).nbytes
    want = bytes(moe_file.raw(name))
    del f
    assert bytes(view) == want
    with pytest.raises(TypeError):
        view[0] = 1
    refused(
        InvalidInputError, lambda: _core.dequantize(Q8_0, view, np.frombuffer(view, np.float32))
    )
