"""The wheel holds every package of the source tree (a non-editable install imports them all)."""

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "benchmarks", "build"}


def source_packages() -> set[str]:
    found = set()
    for init in ROOT.rglob("__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        if parts and parts[0] not in NOT_SHIPPED and not parts[0].startswith("."):
            found.add(".".join(parts))
    return found


def test_every_source_package_is_in_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(find_packages(str(ROOT), include=config["packages"]["find"]["include"]))
    assert "policies.engines" in source_packages()
    assert source_packages() - shipped == set()
    assert not {p for p in shipped if p.split(".")[0] in NOT_SHIPPED}
