"""``python -m kvcopy``: the benchmark CLI (same as ``kvcopy-bench``)."""
import sys

from .cli import main

sys.exit(main())
