"""Paged attention: a float32 reference and kernel variants behind one signature.

See `registry.py` for the variants by name and `reference.py` for the oracle.
"""
