"""``top``'s plain functions over recorded metric pages: parsing, rates and window percentiles from
histogram buckets, the view model, the 80x24 layout, and runtime.log's warnings.

The pages in ``top_pages/`` were recorded from a real serve of the embedded default with ``--metrics``
(``runtime-*.prom``: the runtime's endpoint; ``engine-*.prom``: the KV, preemption and generated-token
series of vLLM's own /metrics), before and after six requests of 200 output tokens.
"""

from __future__ import annotations

import io
import math
import os
import random
import threading
from pathlib import Path

import pytest
from rich.console import Console

from carbonforge_runtime.core.quantiles import quantile
from carbonforge_runtime.offline.top import draw, fetch
from carbonforge_runtime.offline.top.page import Samples, buckets, by_label, parse_page, total
from carbonforge_runtime.offline.top.view import (
    HEIGHT,
    WIDTH,
    RankRow,
    Scrape,
    bucket_growth,
    bucket_quantile,
    build_view,
    keep_window,
    layout,
)

PAGES = Path(__file__).parent / "top_pages"
TTFT = "carbonforge_request_time_to_first_token_seconds"


def page(name: str) -> Samples:
    return parse_page((PAGES / name).read_text())


def recorded(seconds_apart: float = 10.0) -> list[Scrape]:
    return [Scrape(100.0, page("runtime-1.prom"), page("engine-1.prom")),
            Scrape(100.0 + seconds_apart, page("runtime-2.prom"), page("engine-2.prom"))]


def test_a_recorded_page_reads_into_samples_by_name() -> None:
    samples = parse_page((PAGES / "runtime-2.prom").read_text())
    assert total(samples, "carbonforge_engine_max_num_seqs") == 16.0
    assert by_label(samples, "carbonforge_requests_running", "dp_rank") == {"0": 0.0}
    assert total(samples, "carbonforge_request_output_tokens_total") == 1392.0
    assert total(samples, "carbonforge_gpu_power_watts") == 280.0
    assert total(samples, "no_such_metric") is None
    hist = buckets(samples, TTFT)
    assert hist[0] == (0.01, 0.0) and hist[-1] == (math.inf, 9.0)
    with pytest.raises(ValueError):
        parse_page("this is { not prometheus")


def test_bucket_quantile_is_the_bound_of_the_bucket_holding_the_nearest_rank_value() -> None:
    bounds = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, math.inf)
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.expovariate(1 / rng.choice((0.02, 0.3, 2.0))) for _ in range(rng.randint(1, 60))]
        cumulative = tuple((b, float(sum(v <= b for v in values))) for b in bounds)
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            exact = quantile(values, q)
            assert exact is not None
            expected = min(b for b in bounds if exact <= b)  # the bucket the nearest-rank value falls in
            assert bucket_quantile(cumulative, q) == expected
    assert bucket_quantile(((1.0, 0.0), (math.inf, 0.0)), 0.5) is None
    assert bucket_quantile((), 0.5) is None
    assert bucket_quantile(((1.0, 1.0), (math.inf, 4.0)), 0.9) == math.inf


def test_bucket_growth_is_what_was_added_and_none_after_a_restart() -> None:
    old = ((0.1, 2.0), (1.0, 5.0), (math.inf, 5.0))
    new = ((0.1, 3.0), (1.0, 9.0), (math.inf, 10.0))
    assert bucket_growth(old, new) == ((0.1, 1.0), (1.0, 4.0), (math.inf, 5.0))
    assert bucket_growth(new, old) is None  # counts went backwards: the runtime restarted
    assert bucket_growth((), new) == new


def test_the_view_of_two_recorded_scrapes() -> None:
    view = build_view(recorded(10.0))
    assert view.title == "cf-tiny:bf16:chat:cpu v0.2.0"
    assert (view.running, view.waiting, view.ceiling) == (0.0, 0.0, 16)
    assert view.output_tps == pytest.approx((1392 - 192) / 10)  # from vLLM's generated tokens
    assert view.finished_per_s == pytest.approx(0.6)
    assert view.scheduled_tps == pytest.approx((1509 - 231) / 10)
    assert view.window_s == 10.0
    # the six requests between the scrapes: four first tokens by 25 ms, two more by 50 ms; all done by 500 ms
    assert view.ttft.count == 6 and view.ttft.percentiles == (0.025, 0.05, 0.05)
    assert view.e2e.count == 6 and view.e2e.percentiles == (0.5, 0.5, 0.5)
    assert (view.power_w, view.gpus, view.j_per_token) == (280.0, 1, 87.5)
    assert view.ranks == (RankRow("0", 0.0, 0.0, 16, pytest.approx(127.8), 0.0, 0.0, 0.0),)  # type: ignore[arg-type]


