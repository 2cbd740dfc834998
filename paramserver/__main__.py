"""``python -m paramserver`` = the ``paramserver`` command."""

import sys

from paramserver.cli import main

sys.exit(main())
