"""The ``fp8forge`` command line: local analyze/convert, and serve/worker for the service."""
