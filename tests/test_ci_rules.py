"""The suite's own rule: under CI=true a test that does not run fails the run."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_pytest(tmp_path: pathlib.Path, body: str, ci: bool) -> subprocess.CompletedProcess:
    test = tmp_path / "test_sample.py"
    test.write_text("import pytest\n\n" + body)
    env = dict(os.environ, CI="true" if ci else "")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(test)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_the_run_under_ci_only(tmp_path) -> None:
    body = "def test_skips():\n    pytest.skip('no tool')\n\ndef test_runs():\n    pass\n"
    ci = run_pytest(tmp_path, body, ci=True)
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "did not run, which CI does not allow" in ci.stdout and "test_skips" in ci.stdout
    local = run_pytest(tmp_path, body, ci=False)
    assert local.returncode == 0, local.stdout + local.stderr


def test_skip_marks_and_missing_prerequisites_count_too(tmp_path) -> None:
    body = ("from testbed.prereqs import require\n\n"
            "@pytest.mark.skip(reason='later')\ndef test_marked():\n    pass\n\n"
            "def test_needs_a_tool():\n    require(False, 'a tool')\n")
    ci = run_pytest(tmp_path, body, ci=True)
    assert ci.returncode == 1 and "test_marked" in ci.stdout, ci.stdout
    assert "prerequisite missing in CI: a tool" in ci.stdout
