"""``python -m initlab``: the ``initlab`` command."""

import sys

from initlab.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
