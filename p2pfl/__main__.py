"""``python -m p2pfl`` is the ``p2pfl`` command."""

import sys

from p2pfl.app.cli import main

sys.exit(main())
