"""``python -m ckvp_compile.inspection``: the ``ckvp-inspect`` command line."""

import sys

from .cli import main

sys.exit(main())
