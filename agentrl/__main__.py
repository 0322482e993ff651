from agentrl.cli import main

raise SystemExit(main())
