from offload_core.cli import main

raise SystemExit(main())
