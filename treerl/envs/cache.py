"""A small cache of recent values: what a run computes once per file, not once per environment it builds."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["Recent"]


class Recent:
    """The last ``size`` values put, by key (thread-safe): what a run computes once per file, not once
    per environment it builds.

    >>> recent = Recent(2)
    >>> recent.get_or_put("a", lambda: 1), recent.get_or_put("a", lambda: 2)
    (1, 1)
    """

    def __init__(self, size: int):
        self.size = size
        self._values: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        """The value put under ``key``, or None."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
            return self._values.get(key)

    def put(self, key: Any, value: Any) -> Any:
        """Put ``value`` under ``key`` (the oldest goes past ``size``); returns it."""
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value

    def get_or_put(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value under ``key``, made (outside the lock: reading a file takes seconds) and put if none is."""
        value = self.get(key)
        return value if value is not None else self.put(key, make())
