"""Test model (python backend) shaped like Triton's client examples' `simple` and `simple_string`: OUTPUT0 =
INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, elementwise; BYTES tensors hold the integers as decimal text."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a, b = (pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in ("INPUT0", "INPUT1"))
            if a.dtype == np.object_:
                x, y = a.astype(np.int64), b.astype(np.int64)
                outs = [np.array([str(v).encode() for v in z.flat], dtype=np.object_).reshape(z.shape)
                        for z in (x + y, x - y)]
            else:
                outs = [a + b, a - b]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(f"OUTPUT{i}", o) for i, o in enumerate(outs)]))
        return responses
