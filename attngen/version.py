"""attngen's version: stamped in every generated module and bundle manifest."""
__version__ = "0.1.0"
