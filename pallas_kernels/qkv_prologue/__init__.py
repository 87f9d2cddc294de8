"""Fused attention prologue of one decoder layer: q/k RMSNorm + RoPE + the K/V page write.

`reference.py` is the plain-jnp oracle; `triton_pallas.py` the Pallas kernel (Triton lowering) that
does the same in one launch: in decode steps, where XLA spends six small fusions per layer on it,
and in packed prefill steps, where XLA's K/V scatter is slow.
"""
