"""The HTTP API: the FastAPI app, its routes, request schemas, downloads and event streams."""
