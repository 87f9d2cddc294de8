"""OpenAI-compatible server (``python -m jaxinfer.serve``; extra ``serve``): `create_app`."""

from jaxinfer.serve.app import create_app

__all__ = ["create_app"]
