"""Engines: the token-in/token-out interface (base.py), HTTP clients (http.py), routing (router.py), the embedded engine (local/)."""
