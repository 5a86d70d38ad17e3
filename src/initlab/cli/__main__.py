"""``python -m initlab.cli``."""

import sys

from initlab.cli.main import main

sys.exit(main())
