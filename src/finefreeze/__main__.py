"""``python -m finefreeze`` runs the command line."""

import sys

from finefreeze._cli.commands import main

sys.exit(main())
