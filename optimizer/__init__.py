"""The search and everything a user touches, one sub-package per part: ``search`` (the study,
its space and scoring), ``robust`` (the answer that holds), ``outputs`` (the run folder, engine
files, review, plots), ``fidelity`` (the engine against measured runs), ``bench`` (measuring on
real hardware) and ``cli``."""
