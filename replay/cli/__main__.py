"""``python -m replay.cli``: the same as the ``moe-replay`` console script."""

from replay.cli import main

main()
