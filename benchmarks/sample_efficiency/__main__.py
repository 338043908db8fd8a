"""``python benchmarks/sample_efficiency ...`` (the folder run as a script) and ``python -m
sample_efficiency ...`` with ``benchmarks/`` on the path: the command line of ``cli.main``."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a folder: no parent package, so import it by name from benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sample_efficiency.cli import main  # noqa: E402

sys.exit(main())
