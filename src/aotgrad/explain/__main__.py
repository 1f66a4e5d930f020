"""`python -m aotgrad.explain path/to/script.py:function ...` (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
