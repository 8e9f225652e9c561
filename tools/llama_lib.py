"""A ctypes binding to the reference build's libllama: `LlamaRef.load(path, ...)` gives
`.tokenize`, `.detokenize`, `.logits` (teacher-forced, `[n_tokens, n_vocab]` float32),
`.greedy` / `.greedy_with_logits`."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from llama_build import build
from llama_structs import (
    LlamaBatch,
    LlamaContextParams,
    LlamaModelParams,
    c_token_p,
    check_layout,
)

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
            "llama_tokenize": (i32, [vp, ctypes.c_char_p, i32, c_token_p, i32, b, b]),
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
            token=tok.ctypes.data_as(c_token_p),
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
