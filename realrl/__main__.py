"""`python -m realrl <command>`: see realrl/cli/__init__.py."""

import sys

from realrl.cli import main

sys.exit(main())
