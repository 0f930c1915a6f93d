"""`python -m api serve [MODEL] [flags]` — same as the `continuum` console script."""

from api.cli import main

main()
