from server.main import main

raise SystemExit(main())
