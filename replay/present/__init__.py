"""Presentation: what people read, built from what the library computed. Pure functions, frames
(or rows) in, text or figures out; nothing here replays, scores or fits.

- :mod:`.format`: one precision per quantity, table cells, plain-text tables, the ``--json`` object;
- :mod:`.info`, :mod:`.cache`, :mod:`.predict`, :mod:`.whatif`, :mod:`.cost`: each verb's text;
- :mod:`.report`: the report's sections rendered as Markdown and self-contained HTML;
- :mod:`.plots`: the report's figures (PNG, byte-identical for the same input).

The library modules beside this package (:mod:`replay.core.simulate`, :mod:`replay.analyses.accuracy`, ...) never
import it (tests/test_layering.py): the dependency runs one way, presentation -> computation.
"""
