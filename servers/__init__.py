"""Thin gRPC servicer layers, one per service."""
