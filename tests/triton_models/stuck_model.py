"""Test model whose code never returns (python backend): `execute` and `finalize` wait on an
event nothing sets, as a model with a dead helper thread does. The server must still stop."""

import threading

_never = threading.Event()


class TritonPythonModel:
    def execute(self, requests):
        _never.wait(3600)
        return []

    def finalize(self):
        _never.wait(3600)
