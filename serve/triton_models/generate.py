"""Triton python-backend model: the text-generation entry point (BLS).

text_input (+ optional max_new_tokens, use_kv_cache, stop_token_ids) -> text_output, output_ids, prompt_tokens (the
prompt's length in tokens: what the gateway charges a tenant with the new ids). Each request is
tokenized by the tokenizer model; the requests the dynamic batcher hands over together are decoded as one batch
(right-padded, padding masked); the new ids go to the detokenizer model. Each request chooses its tokens by its
own sampling parameters (request parameters temperature, top_k, top_p, min_p, repetition_penalty,
presence_penalty, frequency_penalty, seed: sampling.py beside this file); greedy when it gives none. Two
decoding loops:
  with the key/value cache (default)  dstool's one decode loop (engine.py beside this file) over the decoder
                                       model, called through Triton: the batch's prompts prefilled together, then
                                       one call per new token that feeds only that token and the cache returned
                                       by the call before; a request that fails there ends alone;
  without it (use_kv_cache=false)      one call of the logits model per new token on the whole sequence.
Greedy decoding equals `model.generate(do_sample=False)` in PyTorch; a request stops at the end-of-sequence
token, at one of its stop_token_ids, or after max_new_tokens.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from decoding.engine import Engine, Sequence
from decoding.sampling import SamplingError, request_choices


class RequestError(ValueError):
    """The client's mistake (reported to that request only, as INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT)."""


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.models = json.loads(params["models"])  # tokenizer, detokenizer, decoder, logits
        self.llm_name = args["model_name"].removesuffix("_generate") + "_llm"
        self.empty_cache = json.loads(params["empty_cache"])  # cache input name -> [kv_heads, head_dim]
        self.eos = set(json.loads(params["eos_token_ids"]))
        self.default_new_tokens = int(params["default_max_new_tokens"])
        self.max_positions = int(params["max_positions"])
        self.max_prompt_bytes = int(params.get("max_prompt_bytes", 256 * self.max_positions))  # see llm.py

    def execute(self, requests):
        responses = [None] * len(requests)
        jobs: dict[bool, list] = {True: [], False: []}  # use_kv_cache -> [(request, prompt ids, job)]
        for i, r in enumerate(requests):
            try:
                jobs[self._flag(r, "use_kv_cache", True)].append((i, *self._prepare(r)))
            except RequestError as e:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        for use_cache, batch in jobs.items():
            if not batch:
                continue
            loop = self._generate_with_cache if use_cache else self._generate_without_cache
            for (i, prompt, _), new_ids in zip(batch, loop([p for _, p, _ in batch], [j for _, _, j in batch])):
                if isinstance(new_ids, str):  # this request failed in the engine; the others go on
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(new_ids))
                    continue
                ids = np.asarray(new_ids, dtype=np.int64)
                text = self._infer(self.models["detokenizer"], {"output_ids": ids}, ["text_output"])[0]
                responses[i] = pb_utils.InferenceResponse([
                    pb_utils.Tensor("text_output", text.reshape(1, 1)), pb_utils.Tensor("output_ids", ids[None]),
                    pb_utils.Tensor("prompt_tokens", np.array([[len(prompt)]], dtype=np.int32))])
        return responses

    def _prepare(self, request):
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)
        if text.size != 1:
            raise RequestError(f"send one prompt per request (got {text.size}); concurrent requests are batched "
                               "by the server")
        if len(text[0]) > self.max_prompt_bytes:
            raise RequestError(f"text_input is {len(text[0])} bytes: more than the model's {self.max_positions} "
                               f"positions can hold (at most {self.max_prompt_bytes} bytes); shorten it")
        if isinstance(text[0], bytes):
            try:
                text[0].decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"text_input is not valid UTF-8 (byte {e.start}): send UTF-8 text") from None
        prompt = self._infer(self.models["tokenizer"], {"text_input": text.astype(np.object_)}, ["input_ids"])[0]
        if prompt.size == 0:
            raise RequestError("text_input is empty: send at least one token of text")
        try:
            new_tokens, sampler, stop_ids = request_choices(
                request.parameters(), prompt.size, _values(request, "max_new_tokens"), self.default_new_tokens,
                self.max_positions, _values(request, "stop_token_ids"), self.eos)
        except SamplingError as e:
            raise RequestError(str(e)) from None
        if sampler.logprobs is not None:
            raise RequestError(f"logprobs: this model does not report them; ask {self.llm_name} (the streaming "
                               "model) or the gateway's OpenAI route")
        return prompt.reshape(-1).tolist(), Job(new_tokens, sampler, stop_ids)

    @staticmethod
    def _flag(request, name, default):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return bool(t.as_numpy().reshape(-1)[0]) if t is not None else default

    def _infer(self, model, inputs, outputs):
        """One BLS call; returns the requested outputs as numpy arrays."""
        response = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs,
                                             inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()]).exec()
        if response.has_error():
            raise pb_utils.TritonModelException(f"{model}: {response.error().message()}")
        return [pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs]

    @staticmethod
    def _step(generated, done, next_ids, jobs):
        for b, token in enumerate(next_ids):
            if not done[b]:
                generated[b].append(int(token))
                done[b] = int(token) in jobs[b].stop_ids or len(generated[b]) >= jobs[b].max_new_tokens

    @staticmethod
    def _choose(logits, rows, prompts, generated, jobs):
        """Each request's next token from its row of logits, by its own sampler."""
        return np.array([jobs[b].sampler.next(logits[r], prompts[b], generated[b]) for r, b in enumerate(rows)])

    def _generate_with_cache(self, prompts, jobs):
        """Each request's new ids (or, for one that failed, its error) from the engine over the decoder model."""
        engine = Engine(_Decoder(self), {k: tuple(v) for k, v in self.empty_cache.items()}, max_batch=len(prompts),
                        max_prefill_tokens=max(sum(map(len, prompts)), 1))
        sequences = [Sequence(str(b), prompt, job.max_new_tokens, job.sampler.next, set(job.stop_ids))
                     for b, (prompt, job) in enumerate(zip(prompts, jobs))]
        for sequence in sequences:
            engine.add(sequence)
        while engine.busy:
            engine.step()
        return [s.error if s.error else s.output for s in sequences]

    def _generate_without_cache(self, prompts, jobs):
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        while not all(done):
            active = [b for b in range(len(prompts)) if not done[b]]  # finished rows are not recomputed
            sequences = [prompts[b] + generated[b] for b in active]
            ids, mask = _right_padded(sequences)
            logits = self._infer(self.models["logits"], {"input_ids": ids, "attention_mask": mask}, ["logits"])[0]
            next_ids = [0] * len(prompts)
            last = logits[np.arange(len(active)), [len(s) - 1 for s in sequences]]
            for b, token in zip(active, self._choose(last, active, prompts, generated, jobs)):
                next_ids[b] = token
            self._step(generated, done, next_ids, jobs)
        return generated


class _Decoder:
    """The decoder model, called through Triton, as the engine runs a graph: `run(output names, feeds)`."""

    def __init__(self, model):
        self.model = model

    def run(self, names, feeds):
        return self.model._infer(self.model.models["decoder"], feeds, names)


class Job:
    """What one request asked for: how many new tokens at most, how to choose them, where to stop."""

    def __init__(self, max_new_tokens, sampler, stop_ids):
        self.max_new_tokens, self.sampler, self.stop_ids = max_new_tokens, sampler, stop_ids


def _values(request, name):
    """An optional input's values, or None."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor.as_numpy() if tensor is not None else None


def _right_padded(sequences):
    """[batch, longest] int64 ids and attention mask (0 on the padding)."""
    longest = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), longest), np.int64)
    mask = np.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, :len(s)], mask[b, :len(s)] = s, 1
    return ids, mask
