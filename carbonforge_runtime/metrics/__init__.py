"""Prometheus metrics: the engine-to-runtime feed, the runtime's metric state and its HTTP exposition.

``feed`` runs on both sides of the process boundary (the engine's sender is a trace sink; the
runtime's receiver is a thread); ``state`` holds the numbers as plain data; ``exposition`` turns
them into Prometheus metric families on a dedicated registry; ``runtime`` wires everything around
the supervised engine. prometheus-client is imported only when ``--metrics`` is on.
"""
