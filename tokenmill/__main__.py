"""`python -m tokenmill` runs the `tokenmill` command."""

from tokenmill.tools.cli import main

raise SystemExit(main())
