"""The Directory service: registration, discovery and health checking of Cogment services."""
