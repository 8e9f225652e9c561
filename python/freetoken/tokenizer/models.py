"""The two merge algorithms llama.cpp runs on a piece of text: SentencePiece-style merging by
token score, and BPE merging by merge rank.

Both work on a doubly linked list of symbols (initially one per character) and a heap of
candidate pairs; a popped pair that no longer matches the list is stale and skipped. Ties are
broken by the leftmost position, as in llama.cpp, which decides the result when several merges
have the same score or rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from freetoken.tokenizer.pretok import PreTokenizer, byte_encode

__all__ = ["BpeModel", "SpmModel"]


class SpmModel:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``): repeatedly merge the
    adjacent pair whose concatenation is a vocabulary token of the highest score; leftover
    characters that are not tokens become byte tokens."""

    def __init__(
        self,
        token_to_id: dict[str, int],
        scores: list[float],
        byte_tokens: list[int | None],
        unk_id: int | None,
    ) -> None:
        self._get = token_to_id.get
        self._neg_scores = [-s for s in scores]
        self._byte_tokens = byte_tokens
        self._unk = unk_id

    def tokenize(self, text: str, out: list[int]) -> None:
        """Appends the token ids of ``text`` (already whitespace-escaped) to ``out``."""
        n = len(text)
        if n == 0:
            return
        get = self._get
        neg = self._neg_scores
        syms = list(text)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        # heap entries: (-score, left, right, merged length); highest score, then leftmost first
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = get(syms[i] + syms[i + 1])
            if tid is not None:
                heap.append((neg[tid], i, i + 1, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, size = pop(heap)
            a = syms[left]
            b = syms[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # one side was merged since this pair was queued
            merged = a + b
            syms[left] = merged
            syms[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                cand = syms[before] + merged
                tid = get(cand)
                if tid is not None:
                    push(heap, (neg[tid], before, left, len(cand)))
            if after >= 0:
                cand = merged + syms[after]
                tid = get(cand)
                if tid is not None:
                    push(heap, (neg[tid], left, after, len(cand)))
        i = 0
        while i != -1:
            sym = syms[i]
            tid = get(sym)
            if tid is not None:
                out.append(tid)
            else:
                # every merged symbol is a token, so this is one character: spell its bytes
                for byte in sym.encode("utf-8"):
                    bt = self._byte_tokens[byte]
                    if bt is None:
                        bt = self._unk_or_raise(sym)
                    out.append(bt)
            i = nxt[i]

    def _unk_or_raise(self, sym: str) -> int:
        if self._unk is None:
            from freetoken.errors import InvalidInputError

            raise InvalidInputError(
                f"character {sym!r} has no token and the vocabulary has no byte tokens"
            )
        return self._unk


class BpeModel:
    """llama.cpp's BPE tokenizer (``llm_tokenizer_bpe``): split text into words with the
    pre-tokenizer, spell each word GPT-2 style (or as raw UTF-8 for Gemma 4), then repeatedly
    apply the lowest-ranked merge of an adjacent pair."""

    _CACHE_LIMIT = 200_000

    def __init__(
        self,
        token_to_id: dict[str, int],
        merges: dict[tuple[str, str], int],
        pretok: PreTokenizer,
        ignore_merges: bool,
        newline_words: bool,
    ) -> None:
        self._token_to_id = token_to_id
        self._merges = merges
        self._pretok = pretok
        self._ignore_merges = ignore_merges
        # Gemma 4: a word of newlines only is one token if the vocabulary has it
        self._newline_words = newline_words
        self._spell: Callable[[str], str] = byte_encode if pretok.byte_encode else _identity
        self._cache: dict[str, tuple[int, ...]] = {}
        pretok.split("")  # compile the expressions now rather than on the first call
        if pretok.byte_encode:
            # fallback for a symbol without a token: each byte of its spelling, looked up as a
            # one-byte string (only ASCII can be one)
            self._fallback = [token_to_id.get(chr(b)) if b < 0x80 else None for b in range(256)]
        else:
            self._fallback = [token_to_id.get(f"<0x{b:02X}>") for b in range(256)]

    def tokenize(self, text: str, out: list[int]) -> None:
        """Appends the token ids of ``text`` to ``out``."""
        cache = self._cache
        for word in self._pretok.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._word(self._spell(word))
                if len(cache) >= self._CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _word(self, word: str) -> tuple[int, ...]:
        get = self._token_to_id.get
        if self._ignore_merges or (self._newline_words and not word.strip("\n")):
            tid = get(word)
            if tid is not None:
                return (tid,)
        n = len(word)
        syms = list(word)
        if n > 1:
            ranks = self._merges
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prev = list(range(-1, n - 1))
            # heap entries: (rank, left, right, merged text); lowest rank, then leftmost first
            heap: list[tuple[int, int, int, str]] = []
            for i in range(n - 1):
                r = ranks.get((syms[i], syms[i + 1]))
                if r is not None:
                    heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
            heapq.heapify(heap)
            pop, push = heapq.heappop, heapq.heappush
            while heap:
                _, left, right, text = pop(heap)
                a = syms[left]
                b = syms[right]
                if not a or not b or a + b != text:
                    continue  # outdated pair
                syms[left] = text
                syms[right] = ""
                after = nxt[right]
                nxt[left] = after
                if after >= 0:
                    prev[after] = left
                before = prev[left]
                if before >= 0:
                    r = ranks.get((syms[before], text))
                    if r is not None:
                        push(heap, (r, before, left, syms[before] + text))
                if after >= 0:
                    r = ranks.get((text, syms[after]))
                    if r is not None:
                        push(heap, (r, left, after, text + syms[after]))
        ids: list[int] = []
        for sym in syms:
            if not sym:
                continue
            tid = get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            for byte in sym.encode("utf-8"):
                fb = self._fallback[byte]
                if fb is not None:  # llama.cpp drops bytes it cannot spell
                    ids.append(fb)
        return tuple(ids)


def _identity(word: str) -> str:
    return word
