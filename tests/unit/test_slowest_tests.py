"""``tools.slowest_tests``: what ``scripts/test --all`` prints last about the NeMo environment's run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.slowest_tests import main

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.e2e.test_a" name="test_slow" time="120.5"/>
<testcase classname="tests.e2e.test_a" name="test_fast" time="1.5"/>
<testcase classname="tests.unit.test_b" name="test_mid" time="30.0"/>
</testsuite></testsuites>"""


def test_the_slowest_tests_and_the_time_per_module_are_listed_slowest_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r.xml").write_text(XML)
    assert main([str(tmp_path / "r.xml"), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "slowest tests (3 tests, 2.5 min in all):"
    assert out[1].split() == ["120.5s", "tests.e2e.test_a::test_slow"]
    assert out[2].split() == ["30.0s", "tests.unit.test_b::test_mid"] and len(out) == 6
    assert out[4].split() == ["122.0s", "tests.e2e.test_a"]


def test_a_missing_file_is_said_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "none.xml")]) == 1
    assert "cannot read" in capsys.readouterr().err
