"""Triton python-backend model: text -> token ids with the model's own Hugging Face tokenizer (the files
in its version folder), exactly as `AutoTokenizer(text)` tokenizes for PyTorch."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(args["model_repository"], args["model_version"]))

    def execute(self, requests):
        responses = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0]
            try:
                text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            except UnicodeDecodeError as e:
                message = f"text_input is not valid UTF-8 (byte {e.start}): send UTF-8 text"
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)))
                continue
            ids = np.asarray(self.tokenizer(text)["input_ids"], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
        return responses
