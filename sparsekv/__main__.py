"""``python -m sparsekv``: the command line, as the ``sparsekv`` command."""

import sys

from .cli import main

sys.exit(main())
