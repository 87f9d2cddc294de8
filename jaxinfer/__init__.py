"""jaxinfer: JAX/Pallas LLM inference."""
