"""Built-in moe-dispatch backends, installed as ``moe_dispatch_backends``.

Each module is a pluggy plugin found through the ``moe_dispatch.backends`` entry point
group, exactly like a third-party backend.
"""
