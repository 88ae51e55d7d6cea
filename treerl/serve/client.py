"""A learner's side of ``treerl serve``: groups by position, and weights published with their version.

:class:`ServerSource` is the :class:`~treerl.rollout.sources.GroupSource` of ``treerl learn
--from-server URL``: ``take(indices)`` waits until the server has finished the groups at
those positions (the order in which groups completed, which is also the order of the
server's trajectory file) and ``set_weights(state_dict, version)`` uploads new weights, so
that the server's later requests sample them and record their version. It speaks plain
HTTP with the standard library (no extra needed on the learner's side).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from treerl.errors import ConfigError
from treerl.rollout.sources import stats_of
from treerl.rollout.summary import RolloutStats
from treerl.rollout.trajectory import Group

__all__ = ["ServerSource", "ServerError"]


class ServerError(ConfigError):
    """The server refused a request or could not be reached; the message says which and why (the
    ``treerl`` command prints it in one line and exits with status 2, as for a wrong setting: most often
    the URL, the token or a server that was not started). ``status`` is the HTTP status of a refusal."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerSource:
    """Groups finished through ``treerl serve`` at ``url``, and weights sent back to it.

    Args:
        url: The server's base URL, e.g. ``http://127.0.0.1:8000``.
        token: Its bearer token (publishing weights needs one).
        timeout_s: How long :meth:`take` waits for groups before raising :class:`ServerError`.
        poll_s: How long one request waits on the server for new groups.
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0, poll_s: float = 20.0):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.token = token
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    def _request(self, method: str, path: str, data: bytes | None = None, content_type: str | None = None,
                 timeout: float = 60.0) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if content_type:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ServerError(f"{method} {self.url}{path}: HTTP {exc.code}: {detail}", status=exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"{method} {self.url}{path}: cannot reach the server ({exc}); is `treerl serve` "
                              "running there?") from None

    def check(self) -> None:
        """Raise :class:`ServerError` now unless the server answers and would take this learner's weights
        (before a run builds anything on it)."""
        self._request("GET", "/health", timeout=min(self.poll_s, 30.0))
        # A GET of the weights endpoint changes nothing: a server that would take our uploads answers 405
        # (it takes POSTs); one that would not (no token on either side) says why now. Found at the first
        # upload instead, the server's early refusal reset the connection mid-body, which read as a server
        # that could not be reached.
        try:
            self._request("GET", "/v1/control/weights", timeout=min(self.poll_s, 30.0))
        except ServerError as exc:
            if exc.status != 405:
                raise ServerError(f"{exc} The learner publishes each new weights version there: start "
                                  "`treerl serve` with TREERL_SERVE_TOKEN set, and set the same token for "
                                  "`treerl learn`.", status=exc.status) from None

    def take(self, indices: Sequence[int]) -> tuple[list[Group], RolloutStats]:
        """The groups at ``indices``, waiting for the server to finish them (up to ``timeout_s``)."""
        if not indices:
            return [], stats_of([])
        lo, hi = min(indices), max(indices) + 1
        found: dict[int, Group] = {}
        start = time.monotonic()
        while len(found) < hi - lo:
            left = self.timeout_s - (time.monotonic() - start)
            if left <= 0:
                raise ServerError(f"{self.url}: only {len(found)} of the {hi - lo} groups from position {lo} "
                                  f"finished within {self.timeout_s:g} s; are agents sending traffic and "
                                  "rewards (raise --server-timeout-s to wait longer)?")
            first = lo + len(found)
            wait = min(self.poll_s, max(left, 0.0))
            body = self._request("GET", f"/v1/groups?start={first}&count={hi - first}&wait={wait:.3f}",
                                 timeout=wait + 60.0)
            for k, g in enumerate(body["groups"]):
                found[first + k] = Group.from_json(json.dumps(g))
        groups = [found[i] for i in indices]
        return groups, stats_of(groups, wall_s=time.monotonic() - start)

    def set_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Upload ``weights`` (a state dict) as ``version``; the server's later requests sample them."""
        from safetensors.torch import save

        data = save({k: v.detach().contiguous().cpu() for k, v in weights.items()})
        self._request("POST", f"/v1/control/weights?version={int(version)}", data=data,
                      content_type="application/octet-stream", timeout=600.0)

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/v1/stats")
