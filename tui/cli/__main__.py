"""`python -m tui.cli`: the `schedtop` command."""

from tui.cli import main

main()
