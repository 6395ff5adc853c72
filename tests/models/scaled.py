"""Test model (python backend): INPUT0 times the number in its version folder's `scale.txt` (1 without one), read
when the model is loaded — weights on disk that a file replaced in place changes only at the next load."""

from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        scale = Path(args["model_repository"]) / args["model_version"] / "scale.txt"
        self.scale = float(scale.read_text()) if scale.exists() else 1.0

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "INPUT0_OUT", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * self.scale)]) for r in requests]
