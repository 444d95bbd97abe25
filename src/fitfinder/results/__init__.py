"""What a search leaves behind and how it is shown: results/NAME/ (best.yaml, trials.csv, summary.json,
report.html), the dashboard and the terminal output (the kohya export: trainers/aitoolkit_to_kohya.py).

- report.py: write_results (the one writer, for `fitfinder search` and `fitfinder report`),
  reading a study back; _plots.py: the report's figures
- dashboard.py: `fitfinder dashboard`, optuna-dashboard on 127.0.0.1
- output.py: terminal output (rich on a terminal, plain lines piped, --json)
"""
