"""Serving one model over several hosts: this host's place in its group, and the watch that stops the group when
a host is lost.
"""
