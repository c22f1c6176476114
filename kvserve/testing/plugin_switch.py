"""On/off for a test plugin (kvserve/plugins.py) whose hooks wrap real classes: the hooks are
installed once per process and act only while the switch is on."""

from __future__ import annotations

from typing import Callable


class PluginSwitch:
    def __init__(self, install: Callable[[], None]):
        self._install = install
        self._installed = False
        self.enabled = False

    def register(self) -> None:
        """The KVSERVE_PLUGINS entry point: on in this process."""
        self.enable(True)

    def enable(self, on: bool = True) -> None:
        if on and not self._installed:
            self._install()
            self._installed = True
        self.enabled = on
