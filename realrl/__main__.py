"""`python -m realrl status ...`: see realrl/cli.py."""

import sys

from realrl.cli import main

sys.exit(main())
