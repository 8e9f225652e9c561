"""FreeToken's ``--moe-strategy hybrid`` against llama.cpp's ``--n-cpu-moe``, side by side.

Per model (``--model``, repeatable: e.g. a uniform- and a zipf-routing model): llama-bench with
every layer on the GPU but the experts of the first N layers on the CPU (``-ncmoe N``, one
process per N), and ``freetoken bench`` per configuration (``--configs``: a strategy,
``+adaptive`` for ``--moe-cache-adaptive``, ``+profile`` for ``--moe-cache-profile`` with a
profile made once by ``freetoken profile`` on other text, ``+tN`` for ``-t N`` (without it
FreeToken picks its own threads; ``-t`` is llama.cpp's): ``hybrid+profile+t8,hybrid+profile+t12``
sweeps the executor's threads, ``+pollN``
for ``--poll N``, how long idle CPU workers poll before they sleep, ``+nommap`` for
``--no-mmap``) with a GPU expert cache of ``--fraction`` of all expert bytes;
``--prompt 512,4096`` adds each row's prompt tokens/s (ratios against the tg reference's
llama.cpp row). Peak VRAM is polled with ``nvidia-smi`` (``run_with_vram`` of
bench_gpu_vs_llamacpp.py). Each FreeToken row's tg ratio is against llama.cpp's best tg among
the N whose peak VRAM is within the hybrid run's peak VRAM + 5% (the lowest-VRAM llama.cpp
row when none is). Optionally (first model only) the hand-off's cost per
MoE layer: ``gpu`` against ``hybrid`` with every expert resident, so every route hits and the
CPU answers empty requests. With ``--time-model`` (the default) ``freetoken bench-bw`` runs
first on each model (each round), and each hybrid row gets the time model beside its
measured step, t = (D + A) / B_g + (1 - h) R / B_c: D the dense weight bytes, A the KV bytes
a token reads (float32 cache, the mean position of the tg run), R the routed expert bytes per
token, h the row's hit rate, B_g and B_c bench-bw's device and host read bandwidths
(``gpu_t1`` and ``cpu_t1_with_gpu``) of the same round. ``--rounds N`` runs every row N
times, in turn (the host's speed drifts within a lease), and reports each row's median round.
A failed run leaves its error in its row; the table and the JSON are still written.

    python3 benches/bench_hybrid.py --model UNIFORM.gguf --model ZIPF.gguf \\
        --llama-bench PATH -n 64 -r 3 -t 16 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_vs_llamacpp import run_with_vram

_MIB = 1 << 20
#: Slack over the hybrid run's peak VRAM within which a llama.cpp row may be the reference.
VRAM_SLACK = 0.05
#: Runs llama-bench as its only child and writes that child's peak RSS (KiB) to argv[1].
_RSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[2:]).returncode\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(rc if rc >= 0 else 128 - rc)\n"
)


class _Tee(io.TextIOBase):
    """Writes to ``out`` and keeps the text, for a failed run's error."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.buf = io.StringIO()

    def write(self, s: str) -> int:
        self.out.write(s)
        return self.buf.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def _stderr_kept() -> Iterator[_Tee]:
    tee = _Tee(sys.stderr)
    sys.stderr = tee
    try:
        yield tee
    finally:
        sys.stderr = tee.out


