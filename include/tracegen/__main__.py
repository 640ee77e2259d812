"""Entry point of `python -m tracegen`."""

import sys

from tracegen.cli import main

sys.exit(main())
