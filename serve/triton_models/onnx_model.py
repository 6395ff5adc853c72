"""Triton python-backend model: runs the ONNX graph in its version folder with onnxruntime (for Triton
servers without the ONNX Runtime backend).

The logits model (max_batch_size > 0): requests that the dynamic batcher hands over together run as one
onnxruntime call; sequences are right-padded to the longest (attention_mask 0 on the padding; with causal
attention the real positions' logits are unchanged) and the outputs are cut back per request.
The decoder model with a key/value cache (max_batch_size 0): each request's tensors go to onnxruntime as
they are, and every graph output comes back.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from ort_options import session_options


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        onnx_file = config["parameters"]["onnx_file"]["string_value"]
        path = os.path.join(args["model_repository"], args["model_version"], onnx_file)
        opts = session_options(ort)
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.batched = config.get("max_batch_size", 0) > 0
        self.vocab = self.session.get_outputs()[0].shape[-1]  # logits [..., vocab]: token ids must be below it

    def _check_ids(self, ids):
        """None, or the client's mistake: a token id outside the vocabulary (INVALID_ARG, HTTP 400)."""
        if isinstance(self.vocab, int) and ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
            bad = ids.min() if ids.min() < 0 else ids.max()
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"input_ids holds {bad}, outside the vocabulary 0..{self.vocab - 1}", pb_utils.TritonError.INVALID_ARG))
        return None

    def execute(self, requests):
        if self.batched:
            return self._execute_padded(requests)
        responses = []
        for r in requests:
            feeds = {n: pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.input_names}
            refused = self._check_ids(feeds["input_ids"])
            if refused is not None:
                responses.append(refused)
                continue
            values = self.session.run(self.output_names, feeds)
            tensors = [pb_utils.Tensor(n, v) for n, v in zip(self.output_names, values)]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses

    def _execute_padded(self, requests):
        responses = [self._check_ids(pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy()) for r in requests]
        good = [r for r, refused in zip(requests, responses) if refused is None]
        if good:
            answers = iter(self._run_padded(good))
            responses = [refused if refused is not None else next(answers) for refused in responses]
        return responses

    def _run_padded(self, requests):
        ids = [pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy() for r in requests]
        masks = []
        for r, x in zip(requests, ids):
            m = pb_utils.get_input_tensor_by_name(r, "attention_mask")
            masks.append(m.as_numpy() if m is not None else np.ones_like(x))
        longest = max(x.shape[1] for x in ids)
        pad = lambda a: np.pad(a, ((0, 0), (0, longest - a.shape[1])))  # noqa: E731
        feeds = {"input_ids": np.concatenate([pad(x) for x in ids]).astype(np.int64),
                 "attention_mask": np.concatenate([pad(m) for m in masks]).astype(np.int64)}
        logits = self.session.run(["logits"], feeds)[0]
        responses, start = [], 0
        for x in ids:
            out = logits[start:start + x.shape[0], :x.shape[1]]
            start += x.shape[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", np.ascontiguousarray(out))]))
        return responses
