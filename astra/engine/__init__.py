"""Inference engines behind a RaaS: the contract (api) and the built-in torch engine."""
