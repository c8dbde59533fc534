"""The Numba cache folder follows the jitted sources, so an edit never reuses stale code."""

import shutil
from pathlib import Path

from costmodels import jitcache

ROOT = Path(jitcache.__file__).resolve().parents[1]


def test_digest_changes_when_any_jitted_source_changes(tmp_path):
    for package in jitcache.JIT_PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    before = jitcache.source_digest(tmp_path)
    assert jitcache.source_digest(tmp_path) == before
    helper = tmp_path / "policies" / "prefix_cache.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert jitcache.source_digest(tmp_path) != before


def test_user_cache_dir_wins(monkeypatch, tmp_path):
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", "unchanged")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    jitcache.configure()
    assert numba.config.CACHE_DIR == "unchanged"
