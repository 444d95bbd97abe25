"""`python -m fitfinder.probe < request.json`: one probe, its one JSON result line on stdout."""

from fitfinder.probe.recipe import main

main()