def test_since_start_one_scrape_and_a_restart() -> None:
    first, second = recorded()
    since_start = build_view([first, second], windowed=False)
    assert since_start.window_s is None and since_start.ttft.count == 9
    assert since_start.e2e.percentiles[0] == 0.5  # 3 of 9 by 250 ms: the median is in the 500 ms bucket
    alone = build_view([second])
    assert alone.output_tps is None and alone.ranks[0].scheduled_tps is None and alone.ttft.count == 9
    restarted = build_view([Scrape(0.0, second.runtime, second.engine), Scrape(1.0, first.runtime, first.engine)])
    assert restarted.output_tps is None  # a counter went backwards: no rate
    assert restarted.ttft.count == 3  # and the latency falls back to the new histogram whole
    no_engine = build_view([Scrape(0.0, first.runtime), Scrape(10.0, second.runtime)])
    assert no_engine.output_tps == pytest.approx(120.0)  # from the runtime's completed output tokens
    assert no_engine.ranks[0].kv_use is None


def test_the_window_keeps_one_minute() -> None:
    scrapes = [Scrape(float(t), {}) for t in range(0, 100, 5)]
    kept = keep_window(scrapes, 60.0)
    assert kept[0].at == 35.0 and kept[-1].at == 95.0


def rendered(lines: list[tuple[str, str]]) -> list[str]:
    console = Console(record=True, width=WIDTH, height=HEIGHT, file=io.StringIO(), color_system=None)
    console.print(draw.rich_text(lines))
    return console.export_text().splitlines()


def test_the_screen_fits_80x24_and_says_what_matters() -> None:
    view = build_view(recorded(), warnings=["21:12:59 WARNING " + "x" * 200])
    screen = rendered(layout(view, "http://127.0.0.1:9105/metrics", "03:00:00"))
    assert len(screen) <= HEIGHT and all(len(line) <= WIDTH for line in screen)
    text = "\n".join(screen)
    for shown in ("running 0/16", "output 120   scheduled 127.8", "280 W (1 GPU)", "87.50 J/token",
                  "Latency, last 10 s", "25ms", "500ms", "21:12:59 WARNING xxx"):
        assert shown in text, shown
    row = next(line for line in screen if line.startswith("0 "))
    assert row.split() == ["0", "0/16", "0", "127.8", "0.0%", "0", "0"]


def test_many_ranks_still_fit_and_say_how_many_are_left_out() -> None:
    view = build_view(recorded())
    many = tuple(RankRow(str(i), 3.0, 1.0, 16, 50.0, 0.5, 0.0, 0.0) for i in range(16))
    view = view.__class__(**{**view.__dict__, "ranks": many, "warnings": ("a", "b", "c")})
    screen = rendered(layout(view, "url", "03:00:00"))
    assert len(screen) == HEIGHT
    assert any("more ranks" in line for line in screen) and screen[-1] == "c"


def test_an_unmetered_runtime_and_an_empty_histogram() -> None:
    runtime = {k: v for k, v in page("runtime-1.prom").items() if not k.startswith("carbonforge_gpu")
               and not k.startswith(TTFT)}
    view = build_view([Scrape(0.0, runtime)])
    text = "\n".join(text for text, _ in layout(view, "url", "now"))
    assert "Energy     not metered" in text
    assert view.ttft.count == 0 and view.ttft.percentiles == (None, None, None)


def test_recent_warnings_are_the_last_warning_lines_of_runtime_log(tmp_path: Path) -> None:
    log = tmp_path / "runtime.log"
    lines = [f"2026-12-04T03:00:0{i} carbonforge {level} message {i}"
             for i, level in enumerate(["INFO", "WARNING", "INFO", "ERROR", "WARNING", "WARNING", "INFO"])]
    log.write_text("\n".join(lines) + "\n")
    assert fetch.recent_warnings(log) == ["03:00:03 ERROR message 3", "03:00:04 WARNING message 4",
                                          "03:00:05 WARNING message 5"]
    assert fetch.recent_warnings(tmp_path / "missing.log") == []


def test_a_fifo_as_runtime_log_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "runtime.log"
    os.mkfifo(fifo)
    result: list[list[str]] = []
    reader = threading.Thread(target=lambda: result.append(fetch.recent_warnings(fifo)), daemon=True)
    reader.start()
    reader.join(5)
    assert result == [[]]
