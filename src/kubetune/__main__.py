"""`python -m kubetune`: the command line (``kubetune.cli.main``), as the `kubetune` script runs it."""

from kubetune.cli import main

main()
