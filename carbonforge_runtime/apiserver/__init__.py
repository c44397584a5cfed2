"""Code that runs inside vLLM's API server process (loaded with ``--middleware``)."""
