"""``python -m replay.cli``: the same as the ``moe-replay`` console script (:func:`replay.cli.main`)."""

from replay.cli import main

main()
