"""schedtop's version, as installed: trace headers, `/version` and `--version` say the same."""

from __future__ import annotations


def schedtop_version() -> str:
    """The installed distribution's version; "dev" when running from a source tree."""
    from importlib import metadata

    try:
        return metadata.version("schedtop")
    except metadata.PackageNotFoundError:
        return "dev"