def _run(cmd: list[str], row: dict[str, Any]) -> str | None:
    """``run_with_vram(cmd)``: its stdout, with ``peak_vram_mib`` set in ``row``; on failure
    None, with the error in ``row["error"]`` and the end of the run's stderr in
    ``row["stderr"]``."""
    print(f"bench_hybrid: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with _stderr_kept() as tee:
        try:
            out, vram = run_with_vram(cmd)
        except (Exception, SystemExit) as e:
            # run_with_vram exits with "failed (STATUS): COMMAND"; the command is in the row.
            msg = str(e).split(": ", 1)[0] if isinstance(e, SystemExit) else str(e)
            row["error"] = f"{type(e).__name__}: {msg}"
            row["stderr"] = tee.buf.getvalue()[-4000:].strip()
            return None
    row["peak_vram_mib"] = vram
    return out


def model_info(path: str) -> dict[str, Any]:
    """Layer count, MoE layer count, expert bytes (tensors named ``*_exps.*``) and the bytes
    of one position of a float32 KV cache over all layers."""
    from freetoken.gguf import GGUFFile

    f = GGUFFile(path)
    meta, arch = f.metadata, f.architecture
    n_layers = int(meta[f"{arch}.block_count"])
    exps = [t for name, t in f.tensors.items() if "_exps." in name]
    moe_layers = {t.name.split(".")[1] for t in exps if t.name.startswith("blk.")}
    heads = int(meta[f"{arch}.attention.head_count"])
    # A per-layer array where layers differ (Gemma 4): their sum, at the full layers' head
    # sizes (an upper bound where sliding layers have smaller heads).
    kv = meta.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = sum(map(int, kv)) / n_layers if isinstance(kv, list) else int(kv)
    k_len = int(
        meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads)
    )
    v_len = int(meta.get(f"{arch}.attention.value_length", k_len))
    # The Gated DeltaNet hybrids cache keys and values in every interval-th layer only.
    attn_layers = n_layers
    if f"{arch}.ssm.conv_kernel" in meta:
        attn_layers = n_layers // int(meta.get(f"{arch}.full_attention_interval", 4))
    return {
        "n_layers": n_layers,
        "n_moe_layers": len(moe_layers),
        "expert_bytes": sum(t.nbytes for t in exps),
        "kv_bytes_per_position": int(attn_layers * kv_heads * (k_len + v_len) * 4),
    }


def bandwidths(model: str) -> dict[str, Any]:
    """``freetoken bench-bw`` of ``model``: its one layer kind's figures, or an error."""
    cmd = [sys.executable, "-m", "freetoken", "bench-bw", "-m", model, "-o", "json"]
    row: dict[str, Any] = {"cmd": cmd}
    out = _run(cmd, row)
    if out is None:
        return row
    try:
        kinds = json.loads(out.strip().splitlines()[-1])["kinds"]
        if len(kinds) != 1:
            return row | {"error": f"{len(kinds)} layer kinds: the time model takes one"}
        (k,) = kinds.values()
        return row | {
            "b_gpu_gbps": k["gpu_t1"]["gbps"],
            "b_cpu_gbps": k["cpu_t1_with_gpu"]["gbps"],
            "routed_bytes": len(k["layers"]) * k["top_k"] * k["expert_bytes"],
        }
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return row | {"error": f"{type(e).__name__}: {e}", "stderr": out[-2000:]}


def time_model(rows: list[dict[str, Any]], bw: dict[str, Any] | None, kv: float) -> None:
    """The time model beside each row with a hit rate (``row["time_model"]``), with the
    bandwidths ``bw`` of the same round and ``kv`` KV bytes read a token."""
    if not bw or "b_cpu_gbps" not in bw:
        return
    for r in rows:
        if r.get("hit_rate") is None or not r.get("tg") or not r.get("dense_bytes"):
            continue
        gpu_s = (r["dense_bytes"] + kv) / (bw["b_gpu_gbps"] * 1e9)
        cpu_s = (1 - r["hit_rate"]) * bw["routed_bytes"] / (bw["b_cpu_gbps"] * 1e9)
        r["time_model"] = {
            "kv_bytes": kv,
            "b_gpu_gbps": bw["b_gpu_gbps"],
            "b_cpu_gbps": bw["b_cpu_gbps"],
            "cpu_ms": cpu_s * 1e3,
            "model_ms": (gpu_s + cpu_s) * 1e3,
            "measured_ms": 1e3 / r["tg"],
            "ratio": (1 / r["tg"]) / (gpu_s + cpu_s),
        }


