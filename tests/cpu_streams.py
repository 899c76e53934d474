"""Test-side shim: torch 2.6's FSDP2 forward/backward on CPU.

torch 2.6's ``torch.cpu.Stream`` is a stub without ``record_event``/``wait_event``, which FSDP2's
collectives call (torch 2.6 ``_fsdp_collectives.py:171,251``); torch 2.7 added them. On CPU every op
is synchronous, so an event recorded on a CPU stream is complete at once and waiting on it is a no-op:
exactly what the torch 2.7 CPU stream does. Installed only where the methods are missing, only in test
processes (``tests/_rank_main.py``); the plugin never touches streams.
"""
import torch


def add_cpu_stream_events() -> bool:
    """Give torch.cpu.Stream no-op ``record_event``/``wait_event`` where torch lacks them."""
    stream = torch.cpu.Stream
    if hasattr(stream, "record_event"):
        return False
    stream.record_event = lambda self, event=None: event if event is not None else torch.cpu.Event()
    stream.wait_event = lambda self, event: None
    return True
