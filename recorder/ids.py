"""A request's client id: the id its client gave, which names it across runs.

vLLM makes every request id unique by appending `-` and 8 random hex digits to the
client's (`InputProcessor.assign_request_id`), and the trace keeps vLLM's id, which the
engine's own records need. The same workload recorded twice therefore has other ids:
`diff` compares arrivals by the client's id, and `find`, breakpoints and the TUI accept
it wherever they take a request id. (An id that only looks suffixed, such as
`req-deadbeef` of schedtop's own, also answers to `req`; an exact id always matches
first.)
"""

from __future__ import annotations

import re

_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")


def client_id(request_id: str) -> str:
    """`request_id` without vLLM's random suffix (unchanged where it has none)."""
    return _VLLM_SUFFIX.sub("", request_id)


def names(request_id: str) -> tuple[str, ...]:
    """The names a request answers to: its id, then its client id if that differs."""
    short = client_id(request_id)
    return (request_id,) if short == request_id else (request_id, short)


def answers_to(request_id: str, name: str) -> bool:
    """Whether the request `request_id` is the one `name` names."""
    return name == request_id or name == client_id(request_id)
