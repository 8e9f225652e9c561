"""The GPU expert slot cache's replacement policies under hybrid decode, simulated (no GPU):
LRU against the adaptive policy (crates/ft-core/src/slot_policy.rs) on synthetic route traces.

Per token, every MoE layer of one pool routes ``top_k`` distinct experts, drawn without
replacement in proportion to a per-layer popularity (Gumbel top-k): Zipf-like shares as
``make-test-model --routing skewed`` draws them (``zipf_shares``, s 0.55 by default, and a
steeper s 1.0), each layer with its own random ranking of the experts, or uniform. ``drift``
is skewed (s 0.55) with a new ranking in every layer halfway.

Each token is one hybrid step: ``lookup`` of every layer (hits run on the GPU, misses on the
CPU), then ``admit`` of every layer's misses (the uploads after the token). ``lru`` admits
every miss over the least recently used resident; ``adaptive`` by aged route counts. The hit
rate is routes hit over routes after the warm-up; ``static best`` is the hit rate of the best
fixed set of ``n_slots`` experts for the measured window (from its own route counts: no policy
without foresight beats it on a stationary trace), ``uploads/tok`` the experts uploaded per
token. ``--seeded`` adds pools seeded from a profile (``seed``, the hottest experts by the
route counts of 2000 earlier tokens of the same routing), measured from the first token.

    python benches/cache_policy.py [--layers 4] [--tokens 4000] [--warmup 1000] [--json FILE]

Figures in benches/README.md, "Expert cache policy (simulation)".
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from freetoken.runtime.slots import SlotCache
from freetoken.testmodel.routing import ZIPF_S, zipf_shares

EXPERTS, TOP_K = 128, 8
SIZES = (0.10, 0.25, 0.50)


def draw(rng: np.random.Generator, shares: np.ndarray, n_tokens: int, top_k: int) -> np.ndarray:
    """``(n_tokens, top_k)`` distinct experts per token, drawn without replacement in
    proportion to ``shares`` (Gumbel top-k)."""
    keys = np.log(shares) + rng.gumbel(size=(n_tokens, shares.size))
    return np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k].astype(np.int32)


def trace(kind: str, n_layers: int, n_tokens: int, seed: int) -> np.ndarray:
    """Routes ``(n_tokens, n_layers, TOP_K)`` of a trace kind: ``uniform``, ``zipf-S`` or
    ``drift`` (zipf 0.55, re-ranked halfway)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n_tokens, n_layers, TOP_K), dtype=np.int32)
    for layer in range(n_layers):
        if kind == "uniform":
            out[:, layer] = draw(rng, np.full(EXPERTS, 1.0 / EXPERTS), n_tokens, TOP_K)
            continue
        s = ZIPF_S if kind == "drift" else float(kind.removeprefix("zipf-"))
        shares = zipf_shares(EXPERTS, TOP_K, s)
        if kind == "drift":
            half = n_tokens // 2
            out[:half, layer] = draw(rng, rng.permutation(shares), half, TOP_K)
            out[half:, layer] = draw(rng, rng.permutation(shares), n_tokens - half, TOP_K)
        else:
            out[:, layer] = draw(rng, rng.permutation(shares), n_tokens, TOP_K)
    return out


def simulate(
    cache: SlotCache, routes: np.ndarray, warmup: int, max_uploads: int | None = None
) -> dict[str, np.ndarray | float]:
    """Runs hybrid steps over ``routes`` ``(tokens, layers, top_k)``; returns per-token hits
    and uploads, and the hit rate and uploads per token after ``warmup`` tokens."""
    n_tokens, n_layers, top_k = routes.shape
    hits = np.zeros(n_tokens, dtype=np.int64)
    uploads = np.zeros(n_tokens, dtype=np.int64)
    for t in range(n_tokens):
        missed = []
        for layer in range(n_layers):
            slots, h = cache.lookup(layer, routes[t, layer])
            hits[t] += h
            missed.append(routes[t, layer][slots[0] < 0])
        for layer in range(n_layers):
            uploads[t] += len(cache.admit(layer, missed[layer], max_uploads))
    per_token = n_layers * top_k
    return {
        "hits": hits,
        "uploads": uploads,
        "hit_rate": float(hits[warmup:].sum() / (per_token * (n_tokens - warmup))),
        "uploads_per_token": float(uploads[warmup:].mean()),
    }


