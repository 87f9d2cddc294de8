"""OpenAI-compatible server (``python -m jaxinfer.serve``; extra ``serve``): `app.create_app`."""
