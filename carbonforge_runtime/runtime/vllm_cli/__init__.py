"""Reading vLLM's command line as vLLM 0.32 does: the option table, the one argument reader, and which model an
argument list serves.
"""
