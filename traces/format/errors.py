"""Errors a user can fix.

Every problem with input (a file, an option) is raised as :class:`UserError` with one sentence
that names the file or option and what is wrong. The CLI prints that sentence and exits non-zero;
only ``--debug`` shows a traceback. Anything else that escapes is a bug in the tool.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an impossible option: the message is one sentence meant for the user."""


class TraceError(UserError):
    """A trace directory (or one of its files) is missing, malformed or inconsistent."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
