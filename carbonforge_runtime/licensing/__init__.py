"""Offline licence verification and the premium gate."""
