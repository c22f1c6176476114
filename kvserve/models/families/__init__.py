"""The built-in model families; importing this package registers them (models/registry.py).
Each module is one family (or a few that share its computation), composed of the shared layers
in kvserve/models/layers/."""

from kvserve.models.families import gemma, llama, phi3, qwen  # noqa: F401 (they register)
