"""The tokenizer: text to token ids and back, exactly as llama.cpp does it for a GGUF file."""

from __future__ import annotations

import codecs
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from freetoken.errors import GGUFError, InvalidInputError
from freetoken.tokenizer.chat import fallback_template, render_chat_template
from freetoken.tokenizer.models import BpeModel, SpmModel
from freetoken.tokenizer.pretok import BYTE_DECODER
from freetoken.tokenizer.vocab import NULL, Attr, Vocab

__all__ = ["IncrementalDecoder", "Tokenizer"]

_SPECIAL_ATTRS = Attr.CONTROL | Attr.UNKNOWN
# What C's isspace() accepts in the C locale: llama.cpp strips these around LSTRIP/RSTRIP tokens.
_C_SPACE = " \t\n\v\f\r"


class Tokenizer:
    """A GGUF file's tokenizer (``tokenizer.ggml.*`` metadata), matching llama.cpp.

    Build one with :meth:`from_gguf_metadata`. Supports the SentencePiece (``llama``) and BPE
    (``gpt2``, ``gemma4``) tokenizer models with llama.cpp's pre-tokenizers.
    """

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._tokens = vocab.tokens
        self._attrs = vocab.attrs
        self._pieces: dict[int, bytes] = {}
        if vocab.model == "llama":
            # byte fallback: "<0xXX>", else the byte itself as a one-character token
            t2i = vocab.token_to_id
            byte_tokens = [
                t2i.get(f"<0x{b:02X}>", t2i.get(chr(b)) if b < 0x80 else None) for b in range(256)
            ]
            unk = vocab.special["unk"]
            self._model: SpmModel | BpeModel = SpmModel(
                vocab.token_to_id, vocab.scores, byte_tokens, unk if unk != NULL else None
            )
        else:
            assert vocab.pretok is not None
            self._model = BpeModel(
                vocab.token_to_id,
                vocab.merges,
                vocab.pretok,
                ignore_merges=vocab.ignore_merges,
                newline_words=vocab.pre in ("gemma4", "granite-embed-multi-311m"),
            )
        # Tokens split out of text before tokenizing: all of them when special tokens are
        # parsed, else only the user-defined ones (control and unknown tokens stay text).
        self._split_all = [(vocab.tokens[i], i) for i in vocab.special_tokens]
        self._split_user = [
            (vocab.tokens[i], i)
            for i in vocab.special_tokens
            if not vocab.attrs[i] & _SPECIAL_ATTRS
        ]

    # Construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Builds the tokenizer from GGUF metadata (``tokenizer.ggml.*``, plus ``general.name``
        and ``general.architecture`` when present, which select llama.cpp's per-model fixes).

        Raises :class:`~freetoken.errors.GGUFError` for missing or malformed fields and
        :class:`~freetoken.errors.UnsupportedError` for a tokenizer model or pre-tokenizer type
        this build does not handle.
        """
        return cls(Vocab.from_metadata(meta))

    # Properties ----------------------------------------------------------------------------

    @property
    def vocab(self) -> Vocab:
        """The loaded vocabulary (tokens, scores, attributes, flags)."""
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """Number of tokens."""
        return len(self._tokens)

    def _role(self, role: str) -> int | None:
        tid = self._vocab.special[role]
        return None if tid == NULL else tid

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id (None if the vocabulary has none)."""
        return self._role("bos")

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence token id (None if the vocabulary has none)."""
        return self._role("eos")

    @property
    def eot_id(self) -> int | None:
        """End-of-turn token id (None if the vocabulary has none)."""
        return self._role("eot")

    @property
    def eom_id(self) -> int | None:
        """End-of-message token id (None if the vocabulary has none)."""
        return self._role("eom")

    @property
    def pad_id(self) -> int | None:
        """Padding token id (None if the vocabulary has none)."""
        return self._role("pad")

    @property
    def unk_id(self) -> int | None:
        """Unknown token id (None if the vocabulary has none)."""
        return self._role("unk")

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation (llama.cpp's EOG set: EOS, EOT, EOM, and tokens such as
        ``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>`` recognised by their text)."""
        return self._vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        """Whether ``encode(..., add_special=True)`` prepends BOS."""
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        """Whether ``encode(..., add_special=True)`` appends EOS."""
        return self._vocab.add_eos

    @property
    def chat_template(self) -> str | None:
        """The file's ``tokenizer.chat_template``, if any."""
        return self._vocab.chat_template

    def is_eog(self, token_id: int) -> bool:
        """Whether ``token_id`` ends generation."""
        return token_id in self._vocab.eog_ids

    def is_control(self, token_id: int) -> bool:
        """Whether ``token_id`` is a control token (rendered only when asked for)."""
        return bool(self._attrs[self._check_id(token_id)] & Attr.CONTROL)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary text of ``token_id`` (as stored, e.g. ``▁Hello`` or ``ĠHello``)."""
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id of the token whose vocabulary text is exactly ``text``, or None."""
        return self._vocab.token_to_id.get(text)

    # Encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, as ``llama_tokenize`` gives them.

        ``add_special``: add BOS / EOS as the model asks (``tokenizer.ggml.add_bos_token`` /
        ``add_eos_token``). ``parse_special``: control tokens written in the text (``<bos>``,
        ``<start_of_turn>``...) become those tokens; user-defined tokens always do.
        """
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
        try:
            return self._encode(text, add_special, parse_special)
        except UnicodeEncodeError as e:
            # lone surrogates: not representable as the UTF-8 llama.cpp tokenizes
            raise InvalidInputError(f"text is not valid Unicode: {e}") from None

    def _encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        v = self._vocab
        out: list[int] = []
        if add_special and v.add_bos:
            out.append(self._required("bos"))
        fragments = self._partition(text, parse_special) if text else []
        model = self._model
        if isinstance(model, SpmModel):
            prev_special = True  # a space is prefixed to text at the start and after specials
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if v.add_space_prefix and prev_special:
                    frag = " " + frag
                model.tokenize(frag.replace(" ", "▁"), out)
                prev_special = False
        else:
            escape = v.escape_whitespaces
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    model.tokenize(frag.replace(" ", "▁") if escape else frag, out)
        if add_special and v.add_eos:
            out.append(self._required("eos"))
        return out

    def encode_batch(
        self, texts: Iterable[str], add_special: bool = True, parse_special: bool = True
    ) -> list[list[int]]:
        """:meth:`encode` for each of ``texts``."""
        return [self.encode(t, add_special, parse_special) for t in texts]

    def _required(self, role: str) -> int:
        tid = self._vocab.special[role]
        if tid == NULL:
            raise GGUFError(f"the tokenizer adds a {role.upper()} token but defines none")
        return tid

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Splits ``text`` around special tokens the way llama.cpp does: for each special token,
        longest first, every occurrence in every remaining text fragment becomes that token."""
        candidates = self._split_all if parse_special else self._split_user
        # (start, end) of a text fragment, or a token id
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        attrs = self._attrs
        for tok_text, tid in candidates:
            if tok_text not in text:
                continue  # most special tokens never occur: skip them cheaply
            lstrip = bool(attrs[tid] & Attr.LSTRIP)
            rstrip = bool(attrs[tid] & Attr.RSTRIP)
            n = len(tok_text)
            new: list[tuple[int, int] | int] = []
            for frag in frags:
                if isinstance(frag, int):
                    new.append(frag)
                    continue
                start, end = frag
                while True:
                    m = text.find(tok_text, start, end)
                    if m < 0:
                        if start < end:
                            new.append((start, end))
                        break
                    left_end = m
                    if lstrip:
                        while left_end > start and text[left_end - 1] in _C_SPACE:
                            left_end -= 1
                    if left_end > start:
                        new.append((start, left_end))
                    new.append(tid)
                    start = m + n
                    if rstrip:
                        while start < end and text[start] in _C_SPACE:
                            start += 1
                    if start >= end:
                        break
            frags = new
        return [text[f[0] : f[1]] if isinstance(f, tuple) else f for f in frags]

    # Decoding ------------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> int:
        # accepts any integer type (numpy, torch scalars) and returns a plain int
        try:
            tid = operator.index(token_id)
        except TypeError:
            raise InvalidInputError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= tid < len(self._tokens):
            n = len(self._tokens)
            raise InvalidInputError(f"token id {token_id!r} is out of range [0, {n})")
        return tid

    def _piece(self, tid: int) -> bytes:
        # llama.cpp's cached piece (rendered with special=true)
        piece = self._pieces.get(tid)
        if piece is not None:
            return piece
        attr = self._attrs[tid]
        text = self._tokens[tid]
        if attr & (Attr.UNKNOWN | Attr.CONTROL | Attr.USER_DEFINED):
            piece = text.encode()
        elif attr & Attr.NORMAL:
            if self._vocab.model == "llama" or self._vocab.escape_whitespaces:
                piece = text.replace("▁", " ").encode()
            else:
                piece = _decode_byte_spelling(text)
        elif attr & Attr.BYTE:
            piece = bytes([_parse_hex_byte(text)])
        else:
            piece = b""
        self._pieces[tid] = piece
        return piece

    def token_to_piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes of one token, as ``llama_token_to_piece`` gives them. Control and unknown
        tokens render as empty unless ``special``. A piece may be part of a UTF-8 character:
        use :class:`IncrementalDecoder` to stream text."""
        tid = self._check_id(token_id)
        if not special and self._attrs[tid] & _SPECIAL_ATTRS:
            return b""
        return self._piece(tid)

    def detokenize(
        self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False
    ) -> bytes:
        """The bytes of ``ids``, as ``llama_detokenize`` gives them.

        ``remove_special``: drop a leading BOS / trailing EOS that the model adds;
        ``unparse_special``: render control tokens as their text.
        """
        v = self._vocab
        ids = [self._check_id(t) for t in ids]
        remove_space = v.add_space_prefix
        if remove_special and v.add_bos and ids and ids[0] == v.special["bos"]:
            remove_space = False
            ids = ids[1:]
        if remove_special and v.add_eos and ids and ids[-1] == v.special["eos"]:
            ids = ids[:-1]
        parts: list[bytes] = []
        for t in ids:
            piece = self.token_to_piece(t, unparse_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]  # the space the tokenizer prefixed
            remove_space = False
            parts.append(piece)
        data = b"".join(parts)
        if v.clean_spaces:
            data = _clean_spaces(data)
        return data

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids``. Control tokens are rendered as their text unless
        ``skip_special``, which also drops the BOS / EOS the model adds. Bytes that do not form
        valid UTF-8 become U+FFFD."""
        data = self.detokenize(ids, remove_special=skip_special, unparse_special=not skip_special)
        return data.decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = True) -> IncrementalDecoder:
        """A streaming decoder for generated tokens (see :class:`IncrementalDecoder`)."""
        return IncrementalDecoder(self, skip_special=skip_special)

    # Chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation with the file's ``tokenizer.chat_template`` (or
        ``chat_template``), the way transformers renders chat templates.

        ``messages`` are dicts with ``role`` and ``content``; ``tools`` are JSON-schema dicts;
        extra keyword arguments become template variables. ``bos_token`` / ``eos_token`` are
        set from the vocabulary. Without any template, Gemma vocabularies get Gemma's turn
        format and others ChatML (llama.cpp's fallback). The result may start with the BOS
        text: :meth:`encode_chat` tokenizes it without doubling BOS.
        """
        template = chat_template or self.chat_template or fallback_template(self)
        specials = {}
        for role, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unk", "unk_token")):
            tid = self._role(role)
            if tid is not None:
                specials[name] = self._piece(tid).decode("utf-8", errors="replace")
        tid = self._role("pad")
        if tid is not None:
            specials["pad_token"] = self._piece(tid).decode("utf-8", errors="replace")
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**specials, **kwargs},
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a rendered conversation, as llama.cpp's chat path builds them: the
        rendered text loses a leading BOS text when the tokenizer adds BOS itself, then is
        encoded with special tokens added and parsed."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        bos = self._role("bos")
        if bos is not None and self.add_bos:
            bos_text = self._piece(bos).decode("utf-8", errors="replace")
            if bos_text and text.startswith(bos_text):
                text = text[len(bos_text) :]
        return self.encode(text, add_special=True, parse_special=True)


class IncrementalDecoder:
    """Streams the text of tokens as they are generated, returning only complete characters:
    a UTF-8 sequence split across tokens is held back until its last byte arrives.

    >>> dec = tok.incremental_decoder()
    >>> text = "".join(dec.add(t) for t in ids) + dec.flush()
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The new complete text after ``token_id`` (possibly empty)."""
        return self._utf8.decode(self._tok.token_to_piece(token_id, self._special))

    def flush(self) -> str:
        """Whatever is held back (an incomplete sequence becomes U+FFFD); resets the decoder."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


def _parse_hex_byte(text: str) -> int:
    # llama.cpp reads the two characters after "<0x" with strtol: leading hex digits only
    digits = ""
    for ch in text[3:5]:
        if ch in "0123456789abcdefABCDEF":
            digits += ch
        else:
            break
    return int(digits, 16) if digits else 0


def _decode_byte_spelling(text: str) -> bytes:
    """Bytes of a GPT-2 byte-level token spelling (llama.cpp's ``llama_decode_text``)."""
    out = bytearray()
    for ch in text:
        b = BYTE_DECODER.get(ch)
        if b is not None:
            out.append(b)
        else:
            # llama.cpp's marker for a character outside the byte alphabet
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
    return bytes(out)


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's ``clean_up_tokenization_spaces``: three in-place passes over the bytes that
    drop spaces before ``?!.,``, around a lone apostrophe, and before ``'s 'm 're 've``.
    Done in place like llama.cpp, since each pass reads bytes it may already have rewritten."""
    buf = bytearray(data)
    sp, ap = ord(" "), ord("'")

    total = len(buf)
    # pass 1: " ?", " !", " .", " ,"
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == sp and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    # pass 2: " ' " -> "'"
    n, total = total, 1 if total else 0
    i = 1
    while i < n:
        x = buf[i]
        if x == ap and i + 1 < n and buf[i - 1] == sp and buf[i + 1] == sp:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    # pass 3: " 's", " 'm", " 're", " 've" lose the space
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == sp and x == ap and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n:
                x2 = buf[i + 2]
                if (x1, x2) in ((ord("r"), ord("e")), (ord("v"), ord("e"))):
                    total -= 1
        buf[total] = x
        total += 1
    return bytes(buf[:total])
