"""Example third-party moe-dispatch backend (see backend.py)."""
