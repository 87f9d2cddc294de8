"""Residual add + RMSNorm of one decoder sub-block boundary: ``x += delta; h = rms_norm(x)``.

`reference.py` is the plain-jnp oracle; `triton_pallas.py` the Pallas kernel (Triton lowering) that
does both in one launch, where XLA runs three small fusions (the add, the statistics, the scale).
"""
