"""``python -m finefreeze`` runs the command line."""

import sys

from finefreeze._cli import main

sys.exit(main())
