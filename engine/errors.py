"""The one base of every error a user can cause (a malformed file or option, a bad path, a
corrupt trace): the command line reports any of them as one line and exit status 2, so that
it needs to know none of the packages that raise them."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave, with a message that names it."""
