"""The layer that applies (docs/design.md#2-layout): the per-process runtime.

``activation`` turns the settings, the matrix and detection (the ``plan`` layer) into an immutable
plan; ``lifecycle`` and ``install`` apply, hook, check and revert the planned patches through the
``registry`` of originals; ``late_detection`` decides again when a framework appears after
activation; ``snapshot`` is the read-only view doctor and the CLI get. ``facade`` holds the one
:class:`Runtime` of the process (``RUNTIME``), re-exported here.
"""
from .facade import RUNTIME, Runtime

__all__ = ["RUNTIME", "Runtime"]
