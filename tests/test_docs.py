"""The documentation keeps up with the code: docs/configuration.md lists every key of
packaging/configuration.toml and of the configuration's dataclasses under its table's
heading, the README stays a front door (short, and one click from each manual page)."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib

import pytest

from shim import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "packaging" / "configuration.toml"
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"
README_MAX_LINES = 260
MANUAL = ("design", "install", "configuration", "benchmarks", "guest", "threat-model",
          "testing")
"""The pages of docs/ the README links to."""

TABLE = re.compile(r"^\[([\w.-]+)\]\s*$")
COMMENTED_KEY = re.compile(r"^#\s*([a-z_][a-z0-9_]*\s*=.*)$")
HEADING = re.compile(r"^(#+)\s")
ROW_KEY = re.compile(r"^\|\s*`([\w.-]+)`\s*\|")


def _tables(data: dict, prefix: str = "") -> dict[str, set[str]]:
    """Every TOML table that sets keys, by its dotted name, with those keys (`hypervisor`
    only holds `[hypervisor.qemu]`)."""
    out: dict[str, set[str]] = {}
    keys = {k for k, v in data.items() if not isinstance(v, dict)}
    if prefix and keys:
        out[prefix] = keys
    for name, value in data.items():
        if isinstance(value, dict):
            out.update(_tables(value, f"{prefix}.{name}" if prefix else name))
    return out


def packaged_keys(text: str) -> dict[str, set[str]]:
    """The keys of each table of the packaged file, those commented out (`# key = value`,
    a key shown with the default it has when unset) included."""
    tables = _tables(tomllib.loads(text))
    table = None
    for line in text.splitlines():
        if m := TABLE.match(line):
            table = m.group(1)
        elif table is not None and (m := COMMENTED_KEY.match(line)):
            try:  # a line of prose with an "=" in it is no key
                tables.setdefault(table, set()).update(tomllib.loads(m.group(1)))
            except tomllib.TOMLDecodeError:
                pass
    return tables


def dataclass_keys() -> dict[str, set[str]]:
    """The fields of the dataclass behind each table the configuration knows."""
    defaults = config.Config()
    return {section: {f.name for f in dataclasses.fields(getattr(defaults, attr))}
            for section, attr in config._SECTIONS.items()}


def documented_keys(text: str) -> dict[str, set[str]]:
    """The keys in the first column of the tables under each heading that names a TOML
    table (`## `[runtime]``), down to the next heading of the same level or above."""
    out: dict[str, set[str]] = {}
    table, level = None, 0
    for line in text.splitlines():
        if m := HEADING.match(line):
            depth = len(m.group(1))
            named = re.search(r"`\[([\w.-]+)\]`", line)
            if named:
                table, level = named.group(1), depth
                out.setdefault(table, set())
            elif table is not None and depth <= level:
                table = None
        elif table is not None and (m := ROW_KEY.match(line)):
            out[table].add(m.group(1))
    return out


def missing(wanted: dict[str, set[str]], documented: dict[str, set[str]]) -> list[str]:
    return sorted(f"[{table}] {key}" for table, keys in wanted.items()
                  for key in keys - documented.get(table, set()))


def test_every_packaged_key_is_documented_under_its_table() -> None:
    wanted = packaged_keys(PACKAGED.read_text())
    assert set(wanted) == set(config._SECTIONS), "the packaged file's tables changed"
    gaps = missing(wanted, documented_keys(CONFIGURATION_DOC.read_text()))
    assert not gaps, "keys of packaging/configuration.toml missing from " \
        "docs/configuration.md:\n" + "\n".join(gaps)


def test_every_configuration_field_is_documented_under_its_table() -> None:
    gaps = missing(dataclass_keys(), documented_keys(CONFIGURATION_DOC.read_text()))
    assert not gaps, "fields of shim/config.py missing from docs/configuration.md:\n" + \
        "\n".join(gaps)


def test_commented_out_keys_count() -> None:
    """A key shown commented out (the default is computed) is still a key to document."""
    text = "[hypervisor.qemu]\npath = \"q\"\n# virtio_fs_daemon = \"/x\"\n# QEMU binary.\n" \
           "# lsm=capability init_on_alloc=0): prose\n[runtime]\nsizing = \"sum\"\n"
    assert packaged_keys(text) == {"hypervisor.qemu": {"path", "virtio_fs_daemon"},
                                   "runtime": {"sizing"}}
    assert "virtio_fs_daemon" in packaged_keys(PACKAGED.read_text())["hypervisor.qemu"]


def test_the_check_names_a_key_the_page_lost() -> None:
    text = CONFIGURATION_DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `scratch_path` |"))
    without = text.replace(row + "\n", "")
    assert missing(packaged_keys(PACKAGED.read_text()), documented_keys(without)) == \
        ["[hypervisor.qemu] scratch_path"]
    # under another table's heading is not under its own
    moved = without.replace("## `[runtime]`\n", "## `[runtime]`\n\n" + row + "\n")
    assert missing(dataclass_keys(), documented_keys(moved)) == \
        ["[hypervisor.qemu] scratch_path"]


def test_the_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most " \
        f"{README_MAX_LINES}): move the detail into docs/"


@pytest.mark.parametrize("page", MANUAL)
def test_the_readme_links_each_manual_page(page: str) -> None:
    assert (ROOT / "docs" / f"{page}.md").is_file()
    assert re.search(rf"\]\(docs/{re.escape(page)}\.md(#[\w-]*)?\)", README.read_text()), \
        f"README.md does not link docs/{page}.md"
