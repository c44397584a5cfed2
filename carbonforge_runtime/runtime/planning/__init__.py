"""Planning a serve, with no side effects: options and settings become the vLLM command, its environment, the
engine contract and the trace configuration.
"""
