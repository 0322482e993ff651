"""Trainer backends: the contract (base.py), token-budget packing (batching.py), the torch backend."""
