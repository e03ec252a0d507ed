"""NIXL transfer manager (see kvcopy/nixl/manager.py)."""
