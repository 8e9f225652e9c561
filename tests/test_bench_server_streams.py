"""benches/bench_server_streams.py's counting: a stream's tokens are its usage's (a chunk can
carry several under speculative decoding), llama-server's timings give its own rate and draft
counts, the llama.cpp server a row's ratios are against is the fastest within FreeToken's
peak VRAM + 5%, and a split row is held to max(upload, CPU) + the all-resident step."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

import bench_server_streams as bss  # noqa: E402  (benches/ is not a package)


def _text(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}


def _read(chunks: list[tuple[float, dict[str, Any]]]) -> bss.Streamed:
    s = bss.Streamed()
    for t, ch in chunks:
        s.add(ch, t)
    return s


def test_tokens_are_the_usage_not_the_chunks() -> None:
    # FreeToken's shape: the prompt step's token, then chunks of several accepted tokens, the
    # finish chunk with the usage, then the usage-only chunk (empty choices).
    usage = {"usage": {"prompt_tokens": 5, "completion_tokens": 9}}
    s = _read(
        [
            (1.0, _text("a")),
            (1.5, _text("bcd")),
            (2.0, _text("ef")),
            (2.5, _text("ghi", "length") | usage),
            (2.5, {"choices": []} | usage),
        ]
    )
    assert (s.first, s.last, s.tokens, s.timings) == (1.0, 2.5, 9, None)
    row = bss.tally([s])
    assert row["tokens"] == [9]
    assert row["span_s"] == 1.5
    assert row["aggregate_tps"] == 8 / 1.5  # the tokens after the first over the span
    assert row["per_stream_tps"] == 8 / 1.5
    assert "server_tps" not in row and "drafted" not in row


def test_llama_server_timings_and_draft_counts() -> None:
    # llama-server's shape: one chunk a token, then a final chunk with no text that carries
    # the usage and its timings (draft_n only when it drafted).
    def final(n: int, tps: float, drafted: int | None) -> dict[str, Any]:
        timings: dict[str, Any] = {"predicted_n": n, "predicted_per_second": tps}
        if drafted is not None:
            timings |= {"draft_n": drafted, "draft_n_accepted": drafted // 2}
        return _text("", "length") | {"usage": {"completion_tokens": n}, "timings": timings}

    a = _read([(0.0, _text("x")), (1.0, _text("y")), (2.0, _text("z")), (2.1, final(3, 1.0, 6))])
    b = _read([(1.0, _text("x")), (4.0, _text("y")), (4.2, final(2, 0.5, None))])
    row = bss.tally([a, b])
    assert row["tokens"] == [3, 2]
    assert row["span_s"] == 4.0  # first chunk of a to the last text chunk of b
    assert row["aggregate_tps"] == (2 + 1) / 4.0
    assert row["per_stream_tps"] == (2 / 2.0 + 1 / 3.0) / 2
    assert row["decode_step_ms"] == 4.0 / 2 * 1e3  # a's two tokens after its first: two steps
    assert row["server_tps"] == 0.75
    assert (row["drafted"], row["accepted"]) == (6, 3)


def test_a_stream_without_text_counts_nothing() -> None:
    empty = _read([(1.0, {"choices": []} | {"usage": {"completion_tokens": 0}})])
    row = bss.tally([empty])
    assert row["aggregate_tps"] is None and row["per_stream_tps"] is None


def _rows(label: str, engine: str, tps: list[float]) -> list[dict[str, Any]]:
    return [{"engine": engine, "server": label, "aggregate_tps": v} for v in tps]


def test_reference_is_the_fastest_within_our_vram() -> None:
    group = {
        "llama.cpp -ncmoe 26": _rows("llama.cpp -ncmoe 26", "llama.cpp", [90, 91, 92]),
        "llama.cpp -ncmoe 28": _rows("llama.cpp -ncmoe 28", "llama.cpp", [80, 81, 82]),
        "llama.cpp -ncmoe 31": _rows("llama.cpp -ncmoe 31", "llama.cpp", [70, 71, 72]),
        "freetoken": _rows("freetoken", "freetoken", [60, 61, 62]),
    }
    vram = {
        "llama.cpp -ncmoe 26": 9500,
        "llama.cpp -ncmoe 28": 9100,  # within 8800 + 5%
        "llama.cpp -ncmoe 31": 7400,
        "freetoken": 8800,
    }
    assert bss.reference(group, "aggregate_tps", vram) == "llama.cpp -ncmoe 28"
    # None fits: the lowest-VRAM server.
    assert bss.reference(group, "aggregate_tps", vram | {"freetoken": 5000}) == (
        "llama.cpp -ncmoe 31"
    )
    # Several llama.cpp servers and no VRAM figures: nothing to choose by.
    assert bss.reference(group, "aggregate_tps", {}) is None
    # One llama.cpp server is the reference whatever its VRAM.
    one = {k: v for k, v in group.items() if k in ("llama.cpp -ncmoe 26", "freetoken")}
    assert bss.reference(one, "aggregate_tps", {}) == "llama.cpp -ncmoe 26"


def test_one_llama_server_per_ncmoe_value() -> None:
    args = argparse.Namespace(
        llama_server="llama-server",
        llama_args="-ngl 99 -fa off",
        ncmoe="26,31",
        freetoken_args="--moe-strategy hybrid",
        resident_args=None,
    )
    assert bss.server_specs(args) == [
        ("llama.cpp", "llama.cpp -ncmoe 26", ["-ngl", "99", "-fa", "off", "-ncmoe", "26"]),
        ("llama.cpp", "llama.cpp -ncmoe 31", ["-ngl", "99", "-fa", "off", "-ncmoe", "31"]),
        ("freetoken", "freetoken", ["--moe-strategy", "hybrid"]),
    ]
    args.ncmoe = None
    assert [label for _, label, _ in bss.server_specs(args)] == ["llama.cpp", "freetoken"]
    args.resident_args = "--moe-strategy gpu"
    assert bss.server_specs(args)[-1] == ("freetoken", bss.RESIDENT, ["--moe-strategy", "gpu"])
    args.resident_args = None
    args.llama_server = None
    assert [label for _, label, _ in bss.server_specs(args)] == ["freetoken"]


def test_split_row_against_its_bound() -> None:
    # Two rounds of a 16-stream split row: the medians of each field; the bound is the larger
    # side plus the all-resident step.
    splits = [
        {"uploaded_mb": 100, "upload_ms": 8.0, "cpu_mb": 300, "cpu_ms": 20.0, "step_ms": 40.0},
        {"uploaded_mb": 120, "upload_ms": 10.0, "cpu_mb": 280, "cpu_ms": 18.0, "step_ms": 36.0},
    ]
    rows = [{"split": s} for s in splits]
    cell = bss._split_cell(rows, 12.0)
    assert "step 38.0 ms" in cell
    assert "bound 31.0 ms (resident 12.0)" in cell  # max(9, 19) + 12
    assert cell.endswith(f"{38.0 / 31.0:.2f}x")
    assert "bound" not in bss._split_cell(rows, None)
    table = bss.table(
        [
            {
                "kind": "decode",
                "streams": 16,
                "engine": "freetoken",
                "server": "freetoken",
                "aggregate_tps": 300.0,
                "split": splits[0],
            },
            {
                "kind": "decode",
                "streams": 16,
                "engine": "freetoken",
                "server": bss.RESIDENT,
                "aggregate_tps": 900.0,
                "decode_step_ms": 12.0,
            },
        ],
        {},
        {},
    )
    assert "bound 32.0 ms (resident 12.0), 1.25x" in table  # max(8, 20) + 12


def test_table_of_a_saved_run(tmp_path: Path, capsys: Any) -> None:
    # A run cut after two rounds: the table is the medians of what the file holds, with the
    # peaks saved beside the rounds.
    rows = [
        {"kind": "decode", "streams": 4, "engine": e, "server": e, "aggregate_tps": v}
        for e, vals in (("llama.cpp", (100.0, 120.0)), ("freetoken", (130.0, 150.0)))
        for v in vals
    ]
    doc = {"rows": rows, "vram_mib": {"freetoken": 9000}, "rss_mib": {"llama.cpp": 20000.0}}
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(doc))
    argv = sys.argv
    sys.argv = ["bench_server_streams.py", "--table", str(path)]
    try:
        assert bss.main() == 0
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    mine = next(line for line in out.splitlines() if "| freetoken |" in line)
    cells = [c.strip() for c in mine.strip("|").split("|")]
    assert cells[3:5] == ["2/2", "140.0"]  # median of 130 and 150
    assert cells[7] == f"{140.0 / 110.0:.2f}"  # against llama.cpp's median
    assert cells[10] == "9000"
    assert "| llama.cpp (ref) |" in out and "| 20000 |" in out
