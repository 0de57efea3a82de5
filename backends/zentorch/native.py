"""Build and load the zentorch backend's native decode path (``native.cpp``).

Compiled with torch's C++ extension builder the first time a process needs it (about 30 s
on 2 cores; ``scripts/setup.sh`` does it at install) into the user cache, from which later
processes load it in well under a second. Without a compiler, with ``MOE_DISPATCH_NATIVE=0``
or after a failed build, the backend runs its Python path and :func:`status` says why.

Run ``python -m moe_dispatch_backends.zentorch.native`` to build it and print the status.
"""

from __future__ import annotations

from pathlib import Path

from moe_dispatch.kernels import NativeExtension

ENV = "MOE_DISPATCH_NATIVE"
DIR_ENV = "MOE_DISPATCH_NATIVE_DIR"
SOURCE = Path(__file__).with_name("native.cpp")
MODULE_NAME = "moe_dispatch_zentorch_native"


def _register_op() -> None:
    import zentorch  # noqa: F401  (registers the op the module looks up)


EXTENSION = NativeExtension(MODULE_NAME, [SOURCE], switch=ENV, dir_env=DIR_ENV,
                            what="zentorch native path", before_build=_register_op,
                            build_command=f"python -m {__name__}")


# One process-wide decision: every kernel call in a process must go through one lock.
load = EXTENSION.load  # the compiled module, or None (the reason: status())
status = EXTENSION.status
describe = EXTENSION.describe  # without building anything (for moe-dispatch doctor)


def main() -> int:
    return EXTENSION.main()


if __name__ == "__main__":
    raise SystemExit(main())
