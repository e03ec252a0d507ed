"""Real vLLM engines on the CPU for kvcopy's end-to-end tests and the serving benchmark.

* :mod:`.models`: tiny random-weight model families saved with ``save_pretrained``.
"""
