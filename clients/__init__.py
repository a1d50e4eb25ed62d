"""Typed clients of every Astra service."""
