"""The options of ``treerl serve``: :class:`ServeConfig` (its flags are generated from it).

>>> ServeConfig().host
'127.0.0.1'
>>> ServeConfig(host="0.0.0.0", token=None)
Traceback (most recent call last):
...
ValueError: host='0.0.0.0' is not a loopback address, so every endpoint needs a bearer token: set TREERL_SERVE_TOKEN ...
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from treerl.agents.policy import SamplingOptions
from treerl.config import field_help
from treerl.rollout.options import ChatTemplateOptions

__all__ = ["ServeConfig", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ::1).

    >>> is_loopback("localhost"), is_loopback("127.0.0.2"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServeConfig(ChatTemplateOptions, SamplingOptions):
    """Options of ``treerl serve``. The sampling options are the defaults of requests that do not set them;
    ``--chat-template`` and ``--chat-template-kwargs`` are ``treerl learn``'s, so served traffic is
    rendered as the learner's own episodes are."""

    model: str | None = field_help(None, "A local transformers model directory; default: the shipped tiny model.")
    served_model_name: str = field_help("treerl", "The model name /v1/models lists (requests may name any model).")
    host: str = field_help("127.0.0.1", "Address to bind; anything but loopback needs a bearer token.")
    port: int = field_help(8000, "Port to bind (0: any free port; the chosen one is printed).")
    device: str = field_help("cpu", "Torch device of the policy.")
    out: str | None = field_help(None, "Trajectory file finished groups are appended to (resumed when it exists); "
                                       "default: kept in memory only.")
    group_size: int = field_help(1, "Finished episodes of one task_id that make its group complete (GRPO's group).")
    max_episode_tokens: int = field_help(2048, "The most tokens an episode's context may reach (prompt, replies and "
                                               "tool results; a reply is cut there with finish_reason length, a "
                                               "longer conversation is refused with context_length_exceeded). A "
                                               "model that declares max_position_embeddings gets the smaller of "
                                               "the two.")
    max_tokens_cap: int = field_help(1024, "The most max_tokens a request may ask for.")
    max_n: int = field_help(16, "The most choices (n) one request may ask for.")
    max_request_bytes: int = field_help(4 * 2**20, "Requests with a larger body are refused (413).")
    max_weights_bytes: int = field_help(16 * 2**30, "The largest weights upload /v1/control/weights accepts.")
    episode_timeout_s: float = field_help(600.0, "An episode with no request or reward for this long ends "
                                                 "(termination timeout, its rewards so far).")
    max_batch_size: int = field_help(64, "Most requests decoded together.")
    batch_wait_s: float = field_help(0.001, "From idle, how long the policy waits for more requests before it "
                                            "prefills, so requests arriving together (with the same prompt: "
                                            "prefilled once) start as one batch.")
    num_threads: int | None = field_help(None, "torch CPU threads (default: torch's choice; 1 is fastest on a "
                                               "small CPU shared with other work).")
    token: str | None = field_help(None, "Bearer token (default: $TREERL_SERVE_TOKEN). With one, every endpoint "
                                         "needs it; without one, only loopback is served and control endpoints "
                                         "(weights, pause) are refused.")
    log_level: str = field_help("warning", "uvicorn's log level.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token is None:
            self.token = os.environ.get("TREERL_SERVE_TOKEN") or None
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"host={self.host!r} is not a loopback address, so every endpoint needs a bearer token: "
                             "set TREERL_SERVE_TOKEN (or --token), or bind --host 127.0.0.1.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in 0..65535 (0 picks a free port).")
        for name in ("group_size", "max_episode_tokens", "max_tokens_cap", "max_n", "max_request_bytes",
                     "max_weights_bytes", "max_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.max_new_tokens > self.max_tokens_cap:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} (the default max_tokens) exceeds "
                             f"max_tokens_cap={self.max_tokens_cap}; raise --max-tokens-cap or lower it.")
        if not 0 <= self.batch_wait_s <= 10:
            raise ValueError(f"batch_wait_s={self.batch_wait_s} must be in 0..10 seconds (e.g. 0.001).")
        if not self.episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s={self.episode_timeout_s} must be > 0 (seconds).")
        self.sampling()  # SamplingParams checks the sampling defaults with its own messages
