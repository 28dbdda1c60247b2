"""What a page answers instead of its content, other than a service down (`sources.Unavailable`):
the transport (services.console.app) turns each into its status, one place for every page."""

from __future__ import annotations


class NotFound(Exception):
    """What the address names does not exist: the page is a 404."""


class Busy(Exception):
    """The console draws as many curves as its memory allows: try again in a moment (a 503)."""
