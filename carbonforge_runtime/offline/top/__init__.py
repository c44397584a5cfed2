"""``carbonforge-runtime top``: a live terminal view of one runtime, from the metrics it serves.

``page.py`` reads a Prometheus page into plain samples, ``view.py`` turns scrapes into what the screen
shows (rates, percentiles, per-rank rows) and lays it out as lines, ``fetch.py`` owns the HTTP scrapes
and the read of runtime.log, and ``draw.py`` is the one place that draws on a terminal.
"""
