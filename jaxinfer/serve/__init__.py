"""The OpenAI-compatible server (``python -m jaxinfer.serve``; extra ``serve``): `create_app`
builds the FastAPI app over a `jaxinfer.LLM`."""

from jaxinfer.serve.app import create_app

__all__ = ["create_app"]
