"""benches/spy_summary.py's counting of py-spy's raw samples: each thread's total, the
samples inside a named function (by its plain or qualified name, counted once a sample
however deep it recurses), and each sample's deepest frame from the matched files."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

import spy_summary  # noqa: E402  (benches/ is not a package)

ENGINE = 'process 7:"python -m freetoken serve";thread (11): freetoken-engine'
RUN = "Scheduler._step (freetoken/server/scheduler.py:570)"
FWD = "Transformer.forward_batch (freetoken/models/transformer.py:470)"
MM = "linear_group (freetoken/models/layers.py:82)"
TORCH = "Tensor.max (torch/_tensor.py:10)"
SAMPLE = "Sampler._sample_rows (freetoken/runtime/sampler.py:418)"
LINES = [
    f"{ENGINE};{RUN};{FWD};{MM} 30\n",
    f"{ENGINE};{RUN};{FWD};{FWD};{MM} 5\n",  # recursion: still 5 samples inside
    f"{ENGINE};{RUN};{SAMPLE};{TORCH} 7\n",  # the deepest freetoken frame is the sampler's
    "thread (3): MainThread;run (asyncio/base_events.py:600) 4\n",
    "\n",
]


def test_threads_inside_and_leaves() -> None:
    threads = spy_summary.read(LINES, ["forward_batch", "Sampler._sample_rows", "absent"])
    assert set(threads) == {ENGINE, "thread (3): MainThread"}
    eng = threads[ENGINE]
    assert eng.total == 42
    assert eng.inside == {"forward_batch": 35, "Sampler._sample_rows": 7}
    assert eng.leaves == {MM: 35, SAMPLE: 7}
    main = threads["thread (3): MainThread"]
    # No frame from a freetoken file: the deepest frame stands.
    assert main.total == 4 and main.leaves == {"run (asyncio/base_events.py:600)": 4}


def test_the_summary_lists_the_busiest_thread_first() -> None:
    text = spy_summary.summarize(spy_summary.read(LINES, ["forward_batch"]), top=1)
    first, second = (text.index(f"## {t}") for t in (ENGINE, "thread (3): MainThread"))
    assert first < second
    assert "- inside `forward_batch`: 35 (83.3%)" in text
    assert f"| 35 | 83.3% | `{MM}` |" in text and SAMPLE not in text  # top 1
