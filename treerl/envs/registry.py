"""Placeholder; filled in by the environment layer."""

registry: dict = {}


def register(*args, **kwargs):  # pragma: no cover - replaced shortly
    raise NotImplementedError


def make(*args, **kwargs):  # pragma: no cover - replaced shortly
    raise NotImplementedError
