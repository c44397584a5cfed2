"""Running the engine's processes: start, readiness, serving, stop and the kill path; the start-up phases read
from vLLM's log; who owns a port.
"""
