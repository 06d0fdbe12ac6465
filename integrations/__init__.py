"""In-process integrations with serving engines and model libraries.

Each submodule imports its engine lazily, only inside the user's process and only when called:
importing ``guardlint`` (or this package) never imports an engine.
"""
from guardlint._requires import require as _require

_require("guardlint.integrations", "torch")

