"""Running the engine's processes: start, readiness, serving, stop and the kill path (``supervisor``); the
stop's time bounds (``drain``); how a run ended and the engine's exit explained (``exit_report``); the
start-up phases read from vLLM's log; who owns a port.
"""
