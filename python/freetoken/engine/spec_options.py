"""The speculative decoding flags (llama.cpp's names) and their checked settings; the
drafters and the verify rule are in engine/speculative.py. Light to import: the command
line parser reads it."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from freetoken.errors import InvalidInputError
from freetoken.runtime.speculative import synth_conditional, synth_rates

__all__ = ["MAX_DRAFT", "SPEC_TYPES", "DraftLimits", "SpecOptions", "add_arguments", "from_args"]

SPEC_TYPES = ("none", "draft-mtp", "draft-simple", "ngram-simple")
#: The most tokens one step drafts.
MAX_DRAFT = 32


@dataclass(frozen=True)
class DraftLimits:
    """How much one step drafts: at most ``n_max`` tokens, none unless ``n_min``, stopping
    where the drafter's top token's probability is below ``p_min`` (checked by the caller:
    :class:`SpecOptions` for the flags, the server for a request's fields)."""

    n_max: int
    n_min: int = 0
    p_min: float = 0.0


@dataclass(frozen=True)
class SpecOptions:
    """Speculative decoding settings (llama.cpp's flags of the same names; see the module
    docstring; ``n_auto``, ours, is ``--spec-draft-n-auto``: engine/draft_length.py chooses
    each step's length). ``spec_type`` ``none`` turns it off; a ``draft_model`` alone means
    ``draft-simple``."""

    spec_type: str = "none"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    n_auto: bool = False
    draft_model: str | None = None
    synth_len: float | None = None
    synth_rates: tuple[float, ...] = ()
    ngram_size_n: int = 12
    ngram_size_m: int = 48

    def __post_init__(self) -> None:
        if self.spec_type not in SPEC_TYPES:
            raise InvalidInputError(
                f"--spec-type {self.spec_type}: choose one of {', '.join(SPEC_TYPES)}"
            )
        if self.draft_model is not None and self.spec_type == "none":
            object.__setattr__(self, "spec_type", "draft-simple")
        if self.spec_type == "draft-simple" and not self.draft_model:
            raise InvalidInputError("--spec-type draft-simple needs --spec-draft-model FILE")
        if self.draft_model and self.spec_type != "draft-simple":
            raise InvalidInputError(
                f"--spec-draft-model is for --spec-type draft-simple, not {self.spec_type}"
            )
        for name, value in (("n-max", self.n_max), ("n-min", self.n_min)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInputError(f"--spec-draft-{name} must be an integer, got {value!r}")
        if not 1 <= self.n_max <= MAX_DRAFT:
            raise InvalidInputError(
                f"--spec-draft-n-max must be within 1..{MAX_DRAFT}, got {self.n_max}"
            )
        if not 0 <= self.n_min <= self.n_max:
            raise InvalidInputError(
                f"--spec-draft-n-min must be within 0..{self.n_max} (--spec-draft-n-max), "
                f"got {self.n_min}"
            )
        if not (math.isfinite(self.p_min) and 0.0 <= self.p_min <= 1.0):
            raise InvalidInputError(f"--spec-draft-p-min must be within [0, 1], got {self.p_min}")
        for name, value in (("n", self.ngram_size_n), ("m", self.ngram_size_m)):
            if not 1 <= value <= 1024:
                raise InvalidInputError(
                    f"--spec-ngram-simple-size-{name} must be within 1..1024, got {value}"
                )
        if self.n_auto and not self.enabled:
            raise InvalidInputError("--spec-draft-n-auto needs a --spec-type")
        if (self.synth_len is not None or self.synth_rates) and not self.enabled:
            raise InvalidInputError("--spec-synth-len/--spec-synth-rates need a --spec-type")
        synth_rates(self.synth_len, self.synth_rates, self.n_max)  # checks them

    @property
    def enabled(self) -> bool:
        """Whether speculative decoding is on."""
        return self.spec_type != "none"

    @property
    def limits(self) -> DraftLimits:
        """The draft limits of the flags."""
        return DraftLimits(self.n_max, self.n_min, self.p_min)

    @property
    def synth_probs(self) -> list[float]:
        """Per draft position, the probability of keeping it given the ones before were kept
        (empty: the real acceptance rule)."""
        return synth_conditional(synth_rates(self.synth_len, self.synth_rates, self.n_max))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The speculative decoding flags (llama.cpp's names)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec-type", choices=SPEC_TYPES, default="none", help="what drafts tokens")
    g.add_argument("--spec-draft-n-max", type=int, default=3, help="tokens drafted per step")
    g.add_argument(
        "--spec-draft-n-min", type=int, default=0, help="a shorter draft is not verified"
    )
    g.add_argument(
        "--spec-draft-p-min",
        type=float,
        default=0.0,
        help="stop drafting below this probability of the draft's top token",
    )
    g.add_argument(
        "--spec-draft-n-auto",
        action="store_true",
        help="each step drafts the length (0, n-min..n-max) with the most tokens per second, "
        "from the steps' measured costs and acceptance",
    )
    g.add_argument(
        "-md", "--spec-draft-model", default=None, metavar="FILE", help="draft-simple's model"
    )
    g.add_argument("--spec-ngram-simple-size-n", type=int, default=12, help="n-gram looked up")
    g.add_argument("--spec-ngram-simple-size-m", type=int, default=48, help="tokens copied")
    g.add_argument(
        "--spec-synth-len",
        type=float,
        default=None,
        metavar="L",
        help="benchmarks: mean synthetic acceptance length, the target's token included",
    )
    g.add_argument(
        "--spec-synth-rates",
        default=None,
        metavar="P0,P1,...",
        help="benchmarks: per-position synthetic acceptance probabilities (not increasing)",
    )


def from_args(args: argparse.Namespace) -> SpecOptions:
    """The options of parsed :func:`add_arguments` flags."""
    rates: tuple[float, ...] = ()
    if args.spec_synth_rates:
        try:
            rates = tuple(float(r) for r in args.spec_synth_rates.split(","))
        except ValueError:
            raise InvalidInputError(
                f"--spec-synth-rates {args.spec_synth_rates!r}: expected numbers such as "
                "0.8,0.6,0.4"
            ) from None
    return SpecOptions(
        spec_type=args.spec_type,
        n_max=args.spec_draft_n_max,
        n_min=args.spec_draft_n_min,
        p_min=args.spec_draft_p_min,
        n_auto=args.spec_draft_n_auto,
        draft_model=args.spec_draft_model,
        synth_len=args.spec_synth_len,
        synth_rates=rates,
        ngram_size_n=args.spec_ngram_simple_size_n,
        ngram_size_m=args.spec_ngram_simple_size_m,
    )
