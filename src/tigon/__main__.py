"""``python -m tigon``: the ``tigon`` command (tigon.cli)."""

import sys

from tigon.cli import main

sys.exit(main())
