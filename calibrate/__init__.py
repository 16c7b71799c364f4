"""Placeholder: see ARCHITECTURE.md for what lands here."""
