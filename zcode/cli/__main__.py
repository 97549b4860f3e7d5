"""`python -m zcode.cli ...`: the `zcode` command."""

from zcode.cli import main

main()
