"""Callbacks for an unmodified Lightning project."""

__all__: list[str] = []
