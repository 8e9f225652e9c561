"""The libllama structs the binding passes (ctypes mirrors of `llama.h`), and their check:
the build compiles a probe that records the C layout (`layout.txt`), the binding compares."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

c_token_p = ctypes.POINTER(ctypes.c_int32)


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
        ("token", c_token_p),
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


def probe_layout(src: Path, root: Path) -> None:
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
