"""Analysis notebooks and their regeneration (python -m notebooks.regen); not part of the installed package."""
