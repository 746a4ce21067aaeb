"""``python -m finefreeze`` runs the command line."""

import sys

from finefreeze._cli.entry import main

sys.exit(main())
