"""What a search leaves behind and how it is shown: results/NAME/ (best.yaml, trials.csv, summary.json,
report.html), the kohya export, the dashboard and the terminal output.

- report.py: write_results (the one writer, for `fitfinder search` and `fitfinder report`),
  reading a study back; _plots.py: the report's figures
- kohya.py: the winner as kohya sd-scripts / musubi-tuner settings, and reading them back
- dashboard.py: `fitfinder dashboard`, optuna-dashboard on 127.0.0.1
- output.py: terminal output (rich on a terminal, plain lines piped, --json)
"""
