"""``python -m p2pfl`` is the ``p2pfl`` command."""

from p2pfl.app.cli import program

program()
