"""Building the vLLM command (pure) and supervising the engine process."""
