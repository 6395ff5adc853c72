"""Triton python-backend model: the text-generation entry point (BLS).

text_input (+ optional max_new_tokens, use_kv_cache, stop_token_ids) -> text_output, output_ids. Each request is
tokenized by the tokenizer model; the requests the dynamic batcher hands over together are decoded as one batch
(right-padded, padding masked); the new ids go to the detokenizer model. Each request chooses its tokens by its
own sampling parameters (request parameters temperature, top_k, top_p, min_p, repetition_penalty,
presence_penalty, frequency_penalty, seed: sampling.py beside this file); greedy when it gives none. Two
decoding loops:
  with the key/value cache (default)  one prefill call of the decoder model, then one call per new token
                                       that feeds only that token and the cache returned by the call before;
  without it (use_kv_cache=false)      one call of the logits model per new token on the whole sequence.
Greedy decoding equals `model.generate(do_sample=False)` in PyTorch; a request stops at the end-of-sequence
token, at one of its stop_token_ids, or after max_new_tokens.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from sampling import SamplingError, request_choices


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
            for (i, _, _), new_ids in zip(batch, loop([p for _, p, _ in batch], [j for _, _, j in batch])):
                ids = np.asarray(new_ids, dtype=np.int64)
                text = self._infer(self.models["detokenizer"], {"output_ids": ids}, ["text_output"])[0]
                responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text.reshape(1, 1)),
                                                           pb_utils.Tensor("output_ids", ids[None])])
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
        batch, lengths = len(prompts), np.array([len(p) for p in prompts])
        ids, mask = _right_padded(prompts)
        positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int64)
        cache = {name: np.zeros((batch, heads, 0, dim), np.float32) for name, (heads, dim) in self.empty_cache.items()}
        cache_outputs = [name.replace("past_key_values.", "cache.", 1) for name in cache]
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * batch
        logits, *values = self._infer(self.models["decoder"], {"input_ids": ids, "attention_mask": mask,
                                                               "position_ids": positions, **cache},
                                      ["logits", *cache_outputs])
        rows = list(range(batch))
        next_ids = self._choose(logits[np.arange(batch), lengths - 1], rows, prompts, generated, jobs)
        for step in range(max(j.max_new_tokens for j in jobs)):
            self._step(generated, done, next_ids, jobs)
            if all(done):
                break
            cache = dict(zip(cache, values))
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
            logits, *values = self._infer(self.models["decoder"], {
                "input_ids": next_ids[:, None].astype(np.int64), "attention_mask": mask,
                "position_ids": (lengths + step)[:, None].astype(np.int64), **cache}, ["logits", *cache_outputs])
            next_ids = self._choose(logits[:, -1], rows, prompts, generated, jobs)
        return generated

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
