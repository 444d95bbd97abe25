from fitfinder.cli import main

main()
