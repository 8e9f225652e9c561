"""Seed corpora for the fuzz targets, made with the project's own tools:

    python fuzz/seeds.py DIR      writes DIR/{gguf,tokenizer,chat_template,requests}/

``gguf``: small synthetic models from ``make-test-model`` (a dense and a MoE architecture, two
quant types); ``chat_template``: the built-in templates and the GGUF chat templates of the
pinned llama.cpp tree's vocabulary files; ``tokenizer`` and ``requests``: texts and request
bodies like the tests'.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GGUF_MODELS = {
    "llama-q8_0.gguf": ["--arch", "llama", "--quant", "q8_0"],
    "qwen3moe-q4_0.gguf": [
        "--arch", "qwen3moe", "--quant", "q4_0", "--experts", "4", "--top-k", "2",
        "--expert-ffn", "32",
    ],
}  # fmt: skip
#: One small layer over the smallest vocabulary: inputs of about 2 MB.
SMALL = ["--layers", "1", "--hidden", "32", "--ffn", "64", "--heads", "1", "--kv-heads", "1"]
TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.\n\n  Tabs\tand  spaces",
    "<start_of_turn>user\nHi<end_of_turn>\n<bos><eos>",
    "数字 123 456 — emoji 🙂 and combining é",
    "\x00\x01\x7f\ufffd",
]
REQUESTS = [
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}],
     "stream": True, "temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "seed": 1},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "auto", "logprobs": True, "top_logprobs": 2},
    {"prompt": "Once upon", "max_tokens": 8, "echo": True, "logprobs": 1},
    {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}},
    {"model": "m", "max_tokens": 16, "system": "s",
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
]  # fmt: skip


def write(out: Path) -> None:
    """Writes every target's seeds under ``out``."""
    from freetoken.tokenizer.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE

    for d in ("gguf", "tokenizer", "chat_template", "requests"):
        (out / d).mkdir(parents=True, exist_ok=True)
    from freetoken.testmodel.vocab import llama_tree

    vocab = llama_tree() / "models" / "ggml-vocab-llama-spm.gguf"
    for name, args in GGUF_MODELS.items():
        cmd = [sys.executable, "-m", "freetoken", "make-test-model", *args, *SMALL]
        cmd += ["--vocab", str(vocab)]
        subprocess.run([*cmd, "--check", "none", "-o", str(out / "gguf" / name)], check=True)
    for i, text in enumerate(TEXTS):
        (out / "tokenizer" / f"text{i}").write_bytes(text.encode())
    templates = [CHATML_TEMPLATE, GEMMA_TEMPLATE, *_vocab_templates()]
    for i, t in enumerate(templates):
        (out / "chat_template" / f"template{i}").write_bytes(t.encode() + b"\0hello")
    for i, body in enumerate(REQUESTS):
        (out / "requests" / f"body{i}").write_bytes(json.dumps(body).encode())


def _vocab_templates() -> list[str]:
    """The chat templates the pinned tree's vocabulary files carry."""
    from freetoken.gguf.file import GGUFFile
    from freetoken.testmodel.vocab import llama_tree

    out = []
    for path in sorted((llama_tree() / "models").glob("ggml-vocab-*.gguf")):
        t = GGUFFile(path).metadata.get("tokenizer.chat_template")
        if isinstance(t, str) and t not in out:
            out.append(t)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: seeds.py DIR")
    write(Path(sys.argv[1]))
