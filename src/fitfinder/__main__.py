"""`python -m fitfinder`, and the `fitfinder` command (pyproject's console script calls `main`).

The CLI is imported inside `main`, not here: the console script imports this module, and every
probe process that multiprocessing starts from it imports the script again (as `__mp_main__`), so a
module-level import of fitfinder.cli put typer, rich and the CLI's imports in each probe's process
(2.6 MB more resident memory at its start than under `python -m fitfinder`, whose children skip a
`__main__` module: benchmarks/host_peaks.py --only spread).
"""


def main() -> None:
    from fitfinder.cli import main as run

    run()


if __name__ == "__main__":
    main()
