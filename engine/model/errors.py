"""Errors a user can cause with a model or a request, each with a message saying what to do."""

from __future__ import annotations

from engine.errors import UserError


class ModelError(UserError):
    """A model that cannot be loaded or run: missing, corrupt or unsupported."""


class RequestError(ValueError):
    """A request the engine refuses before it reaches the scheduler (bad tokens, bad
    sampling parameters, a chat request for a model without a chat template)."""