def static_best(routes: np.ndarray, n_slots: int) -> float:
    """The hit rate of the best fixed set of ``n_slots`` (layer, expert) pairs on ``routes``."""
    n_layers = routes.shape[1]
    keys = routes + (np.arange(n_layers) * EXPERTS)[None, :, None]
    counts = np.bincount(keys.ravel(), minlength=n_layers * EXPERTS)
    return float(np.sort(counts)[::-1][:n_slots].sum() / routes.size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="MoE layers sharing the pool")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max-uploads", type=int, default=None, help="per layer and token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--half-life", type=float, default=None)
    ap.add_argument("--margin", type=float, default=None)
    ap.add_argument("--traces", default="zipf-0.55,zipf-1.0,uniform,drift")
    ap.add_argument("--seeded", action="store_true", help="also profile-seeded pools")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    rows = []
    print(
        f"{args.layers} layers x {EXPERTS} experts, top-{TOP_K}, one shared pool; "
        f"{args.tokens} tokens, hit rates after {args.warmup}"
    )
    print(
        f"{'trace':<11} {'pool':>10} {'LRU':>7} {'adaptive':>8} {'ratio':>6} {'static best':>11} "
        f"{'uploads/tok LRU':>15} {'adaptive':>8}"
    )
    for kind in args.traces.split(","):
        routes = trace(kind, args.layers, args.tokens, args.seed)
        for frac in SIZES:
            n_slots = round(frac * args.layers * EXPERTS)
            lru = simulate(SlotCache(n_slots, EXPERTS), routes, args.warmup, args.max_uploads)
            ada_cache = SlotCache(
                n_slots, EXPERTS, "adaptive", half_life=args.half_life, margin=args.margin
            )
            ada = simulate(ada_cache, routes, args.warmup, args.max_uploads)
            window = routes[args.warmup :]
            # Under drift the window is two stationary halves: the best fixed set of each.
            if kind == "drift":
                half = args.tokens // 2 - args.warmup
                best = (
                    static_best(window[:half], n_slots) * half
                    + static_best(window[half:], n_slots) * (len(window) - half)
                ) / len(window)
            else:
                best = static_best(window, n_slots)
            row = {
                "trace": kind,
                "pool": frac,
                "n_slots": n_slots,
                "lru": lru["hit_rate"],
                "adaptive": ada["hit_rate"],
                "static_best": best,
                "lru_uploads_per_token": lru["uploads_per_token"],
                "adaptive_uploads_per_token": ada["uploads_per_token"],
            }
            if kind == "drift":
                # Hit rate per 250-token window from the change on: how fast each recovers.
                change = args.tokens // 2
                per = args.layers * TOP_K * 250
                row["after_change"] = {
                    name: [
                        round(float(r["hits"][a : a + 250].sum() / per), 3)  # type: ignore[index]
                        for a in range(change, args.tokens, 250)
                    ]
                    for name, r in (("lru", lru), ("adaptive", ada))
                }
            rows.append(row)
            print(
                f"{kind:<11} {f'{frac:.0%} ({n_slots})':>10} {row['lru']:7.3f} "
                f"{row['adaptive']:8.3f} {row['adaptive'] / row['lru']:6.3f} {best:11.3f} "
                f"{row['lru_uploads_per_token']:15.2f} {row['adaptive_uploads_per_token']:8.2f}"
            )
    for row in rows:
        if "after_change" in row:
            print(f"drift, pool {row['pool']:.0%}: hit rate per 250 tokens after the change")
            for name, seq in row["after_change"].items():
                print(f"  {name:<8} " + " ".join(f"{x:.3f}" for x in seq))
    seeded = seeded_rows(args) if args.seeded else []
    print(f"{time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "seeded": seeded}, f, indent=1)


def seeded_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    """Pools seeded with the hottest experts of a 2000-token profile of the same routing
    (zipf 0.55), then run from the first token: LRU, adaptive, adaptive with the profile's
    rates (``seed(residents, rates)``), and the seed kept fixed (no uploads)."""
    n_profile, first = 2000, 200
    full = trace(f"zipf-{ZIPF_S}", args.layers, n_profile + args.tokens, args.seed)
    profile, routes = full[:n_profile], full[n_profile:]
    keys = profile + (np.arange(args.layers) * EXPERTS)[None, :, None]
    counts = np.bincount(keys.ravel(), minlength=args.layers * EXPERTS)
    print(
        f"seeded from a {n_profile}-token profile, zipf {ZIPF_S}: hit rate over the first "
        f"{first} tokens / all {args.tokens}"
    )
    print(f"{'pool':>10} {'LRU':>11} {'adaptive':>11} {'+ rates':>11} {'fixed seed':>11}")
    rows = []
    for frac in SIZES:
        n_slots = round(frac * args.layers * EXPERTS)
        top = np.argsort(-counts, kind="stable")[:n_slots]
        residents = [(int(k) // EXPERTS, int(k) % EXPERTS) for k in top]
        rates = [float(counts[k]) / n_profile for k in top]
        row: dict[str, object] = {"pool": frac, "n_slots": n_slots}
        cells = []
        for name, policy, r, cap in (
            ("lru", "lru", None, args.max_uploads),
            ("adaptive", "adaptive", None, args.max_uploads),
            ("adaptive_rates", "adaptive", rates, args.max_uploads),
            ("fixed", "lru", None, 0),
        ):
            cache = SlotCache(n_slots, EXPERTS, policy)
            cache.seed(residents, r)
            h = simulate(cache, routes, 0, cap)["hits"]
            per = args.layers * TOP_K
            pair = (float(h[:first].sum() / (first * per)), float(h.sum() / (len(h) * per)))
            row[name] = pair
            cells.append(f"{pair[0]:.3f}/{pair[1]:.3f}")
        rows.append(row)
        print(f"{f'{frac:.0%} ({n_slots})':>10} " + " ".join(f"{c:>11}" for c in cells))
    return rows


if __name__ == "__main__":
    main()
