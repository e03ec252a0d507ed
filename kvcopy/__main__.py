"""``python -m kvcopy``: the benchmark CLI (same as ``kvcopy-bench``)."""
import sys

from .bench.cli import main

sys.exit(main())
