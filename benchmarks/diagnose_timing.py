"""How long `fitfinder diagnose` takes on long and hostile logs (issue 35): every reader linear, the read
capped at diagnose.MAX_LOG_BYTES, anything but a regular file refused in one line.

    python benchmarks/diagnose_timing.py                  # this checkout
    python benchmarks/diagnose_timing.py --before REV     # and the code at git revision REV

Each case is a log written to a temporary folder and read by `diagnose.run` in a child process (the
time is the call's, without Python's start: CPU time, and wall time in brackets), stopped after
--timeout seconds and held to 2 GiB of memory (the code before the cap read /dev/zero until it ran
out). Times depend on the machine; the shape (how the time grows with the log) is the figure.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from diagnose_heldout import source_of  # noqa: E402  (the same checkout of another revision)

OOM = ('Traceback (most recent call last):\n  File "train_network.py", line 9, in train\n'
       '    accelerator.backward(loss)\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n')


def steps(n: int) -> str:
    return "".join(f"steps:  {100 * i // n:2d}%|#####     | {i}/{n} [00:{i % 60:02d}<01:00,  1.50it/s, "
                   f"avr_loss=0.123]\n" for i in range(1, n + 1))


def write_cases(folder: Path) -> dict[str, Path]:
    cases = {}
    for n in (1_000, 2_000, 4_000, 10_000, 100_000):
        cases[f"{n:,} steps lines"] = folder / f"steps{n}.log"
        cases[f"{n:,} steps lines"].write_text(steps(n) + OOM)
    big = folder / "big.log"  # about 200 MB: the same 100,000 lines, 27 times over
    chunk = steps(100_000)
    with big.open("w") as handle:
        for _ in range(27):
            handle.write(chunk)
        handle.write(OOM)
    cases[f"a {big.stat().st_size / 1e6:.0f} MB log"] = big
    cases["20,000 skipped batches between bars"] = folder / "skipped.log"
    cases["20,000 skipped batches between bars"].write_text(
        "".join(f"{line}OOM during training step, skipping batch 1/3\n" for line in steps(20_000).splitlines(True)))
    cases["/dev/zero"] = Path("/dev/zero")
    os.mkfifo(folder / "fifo.log")
    cases["a FIFO"] = folder / "fifo.log"
    return cases


def timed(src: Path, log: Path, timeout: float) -> str:
    script = ("import sys, time\nfrom pathlib import Path\nfrom fitfinder import diagnose\n"
              "from fitfinder.errors import UserError\nstarted, cpu = time.perf_counter(), time.process_time()\n"
              "try:\n    answer = diagnose.run(Path(sys.argv[1]))\n    outcome = answer.kind\n"
              "except UserError as exc:\n    outcome = 'refused: ' + str(exc).split(': ', 1)[1][:40]\n"
              "print(f'{time.process_time() - cpu:.2f} s CPU ({time.perf_counter() - started:.2f} s), {outcome}')\n")

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    try:
        done = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True,
                              timeout=timeout, env={"PYTHONPATH": str(src), "PATH": ""}, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        return f"over {timeout:.0f} s (stopped)"
    if done.returncode:
        return f"failed: {done.stderr.strip().splitlines()[-1][:80]}"
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="REV", help="also time the code at this git revision")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a case is stopped [120]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = write_cases(folder)
        columns = [("now", ROOT / "src")]
        if args.before:
            columns.insert(0, (f"before ({args.before})", source_of(args.before, folder / "before")))
        print(f"| log | {' | '.join(label for label, _ in columns)} |")
        print("|---|" + "---|" * len(columns))
        for name, log in cases.items():
            print(f"| {name} | {' | '.join(timed(src, log, args.timeout) for _, src in columns)} |", flush=True)


if __name__ == "__main__":
    main()
