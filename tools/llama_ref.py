"""The llama.cpp reference: a build of it, and a ctypes binding to its libllama.

llama.cpp is built once from the same pinned source tree as our ggml crate (the `vendor/llama.cpp`
tree of the pinned sdist, freetoken/llama_pin.toml, unpacked by `ggml/build.rs`) with the same CPU
options, into `<cache>/llama-ref-<sdist sha[:16]>-<options hash>/` (`bin/`, `lib/`, `build/`),
under a file lock, with a marker file written last. `<cache>` is `freetoken.paths.cache_dir()`.
The parts: `llama_source.py` (the tree), `llama_build.py` (the build), `llama_lib.py` (the
binding), `llama_structs.py` (the structs it passes and their layout check); this module
re-exports them and runs the built tools.

Environment (the same semantics as `ggml/build.rs`):

- `FREETOKEN_LLAMA_SRC`: an unpacked llama.cpp tree to use instead of the cached sdist tree.
- `FREETOKEN_LLAMA_SDIST`: a local copy of the sdist, used if the tree must be unpacked.
- `FREETOKEN_CPU_BASELINE=1`: a portable AVX2/FMA/F16C build instead of `GGML_NATIVE=ON`.
- `FREETOKEN_GGML_CPU_OPTIONS="GGML_AVX512=ON;..."`: explicit ggml CPU options.

Python API: `LlamaRef.load(path, ...)` gives `.tokenize`, `.detokenize`, `.logits` (teacher-forced,
`[n_tokens, n_vocab]` float32), `.greedy` / `.greedy_with_logits`; `tokenize_cli` and
`completion_cli` run the built tools. Kernels: `plain` (the default; batch-invariant `vec_dot`
kernels) or `fast` (llama.cpp's repacked and tiled matmuls, as its tools use by default); see
`KERNELS`.

Usage: `python tools/llama_ref.py build` builds (if needed) and prints the install directory;
`python tools/llama_ref.py tokenize MODEL TEXT` and `python tools/llama_ref.py greedy MODEL TEXT N`
are small manual checks of the binding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

from llama_build import TOOLS, build, cpu_options, install_dir, tool_path
from llama_lib import KERNELS, LlamaRef, load_library, tool_env
from llama_source import cache_dir, llama_source, log
from llama_structs import check_layout

__all__ = [
    "KERNELS",
    "TOOLS",
    "LlamaRef",
    "build",
    "cache_dir",
    "check_layout",
    "completion_cli",
    "cpu_options",
    "install_dir",
    "llama_source",
    "load_library",
    "tokenize_cli",
    "tool_env",
    "tool_path",
]


def tokenize_cli(
    model: str | os.PathLike[str],
    text: str | bytes,
    add_special: bool = True,
    parse_special: bool = True,
) -> list[int]:
    """Token ids of `text` by the `llama-tokenize` tool (text passed verbatim through a file).

    `add_special=False` passes `--no-bos`; note that the tool adds only BOS (when the model asks
    for it), never EOS. `parse_special=False` passes `--no-parse-special`.
    """
    import tempfile

    data = text.encode() if isinstance(text, str) else text
    with tempfile.NamedTemporaryFile(prefix="llama-ref-", suffix=".txt") as f:
        f.write(data)
        f.flush()
        cmd = [str(tool_path("llama-tokenize")), "-m", os.fspath(model), "-f", f.name]
        cmd += ["--ids", "--no-escape", "--log-disable"]
        if not add_special:
            cmd.append("--no-bos")
        if not parse_special:
            cmd.append("--no-parse-special")
        res = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, check=False)
    if res.returncode != 0:
        raise RuntimeError(
            f"llama-tokenize failed ({res.returncode}): {res.stderr.decode()[-2000:]}"
        )
    lines = [ln for ln in res.stdout.decode().splitlines() if ln.startswith("[")]
    if not lines:
        raise RuntimeError(f"no id list in llama-tokenize output: {res.stdout!r}")
    body = lines[-1].strip()[1:-1]
    return [int(x) for x in body.split(",")] if body.strip() else []


def completion_cli(
    model: str | os.PathLike[str],
    prompt: str,
    n: int,
    n_ctx: int = 4096,
    n_threads: int | None = None,
    flash_attn: str = "auto",
    seed: int = 42,
    kernels: str = "plain",
) -> str:
    """The text `llama-completion` generates for `prompt` with greedy sampling (`--temp 0`),
    at most `n` tokens, without chat template, prompt echo or escape processing; `kernels` as in
    `LlamaRef.load`."""
    threads = n_threads or os.cpu_count() or 1
    cmd = [str(tool_path("llama-completion")), "-m", os.fspath(model), "-p", prompt]
    cmd += ["-n", str(n), "--temp", "0", "--seed", str(seed), "-c", str(n_ctx)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-fa", flash_attn]
    cmd += ["-no-cnv", "--no-display-prompt", "--no-escape", "--simple-io", "-ngl", "0"]
    cmd.append("--repack" if KERNELS[kernels][0] else "--no-repack")
    res = subprocess.run(
        cmd, capture_output=True, stdin=subprocess.DEVNULL, env=tool_env(kernels), check=False
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"llama-completion failed ({res.returncode}): {res.stderr.decode()[-2000:]}"
        )
    out = res.stdout.decode(errors="replace")
    # The tool ends with "\n\n", after " [end of text]\n" when it stopped at an EOG token.
    out = out.removesuffix("\n\n").removesuffix(" [end of text]\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `build` | `tokenize MODEL TEXT` | `greedy MODEL TEXT N`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["build"] and len(args) == 1:
        t0 = time.monotonic()
        root = build()
        log(f"ready in {time.monotonic() - t0:.0f} s")
        print(root)
        return 0
    if args[:1] == ["tokenize"] and len(args) == 3:
        with LlamaRef.load(args[1], vocab_only=True) as ref:
            print(ref.tokenize(args[2]))
        print(tokenize_cli(args[1], args[2]))
        return 0
    if args[:1] == ["greedy"] and len(args) == 4:
        with LlamaRef.load(args[1]) as ref:
            ids = ref.greedy(ref.tokenize(args[2]), int(args[3]))
            print(ids)
            print(repr(ref.detokenize(ids)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
