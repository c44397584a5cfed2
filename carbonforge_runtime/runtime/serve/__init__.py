"""Serving: the launch that runs the plan (after the checks) and the parts started around the engine (metrics,
energy controller, API key, the address to probe).
"""
