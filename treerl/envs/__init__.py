"""Environments: the Gymnasium contract for multi-turn tool use, tools, parsers, verifiers."""
