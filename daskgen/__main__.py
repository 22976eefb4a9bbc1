"""``python -m daskgen`` = the ``daskgen`` command."""

from daskgen.cli import main

main()
