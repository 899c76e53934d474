"""The layer that decides (docs/design.md#2-layout): which patches a process needs and why.

Settings (the ``NPU_FSDP_PATCHES_*`` env vars), the compatibility matrix and its trusted cache,
version bounds, installed distributions read from their metadata, framework detection, the
per-patch decisions and the patch declarations read from source. Nothing here imports torch or a
target framework, installs anything or changes another module: it reads and decides. It imports only
the package's foundations (``errors``, ``plugin_log``, ``process_state``).
"""
