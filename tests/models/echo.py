"""Test model (python backend): every input comes back as the output of the same name with an `_OUT` suffix, after
an optional delay (request parameter `delay_ms`) — a slow or frozen model on demand. Errors on request: a request
parameter `fail` makes it answer with that message as an INVALID_ARG error. For a test that must act while a request
is in the model (not after a guess of how long it takes to get there): `started`, a file made when the request begins,
and `hold`, a file the request waits for (120 s at most) before it answers."""

import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config["input"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters() or "{}")
            if "started" in params:
                with open(params["started"], "w"):
                    pass
            if "hold" in params:
                until = time.monotonic() + 120
                while not os.path.exists(params["hold"]) and time.monotonic() < until:
                    time.sleep(0.01)
            delay = float(params.get("delay_ms", 0))
            if delay:
                time.sleep(delay / 1000)
            if "fail" in params:
                error = pb_utils.TritonError(str(params["fail"]), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            outputs = [pb_utils.Tensor(name + "_OUT", pb_utils.get_input_tensor_by_name(request, name).as_numpy())
                       for name in self.inputs if pb_utils.get_input_tensor_by_name(request, name) is not None]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
