"""Test model (python backend, decoupled): `count` responses for one request, each `text_output` = "<text_input> i",
`delay_ms` apart — what Triton's generate_stream endpoint streams as server-sent events."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode() if isinstance(text, bytes) else str(text)
            count_t = pb_utils.get_input_tensor_by_name(request, "count")
            count = int(count_t.as_numpy().reshape(-1)[0]) if count_t is not None else 3
            delay = float(json.loads(request.parameters() or "{}").get("delay_ms", 0))
            for i in range(count):
                if delay:
                    time.sleep(delay / 1000)
                out = pb_utils.Tensor("text_output", np.array([f"{text} {i}".encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
