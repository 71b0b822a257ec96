"""``python -m kiln.cli``: the ``kiln`` command without the console script, e.g. for subprocesses of ``kiln demo``."""

import sys

from kiln.cli import main

sys.exit(main())
