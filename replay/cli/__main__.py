"""``python -m replay.cli``: the same as the ``moe-replay`` console script (:mod:`replay.fastcli`)."""

from replay.fastcli import main

main()
