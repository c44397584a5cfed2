"""The model's weights: the Hugging Face cache, and the built-in tiny model generated on this machine.
"""
