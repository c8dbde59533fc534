"""Hardware truth: model architectures, GPU specs, KV capacity and profiled step time.

``build(model, gpu, tp, framework, ...)`` returns a ``CostModel``; the engine looks step
times up with ``step_seconds(cost.tables, ...)``.
"""

# First: point Numba's cache at this source version before any @njit(cache=True) runs.
from costmodels import jitcache  # noqa: F401
from costmodels.architecture import ModelArch, load_model
from costmodels.build import build
from costmodels.calibration import calibrate, load_calibration, save_calibration
from costmodels.costmodel import CostModel, CostModelError
from costmodels.gpus import GPUSpec, load_gpu, register_gpu
from costmodels.runs import load_runs
from costmodels.sps import read_step_csv, sps_curve, write_sps_csv
from costmodels.steptable import StepTables, linear_tables, step_seconds

__all__ = [
    "CostModel", "CostModelError", "GPUSpec", "ModelArch", "StepTables", "build", "calibrate",
    "linear_tables", "load_calibration", "load_gpu", "load_model", "load_runs", "read_step_csv",
    "register_gpu", "save_calibration", "sps_curve", "step_seconds", "write_sps_csv",
]
