from kvshare.cli import main

raise SystemExit(main())