def print_time_model(entry: dict[str, Any]) -> None:
    for err in dict.fromkeys(_error_line(bw)[:200] for bw in entry["bandwidth"] if "error" in bw):
        print(f"\ntime model: bench-bw failed: {err}")
    rows = [r for r in entry["rows"] if r.get("time_model")]
    if not rows:
        return
    routed = next(bw["routed_bytes"] for bw in entry["bandwidth"] if "routed_bytes" in bw)
    print(
        f"\ntime model ({entry['label']}): t = (D + A) / B_g + (1 - h) R / B_c, R "
        f"{routed / 1e9:.3f} GB; B_g, B_c: bench-bw in the row's round\n"
    )
    first = rows[0]["time_model"]
    step, fixed = "b_gpu_step_gbps" in first, "fixed_ms" in first
    if step:
        print(
            "B_g (step): the all-resident gpu decode's bytes over its time, "
            f"{first['b_gpu_step_gbps']:.0f} GB/s\n"
        )
    if fixed:
        print(
            "fixed: the all-resident gpu step plus the hand-off in every MoE layer, measured, "
            f"{first['fixed_ms']:.2f} ms; model fixed + (1 - h) R / B_c\n"
        )
    extra = " model ms, B_g (step) | ratio |" * step + " model ms, fixed | ratio |" * fixed
    print(
        "| config | h | D + A, GB | B_g GB/s | B_c GB/s | model ms | measured ms | ratio |" + extra
    )
    print(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + " ---: | ---: |" * (step + fixed)
    )
    for r in rows:
        tm = r["time_model"]
        more = f" {tm['model_step_ms']:.2f} | {tm['ratio_step']:.2f} |" if step else ""
        if fixed:
            more += f" {tm['model_fixed_ms']:.2f} | {tm['ratio_fixed']:.2f} |"
        print(
            f"| {r['config']} | {r['hit_rate']:.3f} | "
            f"{(r['dense_bytes'] + tm['kv_bytes']) / 1e9:.3f} | {tm['b_gpu_gbps']:.0f} | "
            f"{tm['b_cpu_gbps']:.1f} | {tm['model_ms']:.2f} | {tm['measured_ms']:.2f} | "
            f"{tm['ratio']:.2f} |" + more
        )


def kv_bytes(entry: dict[str, Any]) -> float:
    """KV bytes a token of the tg run reads: the cache at the run's mean position."""
    return entry["kv_bytes_per_position"] * entry["n"] / 2


def decode_bandwidth(entry: dict[str, Any]) -> float | None:
    """The device read bandwidth of a whole decode step (GB/s): the bytes the all-resident
    ``gpu`` step of the hand-off measurement reads (dense weights, KV, the routed experts) over
    its time. Small launch-bound kernels get far less than bench-bw's expert kernels."""
    gpu_row = (entry.get("handoff") or {}).get("gpu") or {}
    routed = [bw["routed_bytes"] for bw in entry["bandwidth"] if "routed_bytes" in bw]
    if not gpu_row.get("tg") or not gpu_row.get("dense_bytes") or not routed:
        return None
    return (gpu_row["dense_bytes"] + kv_bytes(entry) + routed[0]) * gpu_row["tg"] / 1e9


def fixed_ms(handoff: dict[str, Any] | None, n_moe_layers: int) -> float | None:
    """The two fixed parts of a hybrid step that the time model leaves out, both measured:
    the all-resident ``gpu`` decode step and the hand-off's cost in every MoE layer (ms)."""
    gpu_row = (handoff or {}).get("gpu") or {}
    if not gpu_row.get("tg") or handoff is None or handoff.get("per_layer_us") is None:
        return None
    return 1e3 / gpu_row["tg"] + n_moe_layers * handoff["per_layer_us"] / 1e3


