"""The engine's environment: which variables reach vLLM, the no-reporting and offline switches, and where its
compile caches go.
"""
