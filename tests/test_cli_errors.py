"""Bad input: one line naming the key and the problem, exit code 2, no traceback, nothing written."""

import sys

import pytest

from tests.conftest import DEMO, assert_one_clean_line, run_cli

GOOD = DEMO.read_text()


def _edit(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


CASES = {
    "not_yaml": ("job: [unclosed\n  config: {", "not valid YAML"),
    "no_process": ("job: extension\nconfig:\n  name: x\n", "config.process: missing"),
    "negative_rank": (_edit("linear: 32", "linear: -8"),
                      "config.process[0].network.linear: expected a positive integer"),
    "resolution_not_a_number": (_edit("resolution: [ 256, 384, 512 ]", "resolution: [ 256, big, 512 ]"),
                                "config.process[0].datasets[0].resolution: expected a positive integer"),
    "unknown_fitfinder_key": (_edit("  weights: random", "  weights: random\n  turbo: true"),
                              "fitfinder.turbo: unknown key"),
    "vram_bananas": (_edit("vram: 13.2MiB", "vram: 24 bananas"), "fitfinder.vram: '24 bananas' is not a size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_job_file_gives_one_line_and_exit_2(case, tmp_path):
    text, expected = CASES[case]
    job = tmp_path / "job.yaml"
    job.write_text(text)
    result = run_cli("search", str(job), cwd=tmp_path)
    assert_one_clean_line(result, expected)
    assert job.read_text() == text  # the input is never written to
    assert not (tmp_path / "studies").exists() and not (tmp_path / "results").exists()


def test_missing_file(tmp_path):
    result = run_cli("search", "nowhere.yaml", cwd=tmp_path)
    assert_one_clean_line(result, "nowhere.yaml: no such file")
    assert not (tmp_path / "studies").exists() and not (tmp_path / "results").exists()


def test_bad_vram_option(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(GOOD)
    result = run_cli("search", str(job), "--vram", "lots", cwd=tmp_path)
    assert_one_clean_line(result, "--vram: 'lots' is not a size")


def test_debug_variable_shows_the_traceback(tmp_path):
    result = run_cli("search", "nowhere.yaml", cwd=tmp_path, FITFINDER_DEBUG="1")
    assert result.returncode != 0 and "Traceback" in result.stderr



def test_help_does_not_import_heavy_libraries():
    import subprocess

    code = ("import sys, fitfinder.cli; heavy = [m for m in ('torch', 'diffusers', 'optuna', 'peft', "
            "'transformers') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_answers(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0 and "search" in result.stdout and "probe" in result.stdout


def test_version(tmp_path):
    from fitfinder import __version__

    result = run_cli("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == f"fitfinder {__version__}\n" and result.stderr == ""
