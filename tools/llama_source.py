"""The pinned llama.cpp source tree for the reference build: `$FREETOKEN_LLAMA_SRC`, or the
`vendor/llama.cpp` tree of the pinned sdist (freetoken/llama_pin.toml) in the cache, unpacked
the way `ggml/build.rs` unpacks it (same lock file, same marker) when missing."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from freetoken.paths import cache_dir, llama_pin

SDIST_NAME = llama_pin().name
SDIST_SHA256 = llama_pin().sha256
SDIST_URL = llama_pin().url
MARKER = ".freetoken-complete"


def log(msg: str) -> None:
    """Prints a progress line to stderr (stdout of `build` is the install directory only)."""
    print(f"llama_ref: {msg}", file=sys.stderr, flush=True)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on `path` (created if missing) for the duration of the block.

    `ggml/build.rs` locks with Rust's `File::lock`, which is `flock` too, so the two cooperate.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_sdist(cache: Path) -> Path:
    """The sdist, hash-checked: `$FREETOKEN_LLAMA_SDIST`, a cached download, or a fresh one."""
    env = os.environ.get("FREETOKEN_LLAMA_SDIST")
    if env:
        path = Path(env)
    else:
        path = cache / "downloads" / f"{SDIST_NAME}.tar.gz"
        if not path.is_file() or _sha256_file(path) != SDIST_SHA256:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            log(f"downloading {SDIST_URL}")
            with urllib.request.urlopen(SDIST_URL, timeout=120) as r, open(part, "wb") as f:
                shutil.copyfileobj(r, f)
            part.replace(path)
    got = _sha256_file(path)
    if got != SDIST_SHA256:
        raise RuntimeError(f"{path} has sha256 {got}, expected {SDIST_SHA256}")
    return path


def _unpack_vendor_tree(sdist: Path, tree: Path) -> None:
    """Unpacks `<sdist>/vendor/llama.cpp/` into `tree` through a temporary sibling directory."""
    prefix = f"{SDIST_NAME}/vendor/llama.cpp/"
    tmp = tree.with_name(tree.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix) :]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    if tree.exists():
        shutil.rmtree(tree)
    tmp.rename(tree)


def llama_source() -> Path:
    """The llama.cpp source tree: `$FREETOKEN_LLAMA_SRC`, or the sdist tree in the cache.

    The cached tree is normally unpacked by `ggml/build.rs`; if it is missing it is unpacked here
    the same way (same lock file, same marker).
    """
    env = os.environ.get("FREETOKEN_LLAMA_SRC")
    if env:
        src = Path(env)
        if not (src / "ggml" / "CMakeLists.txt").is_file():
            raise RuntimeError(
                f"FREETOKEN_LLAMA_SRC={src} is not a llama.cpp tree (no ggml/CMakeLists.txt)"
            )
        return src
    cache = cache_dir()
    tree = cache / f"llama.cpp-{SDIST_SHA256}"
    done = tree / MARKER
    if done.is_file():
        return tree
    with file_lock(cache / f"llama.cpp-{SDIST_SHA256}.lock"):
        if not done.is_file():
            log(f"unpacking the llama.cpp tree into {tree}")
            _unpack_vendor_tree(_fetch_sdist(cache), tree)
            done.touch()
    return tree
