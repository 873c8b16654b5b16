"""Bundled sample data (see NOTICE.md)."""
