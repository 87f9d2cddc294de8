"""Residual add + RMSNorm in plain jnp (`reference`), the model's layer norm."""