def step_model(rows: list[dict[str, Any]], b_step: float, fixed: float | None) -> None:
    """The time model again with ``b_step`` (:func:`decode_bandwidth`) for B_g, and with the
    measured fixed parts (:func:`fixed_ms`) in place of (D + A) / B_g."""
    for r in rows:
        tm = r.get("time_model")
        if not tm:
            continue
        tm["b_gpu_step_gbps"] = b_step
        tm["model_step_ms"] = (r["dense_bytes"] + tm["kv_bytes"]) / (b_step * 1e6) + tm["cpu_ms"]
        tm["ratio_step"] = tm["measured_ms"] / tm["model_step_ms"]
        if fixed is not None:
            tm["fixed_ms"] = fixed
            tm["model_fixed_ms"] = fixed + tm["cpu_ms"]
            tm["ratio_fixed"] = tm["measured_ms"] / tm["model_fixed_ms"]


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row, the round with the median tg (the lower middle one of an even count; a
    failed round only where every round failed), with every round's tg in ``tg_rounds``:
    rows run in turn each round, so drift of the host's speed reaches every row alike."""
    merged = []
    for runs in zip(*rounds, strict=True):
        ok = sorted((r for r in runs if r["tg"]), key=lambda r: r["tg"])
        row = dict(ok[(len(ok) - 1) // 2] if ok else runs[0])
        row["tg_rounds"] = [r["tg"] for r in runs]
        merged.append(row)
    return merged


def cache_mib(expert_bytes: int, fraction: float) -> int:
    """The hybrid GPU expert cache (MiB) of ``fraction`` of a model's expert bytes."""
    return int(fraction * expert_bytes / _MIB)


def default_ncmoe(n_layers: int, fraction: float) -> list[int]:
    """The layers whose experts llama.cpp keeps on the CPU: about the hybrid cache's share on
    the GPU, four more layers on the CPU, and all of them."""
    base = n_layers - round(fraction * n_layers)
    # Ours holds staging buffers and a CUDA context beside the cache: fewer CPU layers
    # (more VRAM) give llama.cpp the same budget.
    values = (base - 5, base - 3, base, n_layers)
    return sorted({min(max(v, 0), n_layers) for v in values})


def llama(args: argparse.Namespace, model: str, ncmoe: int) -> dict[str, Any]:
    prompts = ",".join(map(str, args.prompt)) or "0"
    cmd = [args.llama_bench, "-m", model, "-ngl", "99", "-ncmoe", str(ncmoe), "-fa", "0"]
    cmd += ["-p", prompts, "-n", str(args.n), "-r", str(args.r), "-t", str(args.threads)]
    cmd += ["-o", "json"]
    row: dict[str, Any] = {"engine": "llama.cpp", "config": f"-ncmoe {ncmoe}", "ncmoe": ncmoe}
    row |= {"cmd": cmd, "tg": None, "peak_vram_mib": None, "peak_rss_mib": None}
    fd, rss_path = tempfile.mkstemp(prefix="bench_hybrid_rss_")
    os.close(fd)
    try:
        out = _run([sys.executable, "-c", _RSS_WRAPPER, rss_path, *cmd], row)
        if out is None:
            return row
        try:
            results = json.loads(out)
            tg = [r for r in results if r["n_gen"] and not r["n_prompt"]]
            row["tg"] = tg[0]["avg_ts"]
            row["tg_stddev"] = tg[0].get("stddev_ts")
            row["pp"] = {r["n_prompt"]: r["avg_ts"] for r in results if not r["n_gen"]}
            row["build"] = results[0].get("build_commit")
            with open(rss_path) as f:
                row["peak_rss_mib"] = round(int(f.read()) / 1024, 1)
        except (ValueError, KeyError, IndexError, OSError) as e:
            row["error"] = f"{type(e).__name__}: {e}\nstdout: {out[-2000:]}"
    finally:
        os.unlink(rss_path)
    return row


def freetoken(
    args: argparse.Namespace, model: str, config: str, cache_mib: int | None
) -> dict[str, Any]:
    strategy, *mods = config.split("+")
    cmd = [sys.executable, "-m", "freetoken", "bench", "-m", model, "-r", str(args.r)]
    cmd += ["-o", "json"]
    cmd += [f"-t{m[1:]}" for m in mods if _THREADS.fullmatch(m)]
    cmd += [f"--poll={m[4:]}" for m in mods if _POLL.fullmatch(m)]
    cmd += ["--moe-strategy", strategy]
    if cache_mib is not None and strategy not in ("cpu", "gpu"):
        cmd += ["--moe-cache-mib", str(cache_mib)]
    if "adaptive" in mods:
        cmd += ["--moe-cache-adaptive"]
    if "nommap" in mods:
        cmd += ["--no-mmap"]
    row: dict[str, Any] = {"engine": "freetoken", "config": config, "strategy": strategy}
    row |= {"cmd": cmd, "tg": None, "peak_vram_mib": None, "peak_rss_mib": None}
    if "profile" in mods:
        prof = expert_profile(args, model, row)
        if prof is None:
            return row
        cmd += ["--moe-cache-profile", prof]
    row["cmd"] = [*cmd, "-p", "0", "-n", str(args.n)]
    out = _run(row["cmd"], row)
    if out is None:
        return row
    # Prompts in runs of their own (-n 0): the tg run's counters stay the decode steps'.
    row["pp"] = {}
    for n_prompt in args.prompt:
        pp_row: dict[str, Any] = {}
        pp_out = _run([*cmd, "-p", str(n_prompt), "-n", "0"], pp_row)
        if pp_out is None:
            row.setdefault("pp_errors", {})[n_prompt] = _error_line(pp_row)
            continue
        with contextlib.suppress(ValueError, KeyError, IndexError):
            row["pp"][n_prompt] = json.loads(pp_out.strip().splitlines()[-1])["pp_tokens_per_s"]
    try:
        res = json.loads(out.strip().splitlines()[-1])
        row["tg"] = res["decode_tokens_per_s"]
        row["tg_stddev"] = res.get("decode_stddev")
        row["peak_rss_mib"] = res["peak_rss_mib"]
        row["placement"] = res.get("placement")
        row["dense_bytes"] = res.get("dense_bytes")
        row["expert_bytes"] = res.get("expert_bytes")
        hyb = res.get("hybrid")
        if hyb:
            row["hybrid"] = hyb
            row["hit_rate"] = hyb["hit_rate"]
            secs = hyb.get("decode_seconds") or 0.0
            row["cpu_busy_share"] = hyb["cpu_busy_s"] / secs if secs else None
            row["bookkeeping_share"] = hyb["bookkeeping_s"] / secs if secs else None
    except (ValueError, KeyError, IndexError) as e:
        row["error"] = f"{type(e).__name__}: {e}\nstdout: {out[-2000:]}"
    return row


#: A config's thread-count modifier: +t12 runs that row with 12 threads.
_THREADS = re.compile(r"t[1-9][0-9]*")
#: A config's polling modifier: +poll50 runs that row with --poll 50.
_POLL = re.compile(r"poll[0-9]+")

#: Text the expert-use profile is made on: not the benchmark's tokens (random ids).
_PROFILE_PROMPTS = [
    "The history of the printing press begins in the fifteenth century.",
    "def quicksort(items):\n    if len(items) < 2:\n        return items",
    "Explain how a heat pump moves heat from a cold place to a warm one.",
    "Le marché aux fleurs ouvre tôt le dimanche matin.",
    "List three prime numbers greater than one hundred and explain why.",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "The committee will meet again after the summer recess to vote.",
    "Once upon a time a fox found a bell in the snow.",
]


def expert_profile(args: argparse.Namespace, model: str, row: dict[str, Any]) -> str | None:
    """``freetoken profile`` of ``model`` (all experts on the GPU) on other text, made once
    next to the model; None (the error in ``row``) when it fails."""
    path = model + ".profile.json"
    if os.path.exists(path):
        return path
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(_PROFILE_PROMPTS) + "\n")
    cmd = [sys.executable, "-m", "freetoken", "profile", "-m", model, "--prompts", f.name]
    cmd += ["-n", "48", "-c", "512", "-o", path, "--moe-strategy", "gpu"]
    row["profile_cmd"] = cmd
    ok = _run(cmd, row) is not None
    os.unlink(f.name)
    return path if ok else None


def reference_within(
    rows: list[dict[str, Any]], speed: str, budget_mib: float | None, ours: str
) -> tuple[dict[str, Any] | None, str]:
    """The llama.cpp row ratios are against, of ``rows`` (successful runs, each with
    ``config``, ``peak_vram_mib`` and the figure ``speed``): the fastest within the peak VRAM
    ``budget_mib`` of ``ours`` + 5%, else (none fits, or ``budget_mib`` None: no run of ours
    succeeded) the lowest-VRAM row; None without rows. And why it was chosen."""
    if not rows:
        return None, "no llama.cpp run succeeded: no ratios"
    lowest = min(rows, key=lambda r: r["peak_vram_mib"])
    if budget_mib is None:
        return (
            lowest,
            f"no {ours} run succeeded: the lowest-VRAM llama.cpp row ({lowest['config']})",
        )
    budget = budget_mib * (1 + VRAM_SLACK)
    fit = [r for r in rows if r["peak_vram_mib"] <= budget]
    if not fit:
        return lowest, (
            f"no llama.cpp row within the {ours} peak VRAM {budget_mib} MiB + 5%: "
            f"the lowest-VRAM row ({lowest['config']}, {lowest['peak_vram_mib']} MiB)"
        )
    best = max(fit, key=lambda r: r[speed])
    return best, (
        f"llama.cpp {best['config']}: the best {speed} within the {ours} peak VRAM "
        f"{budget_mib} MiB + 5% ({budget:.0f} MiB)"
    )


def pick_reference(rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The llama.cpp row the ratios are against (None when no llama.cpp run succeeded), and
    why it was chosen: :func:`reference_within` the hybrid rows' peak VRAM."""
    llama_rows = [r for r in rows if r["engine"] == "llama.cpp" and r["tg"]]
    hybrid = [
        r["peak_vram_mib"]
        for r in rows
        if r["engine"] == "freetoken" and r["strategy"] == "hybrid" and r["tg"]
    ]
    return reference_within(llama_rows, "tg", max(hybrid) if hybrid else None, "hybrid")


def cell(v: Any, fmt: str) -> str:
    """A table cell: ``v`` formatted, or "-" for a missing figure."""
    return "-" if v is None else format(v, fmt)


def set_reference(entry: dict[str, Any]) -> None:
    """Picks the reference row and sets every row's tg ratio against it."""
    rows = entry["rows"]
    ref, why = pick_reference(rows)
    entry["reference"] = None
    if ref is not None:
        entry["reference"] = {
            "row": rows.index(ref),
            "config": ref["config"],
            "tg": ref["tg"],
            "peak_vram_mib": ref["peak_vram_mib"],
        }
    entry["reference_why"] = why
    for r in rows:
        r["ratio"] = r["tg"] / ref["tg"] if ref is not None and r["tg"] else None


def _error_line(row: dict[str, Any]) -> str:
    """The row's error and the last line of its stderr."""
    lines = (row.get("stderr") or "").strip().splitlines()
    return row["error"] + (f": {lines[-1]}" if lines else "")


def print_table(entry: dict[str, Any]) -> None:
    rows, ref = entry["rows"], entry["reference"]
    print(
        f"\n### {entry['label']}: {entry['n_layers']} layers ({entry['n_moe_layers']} MoE), "
        f"experts {entry['expert_bytes'] / _MIB:.0f} MiB, cache {entry['cache_mib']} MiB, "
        f"tg{entry['n']}, {entry['r']} repetitions, each row the median of "
        f"{len(entry['rounds'])} rounds"
    )
    print(f"reference: {entry['reference_why']}\n")
    print(
        "| engine / config | tg t/s | ratio | peak VRAM MiB | peak RSS MiB | hit rate "
        "| CPU busy share | step ms: CPU busy + rest |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(rows):
        is_ref = ref is not None and ref["row"] == i
        name = f"{r['engine']} {r['config']}" + (" (ref)" if is_ref else "")
        if r.get("error"):
            err = " ".join(_error_line(r).split())[:120].replace("|", "\\|")
            print(f"| {name} | failed: {err} | | | | | | |")
            continue
        print(
            f"| {name} | {cell(r['tg'], '.2f')}{_spread(r)} | {cell(r['ratio'], '.2f')} "
            f"| {cell(r['peak_vram_mib'], 'd')} | {cell(r['peak_rss_mib'], '.0f')} "
            f"| {cell(r.get('hit_rate'), '.1%')} | {cell(r.get('cpu_busy_share'), '.0%')} "
            f"| {_step_split(r)} |"
        )


def print_prompt_table(entry: dict[str, Any], prompts: list[int]) -> None:
    """Prompt tokens/s per row, each ratio against the tg reference's llama.cpp row."""
    if not prompts:
        return
    rows, ref = entry["rows"], entry["reference"]
    ref_pp = rows[ref["row"]].get("pp", {}) if ref is not None else {}
    print(f"\nprompts (ratios against {ref['config'] if ref else 'no reference'}):\n")
    print("| engine / config | " + " | ".join(f"pp{p} t/s | ratio" for p in prompts) + " |")
    print("| --- |" + " ---: | ---: |" * len(prompts))
    for r in rows:
        cells = []
        for p in prompts:
            v, base = (r.get("pp") or {}).get(p), ref_pp.get(p)
            cells += [cell(v, ".1f"), cell(v / base if v and base else None, ".2f")]
        print(f"| {r['engine']} {r['config']} | " + " | ".join(cells) + " |")


def _spread(row: dict[str, Any]) -> str:
    """The other rounds' range beside the median, when there were rounds."""
    tgs = [t for t in row.get("tg_rounds", []) if t]
    return f" ({min(tgs):.1f}-{max(tgs):.1f})" if len(tgs) > 1 else ""


def _step_split(row: dict[str, Any]) -> str:
    """A decode step's time: the CPU expert thread's busy time (the GPU waits on it, but for
    the hits it computes meanwhile) and the rest (GPU work and hand-offs, the CPU idle)."""
    share = row.get("cpu_busy_share")
    if not row.get("tg") or share is None:
        return "-"
    step = 1e3 / row["tg"]
    return f"{step:.2f} = {share * step:.2f} + {(1 - share) * step:.2f}"


def handoff_cost(args: argparse.Namespace, entry: dict[str, Any]) -> dict[str, Any]:
    """``gpu`` against ``hybrid`` with every expert resident: the hand-off's cost per MoE
    layer and step, (1/tg_hybrid - 1/tg_gpu) / MoE layers."""
    all_mib = int(entry["expert_bytes"] / _MIB) + 64
    gpu_row = freetoken(args, entry["path"], "gpu", None)
    hyb_row = freetoken(args, entry["path"], "hybrid", all_mib)
    res: dict[str, Any] = {"cache_mib": all_mib, "gpu": gpu_row, "hybrid_all": hyb_row}
    res["per_layer_us"] = None
    if gpu_row["tg"] and hyb_row["tg"] and entry["n_moe_layers"]:
        per_step = 1 / hyb_row["tg"] - 1 / gpu_row["tg"]
        res["per_layer_us"] = per_step / entry["n_moe_layers"] * 1e6
    print(f"\nhand-off cost ({entry['label']}, hybrid cache {all_mib} MiB: every expert resident)")
    for name, r in (("gpu", gpu_row), ("hybrid (all resident)", hyb_row)):
        if r.get("error"):
            print(f"  {name}: failed: {_error_line(r)[:200]}")
        else:
            hit = f", hit rate {r['hit_rate']:.2%}" if r.get("hit_rate") is not None else ""
            print(f"  {name}: tg {r['tg']:.2f} t/s, peak VRAM {r['peak_vram_mib']} MiB{hit}")
    if res["per_layer_us"] is not None:
        print(
            f"  (1/tg_hybrid - 1/tg_gpu) / {entry['n_moe_layers']} MoE layers = "
            f"{res['per_layer_us']:.1f} us per layer and step"
        )
        if hyb_row.get("hit_rate") is not None and hyb_row["hit_rate"] < 1.0:
            print("  note: the hybrid run missed some routes; the figure includes CPU work")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a GGUF (repeatable)")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=16, help="llama.cpp's threads")
    ap.add_argument(
        "--fraction", type=float, default=0.25, help="GPU expert cache, share of expert bytes"
    )
    ap.add_argument(
        "--ncmoe",
        help="comma-separated llama.cpp -ncmoe values (default: n_layers - round(fraction * "
        "n_layers), that + 4, and n_layers)",
    )
    ap.add_argument(
        "--configs",
        default="hybrid+adaptive,hybrid,offload,cpu",
        help="comma-separated freetoken --moe-strategy values (+adaptive: --moe-cache-adaptive, "
        "+profile: a seeding profile, +nommap: --no-mmap, +tN: -t N for FreeToken, +pollN: "
        "--poll N)",
    )
    ap.add_argument(
        "--handoff-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the hand-off cost per MoE layer on the first model",
    )
    ap.add_argument(
        "--time-model",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run freetoken bench-bw per model and set the time model beside each row",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every row this many times, in turn, and report each row's median round",
    )
    ap.add_argument(
        "--prompt",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="comma-separated prompt lengths: each row's prompt tokens/s too (llama-bench -p, "
        "freetoken bench -p N -n 0 per length)",
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if any(
            m not in ("adaptive", "profile", "nommap")
            and not (_THREADS.fullmatch(m) or _POLL.fullmatch(m))
            for m in c.split("+")[1:]
        ):
            ap.error(f"--configs {c}: modifiers are +adaptive, +profile, +nommap, +tN, +pollN")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    ncmoe_arg = [int(v) for v in args.ncmoe.split(",")] if args.ncmoe else None

    report: dict[str, Any] = {
        "n": args.n,
        "r": args.r,
        "threads": args.threads,
        "fraction": args.fraction,
        "prompts": args.prompt,
        "configs": configs,
        "rounds": args.rounds,
        "models": [],
    }

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    entries = []
    for model in args.model:
        entry: dict[str, Any] = {"label": os.path.basename(model), "path": model}
        entry |= {"n": args.n, "r": args.r, "rounds": [], "bandwidth": []}
        entry |= {"rows": [], "reference": None, "handoff": None}
        report["models"].append(entry)
        try:
            entry |= model_info(model)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"\n### {entry['label']}: cannot read the model: {entry['error']}")
            save()
            continue
        entry["cache_mib"] = cache_mib(entry["expert_bytes"], args.fraction)
        entry["ncmoe"] = ncmoe_arg or default_ncmoe(entry["n_layers"], args.fraction)
        entries.append(entry)
    for _ in range(args.rounds):
        for entry in entries:
            model = entry["path"]
            bw = bandwidths(model) if args.time_model else None
            if bw is not None:
                entry["bandwidth"].append(bw)
            rows: list[dict[str, Any]] = []
            entry["rounds"].append(rows)
            for v in entry["ncmoe"]:
                rows.append(llama(args, model, v))
                save()
            for c in configs:
                rows.append(freetoken(args, model, c, entry["cache_mib"]))
                save()
            time_model(rows, bw, kv_bytes(entry))
    b_step = None
    if entries and args.handoff_cost:
        entries[0]["handoff"] = handoff_cost(args, entries[0])
        b_step = decode_bandwidth(entries[0])
        report["b_gpu_step_gbps"] = b_step
    for entry in entries:
        entry["rows"] = merge_rounds(entry["rounds"])
        if b_step is not None:
            step_model(
                entry["rows"], b_step, fixed_ms(entries[0]["handoff"], entry["n_moe_layers"])
            )
        set_reference(entry)
        print_table(entry)
        print_prompt_table(entry, args.prompt)
        print_time_model(entry)
        save()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
