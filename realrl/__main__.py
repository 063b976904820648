"""`python -m realrl <command>`: see realrl/cli/__init__.py."""

from realrl.base.process import exit_process
from realrl.cli import main

exit_process(main())  # as sys.exit, without waiting for the interpreter to tear torch down
