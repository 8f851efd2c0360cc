"""``python -m lcache`` runs the command line."""

from lcache.cli.main import main

main()
