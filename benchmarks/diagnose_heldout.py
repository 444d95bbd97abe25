"""How `fitfinder diagnose` does on real logs from public issue threads, split into the logs its
rules were written on and a held-out third it never saw.

    python benchmarks/diagnose_heldout.py                 # this checkout
    python benchmarks/diagnose_heldout.py --before REV    # and the code at git revision REV, side by side

The corpus is tests/logs/: every log with a "source" (its thread's URL) in expected.json counts; the
held-out third is drawn once with a fixed seed (HELDOUT_SEED) over the sorted names, and recorded in
expected.json as "split"; this script checks the two agree, so the split cannot drift.

Scores, per split: OOM recognised (among the logs that are an OOM), phase right (among the logs
whose phase the log shows), kind right (config / environment / host / not_oom, all logs).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "logs"
HELDOUT_SEED = 19


def sourced() -> dict[str, dict]:
    expected = json.loads((LOGS / "expected.json").read_text(encoding="utf-8"))
    return {name: entry for name, entry in expected.items() if "source" in entry}


def check_split(corpus: dict[str, dict]) -> None:
    names = sorted(corpus)
    drawn = set(random.Random(HELDOUT_SEED).sample(names, -(-len(names) // 3)))
    recorded = {name for name, entry in corpus.items() if entry["split"] == "heldout"}
    if drawn != recorded:
        sys.exit(f"the held-out split in expected.json is not the seeded draw: {sorted(drawn ^ recorded)}")


def answers(src: Path, names: list[str]) -> dict[str, dict]:
    """Each log's answer from the fitfinder under `src`, in a child process (another revision's code)."""
    script = ("import json, sys\nfrom pathlib import Path\nfrom fitfinder import diagnose\n"
              "out = {}\nfor name in sys.argv[2:]:\n"
              "    a = diagnose.diagnose(diagnose.read_log(Path(sys.argv[1]) / name), None, name).as_json()\n"
              "    out[name] = {k: a[k] for k in ('oom', 'kind', 'phase')}\nprint(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script, str(LOGS), *names], capture_output=True, text=True,
                          env={"PYTHONPATH": str(src), "PATH": ""}, check=True)
    return json.loads(done.stdout)


def scores(corpus: dict[str, dict], got: dict[str, dict], split: str) -> dict[str, tuple[int, int]]:
    names = [n for n, e in corpus.items() if e["split"] == split]
    ooms = [n for n in names if corpus[n]["oom"]]
    shown = [n for n in names if corpus[n]["phase_shown"]]
    return {
        "OOM recognised": (sum(got[n]["oom"] for n in ooms), len(ooms)),
        "phase right": (sum(got[n]["phase"] == corpus[n]["phase"] for n in shown), len(shown)),
        "kind right": (sum(got[n]["kind"] == corpus[n]["kind"] for n in names), len(names)),
    }


def source_of(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="REV", help="also score the code at this git revision")
    args = parser.parse_args()
    corpus = sourced()
    check_split(corpus)
    names = sorted(corpus)
    columns = [("now", answers(ROOT / "src", names))]
    if args.before:
        with tempfile.TemporaryDirectory() as tmp:
            columns.insert(0, (f"before ({args.before})", answers(source_of(args.before, Path(tmp)), names)))
    print(f"{len(names)} real logs; held out: {sum(e['split'] == 'heldout' for e in corpus.values())}")
    print(f"| split | score | {' | '.join(label for label, _ in columns)} |")
    print("|---|---|" + "---|" * len(columns))
    for split in ("train", "heldout"):
        table = [scores(corpus, got, split) for _, got in columns]
        for metric in table[0]:
            cells = " | ".join(f"{t[metric][0]}/{t[metric][1]} ({100 * t[metric][0] / max(1, t[metric][1]):.0f}%)"
                               for t in table)
            print(f"| {split} | {metric} | {cells} |")
    wrong = [(n, corpus[n], columns[-1][1][n]) for n in names
             if columns[-1][1][n]["kind"] != corpus[n]["kind"]
             or (corpus[n]["phase_shown"] and columns[-1][1][n]["phase"] != corpus[n]["phase"])
             or columns[-1][1][n]["oom"] != corpus[n]["oom"]]
    for name, want, got in wrong:
        print(f"  miss ({want['split']}): {name}: want {want['kind']}/{want.get('phase', '(not shown)')}, "
              f"got {got['kind']}/{got['phase']}")


if __name__ == "__main__":
    main()
