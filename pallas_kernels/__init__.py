"""Pallas GPU kernels for jaxinfer, each beside a plain-jnp float32 reference."""
