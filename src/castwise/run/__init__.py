"""What one run is asked, parsed once: the ``RunRequest`` every entry (audit, numerics, the
distributed audit, the callbacks) checks with one wording, and its ``Inputs``."""

from castwise.run.inputs import Inputs, map_tensors
from castwise.run.request import RunRequest, check, model_device
from castwise.trace.attribution import tensors_of

__all__ = ["Inputs", "RunRequest", "check", "map_tensors", "model_device", "tensors_of"]
