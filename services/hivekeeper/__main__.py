from hivekeeper.cli import main

raise SystemExit(main())
