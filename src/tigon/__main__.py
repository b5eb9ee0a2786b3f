"""``python -m tigon``: the ``tigon`` command (tigon.cli)."""

import sys

from tigon.cli import main

if __name__ == "__main__":  # not when a spawned worker process imports this module as __mp_main__
    sys.exit(main())
