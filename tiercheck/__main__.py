"""``python -m tiercheck`` and the ``tiercheck`` command: the parser and dispatcher live in `cli`."""

from __future__ import annotations

import sys

from .cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
