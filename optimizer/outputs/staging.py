"""Writing the run folder's outputs so that a kill never mixes two generations.

The outputs are swapped in whole, so a kill while writing never leaves a file of the new
recommendation beside a summary of the old one: each run writes a new generation folder
``RUN_DIR/.outputs/gen-<pid>-*``, then points the link ``RUN_DIR/.outputs/current`` at it
in one rename. Every output name in the run folder (``summary.json``, ``vllm.yaml``,
``plots``, ...) is a link through ``.outputs/current``, so readers, and scripts that
``scp -r`` or ``cd`` into the folder, see one generation or the other, never a mix. The
study's storage and ``study.json`` and anything else in the folder are left where they are;
a failed write removes its generation, and a later write removes those of dead processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The run folder's output generations, and the link to the one its output names show.
OUTPUTS, CURRENT = ".outputs", "current"


@contextmanager
def staged_outputs(run_dir: Path) -> Iterator[Path]:
    """A new generation folder to write the outputs into: swapped in whole when the body
    returns, removed when it raises (see the module docstring)."""
    home = run_dir / OUTPUTS
    home.mkdir(parents=True, exist_ok=True)
    gen = Path(tempfile.mkdtemp(prefix=f"gen-{os.getpid()}-", dir=home))
    gen.chmod(0o755)  # mkdtemp's 0700 would hide the outputs from other users
    try:
        yield gen
    except BaseException:
        shutil.rmtree(gen, ignore_errors=True)
        raise
    _swap_in(run_dir, gen)


def _swap_in(run_dir: Path, gen: Path) -> None:
    """Link each of ``gen``'s names from the run folder, then make ``gen`` current in one rename."""
    from optimizer.search.study import alive

    names = {p.name for p in gen.iterdir()}
    for name in sorted(names):
        link, target = run_dir / name, f"{OUTPUTS}/{CURRENT}/{name}"
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_dir() and not link.is_symlink():  # a folder written before generations (plots)
            shutil.rmtree(link)
        _replace_link(link, target)
    _replace_link(gen.parent / CURRENT, gen.name)
    for link in run_dir.iterdir():  # outputs the new generation has not, or links a kill left half made
        if link.is_symlink() and os.readlink(link).startswith(f"{OUTPUTS}/") and link.name not in names:
            link.unlink()
    for old in gen.parent.glob("gen-*"):
        pid = old.name.split("-")[1]
        if old != gen and not (pid.isdigit() and int(pid) != os.getpid() and alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)


def _replace_link(link: Path, target: str) -> None:
    """Make ``link`` point at ``target`` in one rename (readers see the old or the new)."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)
