"""``python -m kiln_cli``: the ``kiln`` command without the console script, e.g. for subprocesses of ``kiln demo``."""

import sys

from kiln_cli import main

sys.exit(main())
