"""`python -m vtoken_cli`: the `vtoken` command."""

from vtoken_cli.app import main

main()
