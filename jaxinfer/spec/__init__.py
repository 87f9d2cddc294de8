"""Speculative decoding, host side: draft proposers that import no JAX."""
