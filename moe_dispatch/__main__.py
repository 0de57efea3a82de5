from moe_dispatch.cli import main

raise SystemExit(main())
