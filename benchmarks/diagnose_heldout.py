"""How `fitfinder diagnose` does on real logs from public issue threads, split into the logs its
rules were written on and a held-out third it never saw.

    python benchmarks/diagnose_heldout.py                 # this checkout
    python benchmarks/diagnose_heldout.py --before REV    # and the code at git revision REV, side by side

The corpus is tests/logs/: every log with a "source" (its thread's URL) in expected.json counts. Logs
came in rounds ("round" in expected.json; none means round 1), and each round's held-out third was
drawn once, before that round's rules were written, with a fixed seed (HELDOUT_SEEDS) over the
round's sorted names and recorded as "split"; this script checks the two agree, so no split can drift.

Scores, per round and split: OOM recognised (among the logs that are an OOM), phase right (among the
logs whose phase the log shows), kind right (config / environment / host / not_oom / cut, all logs),
error read (among the logs without an OOM whose error line the log shows).
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
# Round 1: the first 42 logs (seed 19); round 2: 30 logs for issue 33 (seed 33).
HELDOUT_SEEDS = {1: 19, 2: 33}


def sourced() -> dict[str, dict]:
    expected = json.loads((LOGS / "expected.json").read_text(encoding="utf-8"))
    return {name: entry for name, entry in expected.items() if "source" in entry}


def round_of(entry: dict) -> int:
    return entry.get("round", 1)


def check_split(corpus: dict[str, dict]) -> None:
    for number, seed in HELDOUT_SEEDS.items():
        names = sorted(name for name, entry in corpus.items() if round_of(entry) == number)
        drawn = set(random.Random(seed).sample(names, -(-len(names) // 3)))
        recorded = {name for name in names if corpus[name]["split"] == "heldout"}
        if drawn != recorded:
            sys.exit(f"round {number}: the held-out split in expected.json is not the seeded draw: "
                     f"{sorted(drawn ^ recorded)}")


def answers(src: Path, names: list[str]) -> dict[str, dict]:
    """Each log's answer from the fitfinder under `src`, in a child process (another revision's code)."""
    script = ("import json, sys\nfrom pathlib import Path\nfrom fitfinder import diagnose\n"
              "out = {}\nfor name in sys.argv[2:]:\n"
              "    a = diagnose.diagnose(diagnose.read_log(Path(sys.argv[1]) / name), None, name).as_json()\n"
              "    out[name] = {k: a.get(k) for k in ('oom', 'kind', 'phase', 'error')}\nprint(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script, str(LOGS), *names], capture_output=True, text=True,
                          env={"PYTHONPATH": str(src), "PATH": ""}, check=True)
    return json.loads(done.stdout)


def scores(corpus: dict[str, dict], got: dict[str, dict], names: list[str]) -> dict[str, tuple[int, int]]:
    ooms = [n for n in names if corpus[n]["oom"]]
    shown = [n for n in names if corpus[n]["phase_shown"]]
    errors = [n for n in names if corpus[n].get("error")]
    return {
        "OOM recognised": (sum(got[n]["oom"] for n in ooms), len(ooms)),
        "phase right": (sum(got[n]["phase"] == corpus[n]["phase"] for n in shown), len(shown)),
        "kind right": (sum(got[n]["kind"] == corpus[n]["kind"] for n in names), len(names)),
        "error read": (sum(got[n]["error"] == corpus[n]["error"] for n in errors), len(errors)),
    }


def source_of(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def misses(corpus: dict[str, dict], got: dict[str, dict]) -> list[str]:
    out = []
    for name, want in sorted(corpus.items()):
        answer = got[name]
        if (answer["kind"] != want["kind"] or answer["oom"] != want["oom"]
                or (want["phase_shown"] and answer["phase"] != want["phase"])
                or (want.get("error") and answer["error"] != want["error"])):
            out.append(f"  miss (round {round_of(want)}, {want['split']}): {name}: want "
                       f"{want['kind']}/{want.get('phase', '(not shown)')}, got {answer['kind']}/{answer['phase']}")
    return out


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
    print(f"| round | split | score | {' | '.join(label for label, _ in columns)} |")
    print("|---|---|---|" + "---|" * len(columns))
    for number in HELDOUT_SEEDS:
        for split in ("train", "heldout"):
            group = [n for n in names if round_of(corpus[n]) == number and corpus[n]["split"] == split]
            table = [scores(corpus, got, group) for _, got in columns]
            for metric in table[0]:
                if not table[0][metric][1]:
                    continue
                cells = " | ".join(f"{t[metric][0]}/{t[metric][1]} ({100 * t[metric][0] / t[metric][1]:.0f}%)"
                                   for t in table)
                print(f"| {number} | {split} | {metric} | {cells} |")
    print("\n".join(misses(corpus, columns[-1][1])))


if __name__ == "__main__":
    main()
