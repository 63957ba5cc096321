"""The privacy modes around any registered method: record, local, distributed and central.

A method (:mod:`privfl.methods`) declares what its clients release; this package wraps its strategy and client
procedure for the run's mode (:mod:`privfl.modes.wrappers`: :func:`~privfl.modes.wrappers.protect`) and prices the
run's whole schedule of releases before the first is made (:mod:`privfl.modes.plan`:
:func:`~privfl.modes.plan.plan`). It sits above the methods and below the run config, so a method module never
imports it. The arguments of each mode and the mechanisms they use are in :mod:`privfl.privacy`.
"""
