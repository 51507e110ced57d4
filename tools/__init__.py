"""The project's command-line tools (``python tools/<name>.py``; tests import them as ``tools.<name>``).

A regular package, not a namespace one: a regular ``tools`` package anywhere on ``sys.path`` wins over a namespace
portion earlier on it, and Megatron-LM's checkout has one (``Megatron-LM/tools/__init__.py``), which the Megatron-LM
tests put on ``sys.path``. As a namespace package, ``tools.make_latent_shards`` failed to import in a test process
that had run those tests first.
"""
