"""`python -m speedc.cli`: the same as the `speedc` command."""

from speedc.cli import main

main()
