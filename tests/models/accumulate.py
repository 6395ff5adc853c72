"""Test model (python backend, sequence batching) shaped like Triton's `simple_sequence`: OUTPUT is the sum of the
INPUT values the sequence (its correlation id) has sent so far; the START control starts it over."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().reshape(-1)[0])
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().reshape(-1)[0])
            key = request.correlation_id()
            self.sums[key] = (0 if start else self.sums.get(key, 0)) + value
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", np.array([self.sums[key]], dtype=np.int32))]))
        return responses
