from stager.cli import main

raise SystemExit(main())
