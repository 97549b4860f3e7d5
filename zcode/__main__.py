"""`python -m zcode ...`: the `zcode` command, as torchrun launches it (`torchrun -m zcode`)."""

from zcode.cli import main

main()
