"""`python -m engine ...` is the `engine` command."""

import sys

from engine.cli import main

sys.exit(main())
