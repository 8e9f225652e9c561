"""Fuzz targets over the Python side, run with atheris (libFuzzer):

    python fuzz/fuzz_python.py TARGET CORPUS_DIR [libFuzzer flags, e.g. -max_total_time=60]

``gguf``          a GGUF file's bytes through the loader, the tokenizer's construction and the
                  model's construction (models.load_model)
``tokenizer``     arbitrary text through encode, arbitrary ids through decode
``chat_template`` an untrusted template rendered over a small conversation (the sandbox)
``requests``      request bodies through the server's JSON parser and its OpenAI and
                  Anthropic request parsers

Each input must end in a result or a ``freetoken.errors`` exception; any other exception, a
crash or a hang is a finding. Seed corpora: fuzz/seeds.py.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris

# jinja2 is instrumented too: the chat-template target's coverage is mostly its parser and
# runtime, which the renderer imports lazily.
with atheris.instrument_imports(include=["freetoken", "jinja2"]):
    import jinja2.ext
    import jinja2.sandbox  # noqa: F401 (imported here to be instrumented)
    from freetoken.errors import FreeTokenError
    from freetoken.gguf.file import GGUFFile
    from freetoken.models import load_model
    from freetoken.server import anthropic
    from freetoken.server import protocol as P
    from freetoken.tokenizer.chat import render_chat_template
    from freetoken.tokenizer.core import Tokenizer

N_CTX = 4096
_SCRATCH = Path(
    tempfile.mkdtemp(prefix="ft-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
)


def fuzz_gguf(data: bytes) -> None:
    path = _SCRATCH / "input.gguf"
    path.write_bytes(data)
    try:
        gguf = GGUFFile(path)
        Tokenizer.from_gguf_metadata(gguf.metadata)
        load_model(gguf, moe_threads=1)
    except FreeTokenError:
        pass


_tokenizer: Tokenizer | None = None


def _the_tokenizer() -> Tokenizer:
    global _tokenizer
    if _tokenizer is None:
        from freetoken.default_model import default_model_path

        _tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    return _tokenizer


def fuzz_tokenizer(data: bytes) -> None:
    """The input as text for encode, and as little-endian 16-bit ids (some out of range) for
    decode; its length picks the flags."""
    tok = _the_tokenizer()
    text = data.decode("utf-8", "replace")
    ids = [v - 2 for (v,) in struct.iter_unpack("<H", data[: len(data) // 2 * 2])]
    ids = [i % (tok.vocab_size + 4) - 2 if i >= 0 else i for i in ids]
    flags = len(data) % 4
    try:
        tok.encode(text, add_special=bool(flags & 1), parse_special=bool(flags & 2))
    except FreeTokenError:
        pass
    try:
        tok.decode(ids, skip_special=bool(flags & 1))
    except FreeTokenError:
        pass


def fuzz_chat_template(data: bytes) -> None:
    """``template NUL content``: the template rendered over a conversation holding content."""
    template, _, content = data.decode("utf-8", "replace").partition("\0")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": content},
        {"role": "assistant", "content": "ok"},
    ]
    try:
        out = render_chat_template(template, messages, bos_token="<s>", eos_token="</s>")
    except FreeTokenError:
        return
    assert isinstance(out, str)


def fuzz_requests(data: bytes) -> None:
    try:
        body = P.parse_json_body(data)
    except FreeTokenError:
        return
    for parse in (
        lambda b: P.parse_chat(b, N_CTX),
        lambda b: P.parse_completion(b, N_CTX),
        lambda b: P.parse_chat(anthropic.to_chat_body(b), N_CTX),
    ):
        try:
            parse(body)
        except FreeTokenError:
            pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "gguf": fuzz_gguf,
    "tokenizer": fuzz_tokenizer,
    "chat_template": fuzz_chat_template,
    "requests": fuzz_requests,
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: fuzz_python.py {{{'|'.join(TARGETS)}}} [CORPUS_DIR] [libFuzzer flags]")
    target = TARGETS[sys.argv[1]]
    if target is fuzz_tokenizer:
        _the_tokenizer()
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
