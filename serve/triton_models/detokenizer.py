"""Triton python-backend model: token ids -> text with the model's own Hugging Face tokenizer (special
tokens such as end-of-sequence are dropped, as `tokenizer.decode(ids, skip_special_tokens=True)` does)."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(args["model_repository"], args["model_version"]))

    def execute(self, requests):
        responses = []
        vocab = len(self.tokenizer)
        for r in requests:
            ids = pb_utils.get_input_tensor_by_name(r, "output_ids").as_numpy().reshape(-1).tolist()
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"output_ids holds {bad[0]}, outside the vocabulary 0..{vocab - 1}",
                    pb_utils.TritonError.INVALID_ARG)))
                continue
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]))
        return responses
