"""Versions reported by every service and tool (kept light: no server imports)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version

try:
    PACKAGE_VERSION = distribution_version("cogment-aux")
except PackageNotFoundError:  # running from a source tree that was not installed
    PACKAGE_VERSION = "0.0.0+source"

# The Cogment release whose 2.x gRPC API these services implement.
COGMENT_API_VERSION = "2.22.0"
