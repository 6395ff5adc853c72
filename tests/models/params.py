"""Test model (python backend): the request's parameters — the headers Triton forwards among them — as JSON text."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "PARAMS", np.array([json.dumps(json.loads(r.parameters() or "{}"), sort_keys=True).encode()],
                               dtype=np.object_))]) for r in requests]
