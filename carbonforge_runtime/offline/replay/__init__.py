"""Replaying recorded traffic against an OpenAI-compatible endpoint.

``trace`` reads a recording (our JSONL traces, the Azure CSV format), ``plan`` turns it into a
send schedule (rate factor, token scaling, caps), ``runner`` sends it with the openai SDK, and
``summary`` reduces the outcome to a table. ``workloads`` generates the synthetic workloads the
ordering benchmark uses.
"""
