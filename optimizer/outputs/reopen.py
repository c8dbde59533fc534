"""Reading a run folder back: its study and spec, and the run folders of a study folder.

``report`` and ``export`` work from a run folder alone (its ``study.json`` manifest and its
storage), from any working directory, long after ``tune`` ran.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna

from optimizer.outputs.summary import redact_url
from optimizer.outputs.trials import OutputError


def target_folders(run_dir: str | Path) -> list[Path]:
    """The run folders below a study folder (``runs/<study>/<target>``), or the folder itself
    when it is one; empty when neither."""
    from optimizer.search.study import MANIFEST

    run_dir = Path(run_dir)
    if (run_dir / MANIFEST).is_file():
        return [run_dir]
    return sorted(p.parent for p in run_dir.glob(f"*/{MANIFEST}")) if run_dir.is_dir() else []


def target_folder(run_dir: str | Path, target: str | None) -> Path:
    """The run folder of ``target`` in a study folder (or ``run_dir`` itself when it is a run
    folder); OutputError naming the targets found when it is ambiguous or missing."""
    run_dir = Path(run_dir)
    found = target_folders(run_dir)
    if found == [run_dir]:
        return run_dir
    names = [p.name for p in found]
    if target is not None and target in names:
        return run_dir / target
    if target is None and len(found) == 1:
        return found[0]
    if not found:
        return run_dir  # open_run names what is missing
    raise OutputError(f"{run_dir} holds the studies of {names}; pass --backend NAME or one of "
                      + ", ".join(str(p) for p in found))


def open_run(run_dir: str | Path, storage: str | None = None):
    """(spec, study) of a run folder, from its ``study.json`` manifest and its storage.

    ``storage`` (or ``SERVETUNE_STORAGE``) is needed when the study lives in a database:
    the manifest keeps its URL without the password. Works from any working directory
    (``stored_paths``).
    """
    import os

    from optimizer.search.spec import spec_from_dict
    from optimizer.search.study import JOURNAL, MANIFEST, open_storage

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OutputError(f"run folder {run_dir} does not exist")
    manifest_path = run_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise OutputError(f"{run_dir} has no {MANIFEST}: not a servetune run folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise OutputError(f"{manifest_path} is unreadable ({exc})") from None
    stored = manifest.get("storage") or JOURNAL
    url = storage or os.environ.get("SERVETUNE_STORAGE")
    if url is None:
        if "***" in stored:
            raise OutputError(f"study {manifest.get('study_name')!r} lives in {stored}; pass --storage with the "
                              "full URL (or set SERVETUNE_STORAGE)")
        url = stored if "://" in stored else str(run_dir / stored)
        if "://" not in url and not Path(url).is_file():
            raise OutputError(f"run folder {run_dir} has no study storage {url}")
    stored_spec = manifest.get("spec", {})
    spec = spec_from_dict(stored_spec, storage=url, run_dir=run_dir, **stored_paths(stored_spec, run_dir))
    try:
        study = optuna.load_study(study_name=spec.study_name, storage=open_storage(spec))
    except KeyError:
        raise OutputError(f"no study {spec.study_name!r} in {redact_url(url)}") from None
    return spec, study


def stored_paths(stored: Mapping[str, Any], run_dir: Path) -> dict[str, Path]:
    """The trace, calibration and model-config paths of a manifest's spec, made absolute.

    Manifests store them absolute; older ones as given to ``tune``, relative to where it
    ran: the folder from which the stored ``run_dir`` leads to ``run_dir`` (else the
    current one).
    """
    given = {"trace": (stored.get("trace") or {}).get("path"),
             **{k: (stored.get("deployment") or {}).get(k) for k in ("calibration", "model_config")}}
    relative = Path((stored.get("study") or {}).get("run_dir") or "")
    here = run_dir.resolve()
    origin = Path.cwd()
    if relative.parts and not relative.is_absolute() and here.parts[-len(relative.parts):] == relative.parts:
        origin = here.parents[len(relative.parts) - 1]
    return {k: origin / v for k, v in given.items() if isinstance(v, str)}
