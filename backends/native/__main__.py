"""``python -m moe_dispatch_backends.native``: build this machine's kernel builds and print
their status (scripts/setup.sh runs it)."""

from .kernel import main

raise SystemExit(main())
