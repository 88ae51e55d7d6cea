"""``treerl serve``: an OpenAI-compatible endpoint whose traffic becomes token-exact trajectory trees.

Agents written with any OpenAI client (the ``openai`` package, LangChain's ``ChatOpenAI``,
smolagents, LiteLLM) talk to it; every request runs through the same policy and
:class:`~treerl.agents.chat.ChatRenderer` as the rollout engine, with the engine's own
episode steps, so the recorded trees are what the model saw and sampled, token for token.
``treerl learn --from-server URL`` trains on the groups that finish there and publishes new
weights back with their version.

- :mod:`treerl.serve.config`: :class:`ServeConfig`, the flags of ``treerl serve``;
- :mod:`treerl.serve.openai_format`: the wire format, checked field by field;
- :mod:`treerl.serve.recorder`: episodes, groups by task, rewards, the trajectory file;
- :mod:`treerl.serve.app`: the HTTP endpoints (FastAPI, the ``serve`` extra);
- :mod:`treerl.serve.client`: the learner's side, :class:`ServerSource`.

It sits on the rollout floor: it uses agents, environments' parsers and the rollout
engine's types, and no learner.
"""

from treerl.serve.config import ServeConfig

__all__ = ["ServeConfig", "Recorder", "ServerSource", "create_app", "serve"]

_LAZY = {
    "Recorder": "treerl.serve.recorder",
    "ServerSource": "treerl.serve.client",
    "create_app": "treerl.serve.app",
    "serve": "treerl.serve.app",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treerl.serve' has no attribute {name!r}")
